"""Install vLLM releases into a cache folder, and run Python with one of them.

Layout of the cache (``$KVOFFLOAD_VLLM_CACHE``, default ``~/.cache/kvoffload/vllm``):

- ``env/``: a virtual environment with the CPU torch, hypothesis and the small packages that
  vLLM's config and scheduler modules import; shared by every release;
- ``releases/X/``: ``vllm==X`` installed there with ``--no-deps``;
- ``model/``: a hand-written ``config.json`` of a small public architecture, since vLLM's
  ``ModelConfig`` wants a model and the hub is not reached (``HF_HUB_OFFLINE=1``);
- ``vllm-state/X/``: what release ``X`` caches for itself (``VLLM_CACHE_ROOT``).

Each part is complete once its ``.ready`` stamp exists; a present part is reused (the
environment's stamp lists the dependencies it has: a longer list is installed over it).
Invariant: a stamp is written only after the step it stands for has succeeded, so an
interrupted install is redone, never trusted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvoffload.model.errors import ConfigError

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
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def default_cache() -> Path:
    return Path(os.environ.get("KVOFFLOAD_VLLM_CACHE", Path.home() / ".cache/kvoffload/vllm"))


def parse_target(target: str) -> str:
    """``vllm==0.29.0`` -> ``0.29.0``; anything else is a :class:`ConfigError`."""
    name, sep, version = target.partition("==")
    if name != "vllm" or not sep or not _VERSION.match(version):
        raise ConfigError(f"target {target!r} is not of the form vllm==X.Y.Z")
    return version


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

    def environment(self, version: str, source: Path | None = None) -> dict[str, str]:
        """Variables for running the cache's interpreter with release ``version`` (or the
        vLLM tree at ``source``, which says it is ``version``) and this kvoffload
        importable."""
        package_root = Path(__file__).absolute().parents[2]  # the folder holding kvoffload/
        vllm_root = source if source is not None else self.release(version)
        return (
            os.environ
            | {
                "PYTHONPATH": os.pathsep.join([str(vllm_root), str(package_root)]),
                "KVOFFLOAD_VLLM_VERSION": version,
                # vLLM caches what it learns of the model's class (else a subprocess of
                # seconds in every process) in one file per class, keyed by the source's
                # hash: one folder per release, so that releases do not evict each other's.
                "VLLM_CACHE_ROOT": str(self.root / "vllm-state" / version),
            }
            | run_variables(self.model)
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


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


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
            print(f"creating the shared environment in {cache.env}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(cache.env)], check=True)
        _pip(cache.python, TORCH)
    if not stamp.exists() or stamp.read_text() != wanted:
        # New or changed dependencies (an older release needs one more): installing the
        # list again adds what is missing and keeps what is there.
        _pip(cache.python, *DEPENDENCIES)
        # pulled in by xgrammar, a gigabyte, never imported by the scheduler side
        subprocess.run(
            [str(cache.python), "-m", "pip", "uninstall", "-q", "-y", "triton"], check=False
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
        _pip(cache.python, "--no-deps", "--upgrade", "--target", str(target), f"vllm=={version}")
        (target / ".ready").touch()
    return cache


def install_command(target: str) -> int:
    """``kvoffload install vllm==X``: install (or find) the release, print where it is."""
    version = parse_target(target)
    print(install(version).release(version))
    return 0
