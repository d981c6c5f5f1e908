"""Install vLLM releases into a cache folder, and run Python with one of them.

Layout of the cache (``$KVOFFLOAD_VLLM_CACHE``, default ``~/.cache/kvoffload/vllm``):

- ``env/``: a virtual environment with the CPU torch, hypothesis and the small packages that
  vLLM's config and scheduler modules import; shared by every release;
- ``releases/X/``: ``vllm==X`` installed there with ``--no-deps``;
- ``model/``: a hand-written ``config.json`` of a small public architecture, since vLLM's
  ``ModelConfig`` wants a model and the hub is not reached (``HF_HUB_OFFLINE=1``);
- ``vllm-state/X/``: what release ``X`` caches for itself (``VLLM_CACHE_ROOT``);
- ``kvoffload/H/kvoffload``: a link to the kvoffload that runs the checks (``H`` a digest of
  where it is installed), so that the release's processes import kvoffload and nothing else of
  the environment it is installed in.

A release's process runs isolated (:mod:`kvoffload.testing.isolation`): its ``sys.path`` is
the cache interpreter's own, then exactly the release (or tree) and the kvoffload link; none of the
caller's ``PYTHON*`` variables, user site-packages or working folder reach it.

Each part is complete once its ``.ready`` stamp exists; a present part is reused (the
environment's stamp lists the dependencies it has: a longer list is installed over it).
Invariant: a stamp is written only after the step it stands for has succeeded, so an
interrupted install is redone, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.errors import SetupError
from kvoffload.testing import isolation
from kvoffload.vllm_target.forms import parse_target

TORCH = "torch==2.13.0"  # the CPU build on disk; the same for every release
DEPENDENCIES = [
    "hypothesis>=6.100",
    "packaging",
    "psutil",
    "pyzmq",
    "urllib3",
    "regex",
    "numpy",
    "msgspec",
    "pydantic",
    "transformers>=5.16.1,<5.23.0",
    "aiohttp",
    "requests",
    "pillow",
    "pybase64",
    "cachetools",
    "cbor2",
    "cloudpickle",
    "uvloop",
    "py-cpuinfo",
    "prometheus_client",
    "llguidance>=1.7.0,<1.8.0",
    "xgrammar==0.2.8",
    "einops",
    # imported by 0.29.0 and 0.30.0 only, harmless later
    "openai-harmony",
    "openai",
    "fastapi",
    "partial_json_parser",
    # imported by 0.19.0 to 0.22.1 (gguf) and 0.19.x (diskcache) only, harmless later
    "gguf",
    "diskcache",
    # coverage.py, for `kvoffload verify --target ... --coverage` (kvoffload.upstream.reach)
    "coverage",
]
# OPT-125m's shape: vLLM's scheduler only reads max_model_len from the model config.
MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
}


def default_cache() -> Path:
    return Path(os.environ.get("KVOFFLOAD_VLLM_CACHE", Path.home() / ".cache/kvoffload/vllm"))


@dataclass(frozen=True)
class Cache:
    root: Path

    @property
    def env(self) -> Path:
        return self.root / "env"

    @property
    def python(self) -> Path:
        return self.env / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"

    def release(self, version: str) -> Path:
        return self.root / "releases" / version

    def installed(self, version: str) -> bool:
        return self.ready() and (self.release(version) / ".ready").exists()

    def ready(self) -> bool:
        """The shared environment and the model config are there (what a tree needs)."""
        return all((p / ".ready").exists() for p in (self.env, self.model))

    def package_link(self) -> Path:
        """The folder holding only a link ``kvoffload`` to this kvoffload (made when absent,
        atomically, so that concurrent runs agree): on a release's path it brings this package
        and nothing else of the environment it is installed in."""
        # not resolved: an editable install's package is a tree of links, its root here
        # (the package this module is in: kvoffload/upstream/install.py)
        package = Path(__file__).absolute().parent.parent
        holder = self.root / "kvoffload" / hashlib.sha256(bytes(package)).hexdigest()[:16]
        link = holder / "kvoffload"
        if not link.is_symlink() or link.readlink() != package:
            holder.mkdir(parents=True, exist_ok=True)
            staged = holder / f".kvoffload-{os.getpid()}"
            staged.unlink(missing_ok=True)
            staged.symlink_to(package, target_is_directory=True)
            staged.replace(link)
        return holder

    def environment(
        self,
        version: str,
        source: Path | None = None,
        identity: dict[str, Any] | None = None,
    ) -> dict[str, str]:
        """The isolated environment of the cache's interpreter with release ``version`` (or
        the vLLM tree at ``source``, which says it is ``version``) and this kvoffload on its
        path, and nothing else (:func:`kvoffload.testing.isolation.environment`); ``identity``: the
        target it runs, as failures name it (default: the release, or the tree)."""
        from kvoffload.vllm_target.forms import TARGET_VARIABLE

        vllm_root = source if source is not None else self.release(version)
        if identity is None:
            identity = {"kind": "release", "version": version}
            if source is not None:
                identity = {"kind": "tree", "version": version, "path": str(source)}
        return isolation.environment(
            [vllm_root, self.package_link()],
            {
                "KVOFFLOAD_VLLM_VERSION": version,
                TARGET_VARIABLE: json.dumps(identity, sort_keys=True),
                # vLLM caches what it learns of the model's class (else a subprocess of
                # seconds in every process) in one file per class, keyed by the source's
                # hash: one folder per release, so that releases do not evict each other's.
                "VLLM_CACHE_ROOT": str(self.root / "vllm-state" / version),
            }
            | run_variables(self.model),
        )


def run_variables(model: Path) -> dict[str, str]:
    """What vLLM's scheduler side needs to run here: the hand-written model config, no hub."""
    return {
        "HF_HUB_OFFLINE": "1",
        "KVOFFLOAD_VLLM_MODEL": str(model),
        # vLLM logs every config it builds, one per program drawn: at INFO, and up to 0.23.0
        # at WARNING too (the hybrid KV cache manager turned off for a connector).
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
    }


HEARTBEAT = 30.0  # seconds between two "still installing" lines


def _pip(python: Path, what: str, *args: str, log: bool = True) -> None:
    """``pip install -q args`` in the cache's interpreter, isolated, saying what it installs
    and, while it runs, that it still does (a line every :data:`HEARTBEAT` seconds: an
    environment takes minutes to build, and a silent one looks hung)."""
    command = isolation.python_command(python, "pip", "install", "-q", *args)
    with isolation.own_folder() as folder:
        process = subprocess.Popen(command, env=isolation.environment([]), cwd=folder)
        started = time.monotonic()
        if log:
            print(f"  installing {what}", file=sys.stderr, flush=True)
        while True:
            try:
                status = process.wait(timeout=HEARTBEAT)
                break
            except subprocess.TimeoutExpired:
                if log:
                    elapsed = time.monotonic() - started
                    print(
                        f"  still installing {what} ({elapsed:.0f} s)", file=sys.stderr, flush=True
                    )
    if status != 0:
        raise SetupError(f"installing {what} failed (pip exited {status}): see its output above")


def environment_stamp() -> str:
    """What the shared environment's stamp says once it is complete: its packages."""
    return "\n".join([TORCH, *DEPENDENCIES])


def install_environment(cache: Cache, log: bool = True) -> None:
    """The shared environment and the model config, unless already there (what a vLLM tree
    of ``--target vllm@PATH`` runs with)."""
    stamp = cache.env / ".ready"
    wanted = environment_stamp()
    if not stamp.exists():
        if log:
            print(
                f"creating the shared environment in {cache.env} (minutes: torch and "
                f"{len(DEPENDENCIES)} packages)",
                file=sys.stderr,
                flush=True,
            )
        with isolation.own_folder() as folder:
            made = isolation.run(
                isolation.python_command(sys.executable, "venv", str(cache.env.absolute())),
                isolation.environment(),
                folder,
            )
        if made.returncode != 0:
            raise SetupError(f"creating the environment {cache.env} failed")
        _pip(cache.python, TORCH, TORCH, log=log)
    if not stamp.exists() or stamp.read_text() != wanted:
        # New or changed dependencies (an older release needs one more): installing the
        # list again adds what is missing and keeps what is there.
        _pip(cache.python, f"{len(DEPENDENCIES)} packages vLLM imports", *DEPENDENCIES, log=log)
        # pulled in by xgrammar, a gigabyte, never imported by the scheduler side
        with isolation.own_folder() as folder:
            isolation.run(
                isolation.python_command(cache.python, "pip", "uninstall", "-q", "-y", "triton"),
                isolation.environment([]),
                folder,
            )
        stamp.write_text(wanted)
    write_model(cache)


def write_model(cache: Cache) -> None:
    """The hand-written model config vLLM's ``ModelConfig`` reads (no hub is reached)."""
    if not (cache.model / ".ready").exists():
        cache.model.mkdir(parents=True, exist_ok=True)
        (cache.model / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1))
        (cache.model / ".ready").touch()


def install(version: str, cache: Cache | None = None, log: bool = True) -> Cache:
    """Install release ``version`` (and the shared environment) unless already there."""
    cache = cache or Cache(default_cache())

    def say(message: str) -> None:
        if log:
            print(message, file=sys.stderr)

    install_environment(cache, log)
    target = cache.release(version)
    if not (target / ".ready").exists():
        say(f"installing vllm=={version} into {target}")
        target.mkdir(parents=True, exist_ok=True)
        _pip(
            cache.python,
            f"vllm=={version}",
            "--no-deps",
            "--upgrade",
            "--target",
            str(target.absolute()),
            f"vllm=={version}",
            log=log,
        )
        (target / ".ready").touch()
    return cache


def install_command(target: str) -> int:
    """``kvoffload install vllm==X``: install (or find) the release, print where it is."""
    version = parse_target(target)
    print(install(version).release(version))
    return 0
