"""The forms of a vLLM target, and the release-table row each is held to.

- ``vllm==X.Y.Z``: a PyPI release, installed into the cache (``kvoffload install``);
- ``vllm@PATH``: a local vLLM source tree or checkout (a pull request's branch), whose
  Python sources run with the cache's shared environment;
- ``vllm``: the vLLM importable in the current environment (vLLM's own CI, say).

A target names itself exactly (:meth:`VllmTarget.identity`): a release by its version, a tree
by its folder and the digest of its Python sources (:func:`tree_digest`), an environment by
vLLM's version and the folder it imports vLLM from. A failure records that identity, so that
it is replayed on the very code that failed (``kvoffload replay --run``), never on a release
that happens to share the tree's version.

A tree's or environment's version is what it says of itself (``vllm/_version.py``, else the
tag ``git describe`` finds); the checks are those of that release in
:mod:`kvoffload.vllm_target.releases`, or of the newest release before it (a branch past 0.34.0
is held to 0.34.0's expectations). ``--expect conform`` keeps only the check it must conform
to; ``--expect VARIANT`` holds it to that model variant instead.

Invariants: every target names a version or says it has none; a tree's identity changes
whenever one of its Python sources does (IDENTITY); and its checks are exactly one
``conform`` check of the offload machine (and, where the row has one, of the machine over
vLLM's own scheduler) plus, for a release with known bugs, the checks that must find them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.errors import ConfigError
from kvoffload.model.variants import VARIANTS, is_variant
from kvoffload.vllm_target.releases import Check, Release, governing_release

# The variable by which a release's process knows the target it runs (a JSON identity).
TARGET_VARIABLE = "KVOFFLOAD_VLLM_TARGET"
_VERSION_FILE = re.compile(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")
_TAG = re.compile(r"^v?(\d+\.\d+\.\d+)")


_RELEASE_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def parse_target(target: str) -> str:
    """``vllm==0.29.0`` -> ``0.29.0``; anything else is a :class:`ConfigError`."""
    name, sep, version = target.partition("==")
    if name != "vllm" or not sep or not _RELEASE_VERSION.match(version):
        raise ConfigError(f"target {target!r} is not of the form vllm==X.Y.Z")
    return version


@dataclass(frozen=True)
class VllmTarget:
    spec: str  # as given on the command line
    kind: str  # "release", "tree" or "current"
    version: str | None  # what the target says it is; None if it cannot tell
    path: Path | None = None  # the tree's root (the folder holding vllm/); the environment's
    digest: str | None = None  # a tree's: tree_digest of its sources when it was named

    @property
    def label(self) -> str:
        """How results name it: ``vllm==0.34.0``, ``vllm@PATH (0.34.1.dev3)``."""
        if self.kind == "release":
            return self.spec
        return f"{self.spec} ({self.version or 'version unknown'})"

    def identity(self) -> dict[str, Any]:
        """What a failure records of its target: the kind and version, and for a tree its
        folder and digest, for an environment the folder vLLM is imported from."""
        found: dict[str, Any] = {"kind": self.kind, "version": self.version}
        if self.path is not None:
            found["path"] = str(self.path)
        if self.digest is not None:
            found["digest"] = self.digest
        return found


def from_identity(identity: dict[str, Any]) -> VllmTarget:
    """The target a failure's identity names (as it is named now: a tree's digest is the one
    recorded, to be compared with :func:`tree_digest` of the tree as it is)."""
    kind, version = identity["kind"], identity.get("version")
    path = Path(identity["path"]) if identity.get("path") else None
    if kind == "release":
        return VllmTarget(f"vllm=={version}", kind, version)
    if kind == "tree":
        return VllmTarget(f"vllm@{path}", kind, version, path, identity.get("digest"))
    return VllmTarget("vllm", kind, version, path)


def describe(identity: dict[str, Any]) -> str:
    """A target's identity in words: ``vllm==0.34.0``, ``vllm@PATH (sources sha256:ab12...)``,
    ``the vLLM 0.34.0 of the environment at PATH``."""
    if identity["kind"] == "release":
        return f"vllm=={identity['version']}"
    if identity["kind"] == "tree":
        digest = str(identity.get("digest") or "unknown")
        return f"vllm@{identity['path']} (sources {digest[:19]})"
    return f"the vLLM {identity.get('version')} of the environment at {identity.get('path')}"


def running_identity() -> dict[str, Any] | None:
    """The identity of the target this process runs (set by whoever started it), or None."""
    text = os.environ.get(TARGET_VARIABLE)
    if not text:
        return None
    found: dict[str, Any] = json.loads(text)
    return found


def tree_digest(root: Path) -> str:
    """``sha256:HEX`` of a tree's Python sources: every ``*.py`` under ``root/vllm`` (what runs
    here: the scheduler side loads no compiled code), by path relative to ``root`` and
    content, in path order. Any change to a source changes it."""
    digest = hashlib.sha256()
    package = root / "vllm"
    sources = sorted(
        p for p in package.rglob("*.py") if "__pycache__" not in p.parts and p.is_file()
    )
    for source in sources:
        name = source.relative_to(root).as_posix().encode()
        body = source.read_bytes()
        # lengths first, so that no two trees hash the same bytes in another split
        digest.update(b"%d:%s%d:" % (len(name), name, len(body)))
        digest.update(body)
    return f"sha256:{digest.hexdigest()}"


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
        root = root.absolute()
        return VllmTarget(spec, "tree", tree_version(root), root, tree_digest(root))
    if spec == "vllm":
        return VllmTarget(spec, "current", installed_version(), installed_location())
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
        # Only the checkout's own configuration is read, with its file-system monitor off:
        # the setting by which a reading command would start a program the tree names.
        describe = ["describe", "--tags", "--abbrev=0"]
        tag = subprocess.run(
            ["git", "-C", str(root), "-c", "core.fsmonitor=false", *describe],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
            env=os.environ | {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull},
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


def installed_location() -> Path | None:
    """The folder this environment imports vLLM from (its ``site-packages``), or None."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).absolute().parent


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
