"""The forms of a vLLM target, and the release-table row each is held to.

- ``vllm==X.Y.Z``: a PyPI release, installed into the cache (``kvoffload install``);
- ``vllm@PATH``: a local vLLM source tree or checkout (a pull request's branch), whose
  Python sources run with the cache's shared environment;
- ``vllm``: the vLLM importable in the current environment (vLLM's own CI, say).

A tree's or environment's version is what it says of itself (``vllm/_version.py``, else the
tag ``git describe`` finds); the checks are those of that release in
:mod:`kvoffload.upstream.releases`, or of the newest release before it (a branch past 0.34.0
is held to 0.34.0's expectations). ``--expect conform`` keeps only the check it must conform
to; ``--expect VARIANT`` holds it to that model variant instead.

Invariant: every target names a version or says it has none, and its checks are exactly one
``conform`` check of the offload machine (and, where the row has one, of the machine over
vLLM's own scheduler) plus, for a release with known bugs, the checks that must find them.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvoffload.model.errors import ConfigError
from kvoffload.model.variants import VARIANTS, is_variant
from kvoffload.upstream.install import parse_target
from kvoffload.upstream.releases import Check, Release, governing_release

_VERSION_FILE = re.compile(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")
_TAG = re.compile(r"^v?(\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class VllmTarget:
    spec: str  # as given on the command line
    kind: str  # "release", "tree" or "current"
    version: str | None  # what the target says it is; None if it cannot tell
    path: Path | None = None  # the tree's root (the folder holding vllm/)

    @property
    def label(self) -> str:
        """How results name it: ``vllm==0.34.0``, ``vllm@PATH (0.34.1.dev3)``."""
        if self.kind == "release":
            return self.spec
        return f"{self.spec} ({self.version or 'version unknown'})"


def is_vllm_target(spec: str) -> bool:
    return spec == "vllm" or spec.startswith(("vllm==", "vllm@"))


def parse(spec: str) -> VllmTarget:
    """The target ``spec`` names; a :class:`ConfigError` says why it names none."""
    if spec.startswith("vllm=="):
        return VllmTarget(spec, "release", parse_target(spec))
    if spec.startswith("vllm@"):
        root = Path(spec.removeprefix("vllm@")).expanduser()
        if not (root / "vllm" / "v1" / "simple_kv_offload" / "manager.py").is_file():
            raise ConfigError(
                f"{root} is not a vLLM source tree: it has no vllm/v1/simple_kv_offload/manager.py"
            )
        return VllmTarget(spec, "tree", tree_version(root), root.absolute())
    if spec == "vllm":
        return VllmTarget(spec, "current", installed_version())
    raise ConfigError(f"target {spec!r} is none of vllm==X.Y.Z, vllm@PATH, vllm")


def tree_version(root: Path) -> str | None:
    """The version a vLLM tree says it is: its ``_version.py`` (written when it is built or
    installed), else the nearest release tag of its git history."""
    written = root / "vllm" / "_version.py"
    if written.is_file():
        found = _VERSION_FILE.search(written.read_text(errors="replace"))
        if found:
            return found.group(1)
    try:
        tag = subprocess.run(
            ["git", "-C", str(root), "describe", "--tags", "--abbrev=0"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _TAG.match(tag)
    return match.group(1) if match else None


def installed_version() -> str | None:
    """The version of the vLLM this environment imports (its distribution's metadata)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def checks_for(target: VllmTarget, expect: str | None) -> tuple[Release, tuple[Check, ...]]:
    """The row ``target`` is held to and the checks to run; ``expect`` overrides them."""
    row = governing_release(target.version)
    if expect is None:
        return row, row.checks
    if expect == "conform":
        return row, tuple(c for c in row.checks if c.expect == "conform")
    if not is_variant(expect):
        raise ConfigError(
            f"--expect {expect!r} is neither 'conform' nor a model variant; known: "
            f"{sorted(VARIANTS)}"
        )
    return row, (Check(expect, "conform", f"--expect {expect}"),)
