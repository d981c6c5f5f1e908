"""Saved conformance failures: their schema, where they are kept, and the programs made from
them (the reproducer a campaign prints, the pytest file ``kvoffload replay`` writes).

A failure file is data from outside (a colleague's, a CI artifact, an old run), so it is
validated in full before anything is built from it, and everything generated from it holds
its values only as Python literals (``repr`` of validated ints, strings and lists), never as
source text: no field of a failure file can run code, whatever it holds.

Invariants kept:

- SCHEMA: :func:`validate` accepts exactly the documented fields with their types (call names
  from :data:`CALLS` with their arity and argument types, a configuration ``OffloadConfig``
  accepts, a known adapter and model variant, a non-empty program) and raises
  :class:`FailureFileError` naming the first problem otherwise.
- LITERALS: the text of :meth:`Failure.reproducer` and :meth:`Failure.regression_test` is
  built from ``repr`` of validated values and fixed source only.
- ONE FILE PER CHECK: :func:`save` keeps one file per target, release and model variant, so
  that the checks of one release (or two targets) never overwrite each other's failures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, KVOffloadError
from kvoffload.model.variants import VARIANTS, is_variant

FAILURES = Path(".hypothesis/kvoffload-failures")
FORMAT = 1

# Driver calls (``kvoffload.testing.lockstep``) and the types of their arguments: "int",
# "str", "ints" (a list of ints), or "flag" (a bool, or an int: what a misuse sends in its
# place); a kind ending in "?" is an optional trailing argument. Bad *values* are allowed:
# the machine's misuse rules send them on purpose, and both sides must reject them alike.
CALLS: dict[str, tuple[str, ...]] = {
    "add": ("str", "ints", "int", "flag?"),
    "step": ("int",),
    "finish": ("str",),
    "store": ("int", "int"),
    "load": ("int", "int"),
    "reset": (),
    "reset_prefix_cache": ("flag",),
    "lookup": ("ints",),
    "stats": (),
    "drain": (),
    "fail_store": ("int", "int"),
    "corrupt": ("int", "int"),
}
CONFIG_FIELDS = (
    "gpu_blocks",
    "cpu_blocks",
    "group_block_sizes",
    "hash_block_size",
    "world_size",
    "lazy",
    "sliding_windows",
    "kv_events",
    "attention_chunks",
    "dcp_world_size",
    "mamba",
)
# Fields a failure file may leave out (written before they existed), with their value then.
CONFIG_DEFAULTS: dict[str, Any] = {
    "lazy": False,
    "sliding_windows": [],
    "kv_events": False,
    "attention_chunks": [],
    "dcp_world_size": 1,
    "mamba": [],
}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# A release as a version string (PEP 440 characters): it is printed in a comment line.
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}")


class FailureFileError(KVOffloadError, ValueError):
    """A failure file that cannot be read, or does not have the failure schema."""


@dataclass(frozen=True)
class Failure:
    """One shrunk disagreement: what was driven, how it was configured, what differed."""

    adapter: str
    variant: str
    config: OffloadConfig
    program: tuple[tuple[Any, ...], ...]
    rule_steps: int
    disagreement: str
    release: str | None = None
    seed: int | None = None

    # -- the wire form ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "adapter": self.adapter,
            "variant": self.variant,
            "release": self.release,
            "seed": self.seed,
            "config": {name: _plain(getattr(self.config, name)) for name in CONFIG_FIELDS},
            "program": [list(call) for call in self.program],
            "rule_steps": self.rule_steps,
            "disagreement": self.disagreement,
        }

    @property
    def faults(self) -> list[str]:
        return [self.adapter.removeprefix("fault:")] if self.adapter.startswith("fault:") else []

    @property
    def file_name(self) -> str:
        """``ADAPTER[-RELEASE]-VARIANT.json``, in characters safe in any file system."""
        parts = [self.adapter, self.release, self.variant]
        return _SAFE_NAME.sub("-", "-".join(p for p in parts if p)) + ".json"

    # -- programs made from it --------------------------------------------------------

    def _config_source(self) -> str:
        fields = ", ".join(
            f"{name}={_literal(getattr(self.config, name))}" for name in CONFIG_FIELDS
        )
        return f"OffloadConfig({fields})"

    def _program_source(self) -> str:
        return "[\n" + "".join(f"    {_literal(call)},\n" for call in self.program) + "]"

    def _target_source(self) -> str:
        if self.adapter == "vllm":
            return f"adapter='vllm', variant={self.variant!r}"
        device = "cuda" if self.adapter == "impl-cuda" else "cpu"
        return f"faults={self.faults!r}, device={device!r}"

    def where(self) -> str:
        """Where the program must run: vLLM's failures in their release's environment."""
        if self.adapter != "vllm":
            return ""
        release = f"vllm=={self.release}" if self.release else "the vLLM release it came from"
        return (
            f"# In the environment of {release} (`kvoffload replay --run FILE` runs it there\n"
            "# for you, FILE being this failure's JSON file).\n"
        )

    def reproducer(self) -> str:
        """A standalone program that prints the first disagreement (None once fixed)."""
        return (
            self.where() + "from kvoffload.model import OffloadConfig\n"
            "from kvoffload.testing.lockstep import first_disagreement\n\n"
            f"config = {self._config_source()}\n"
            f"program = {self._program_source()}\n"
            f"print(first_disagreement(config, program, {self._target_source()}))\n"
        )

    def regression_test(self) -> str:
        """A pytest file that fails while the disagreement is there."""
        name = "test_regression_" + re.sub(r"\W+", "_", self.adapter).strip("_")
        summary = f"Regression from a saved conformance failure of {self.adapter}:\n"
        imports = (
            "from kvoffload.model import OffloadConfig\n"
            "from kvoffload.testing.lockstep import first_disagreement\n"
        )
        skip = ""
        # impl-cuda needs a GPU, vllm its release's environment: elsewhere the test skips.
        if self.adapter in ("impl-cuda", "vllm"):
            imports = (
                "import pytest\n\n"
                "from kvoffload.model import OffloadConfig\n"
                "from kvoffload.testing.adapters import adapters\n"
                "from kvoffload.testing.lockstep import first_disagreement\n"
            )
            skip = (
                "    if ADAPTER not in adapters():\n"
                "        pytest.skip(f'the target {ADAPTER} is not available here')\n"
            )
        return (
            f"{_literal(summary + self.disagreement)}\n\n" + imports + "\n"
            f"ADAPTER = {self.adapter!r}\n"
            f"CONFIG = {self._config_source()}\n"
            f"PROGRAM = {self._program_source()}\n\n\n"
            f"def {name}() -> None:\n"
            + skip
            + f"    found = first_disagreement(CONFIG, PROGRAM, {self._target_source()})\n"
            "    assert found is None, found\n"
        )


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def _literal(value: object) -> str:
    """``repr`` of a validated value: None, bools, ints, strings, lists and tuples of them
    only."""
    if value is None:
        return "None"
    if not isinstance(value, (bool, int, str, list, tuple)):
        raise FailureFileError(f"not a literal value: {type(value).__name__}")
    if isinstance(value, (list, tuple)):
        items = ", ".join(_literal(v) for v in value)
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items},)" if len(value) == 1 else f"({items})"
    return repr(value)


# -- validation ------------------------------------------------------------------------


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise FailureFileError(problem)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_argument(kind: str, value: object, where: str) -> object:
    kind = kind.removesuffix("?")
    if kind == "flag":
        _expect(isinstance(value, int), f"{where} must be a bool or an int, got {value!r}")
        return value
    if kind == "int":
        _expect(_is_int(value), f"{where} must be an int, got {value!r}")
        return value
    if kind == "str":
        _expect(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    if not (isinstance(value, list) and all(_is_int(v) for v in value)):
        raise FailureFileError(f"{where} must be a list of ints, got {value!r}")
    return list(value)


def _check_call(n: int, call: object) -> tuple[Any, ...]:
    _expect(
        isinstance(call, list) and bool(call) and isinstance(call[0], str),
        f"program[{n}] must be a list starting with a call name, got {call!r}",
    )
    assert isinstance(call, list)
    name, *args = call
    _expect(name in CALLS, f"program[{n}]: unknown call {name!r}; known: {sorted(CALLS)}")
    kinds = CALLS[name]
    required = sum(1 for kind in kinds if not kind.endswith("?"))
    takes = str(required) if required == len(kinds) else f"{required} to {len(kinds)}"
    _expect(
        required <= len(args) <= len(kinds),
        f"program[{n}]: {name!r} takes {takes} arguments, got {len(args)}",
    )
    return (
        name,
        *(
            _check_argument(kind, arg, f"program[{n}] argument {i + 1}")
            for i, (kind, arg) in enumerate(zip(kinds, args, strict=False))
        ),
    )


def _check_adapter(adapter: object) -> str:
    from kvoffload.impl.faults import FAULTS

    _expect(isinstance(adapter, str), f"adapter must be a string, got {adapter!r}")
    assert isinstance(adapter, str)
    known = adapter in ("impl", "impl-cuda", "vllm") or (
        adapter.startswith("fault:") and adapter.removeprefix("fault:") in FAULTS
    )
    _expect(
        known,
        f"unknown adapter {adapter!r}; known: impl, impl-cuda, vllm, fault:NAME with NAME in "
        f"{sorted(FAULTS)}",
    )
    return adapter


def _check_fields(data: dict[str, Any], allowed: set[str], required: list[str], what: str) -> None:
    extra = sorted(set(data) - allowed)
    _expect(not extra, f"{what}unknown fields {extra}")
    missing = [name for name in required if name not in data]
    _expect(not missing, f"{what}missing fields {missing}")


def _check_config(config: object) -> OffloadConfig:
    _expect(isinstance(config, dict), f"config must be an object, got {config!r}")
    assert isinstance(config, dict)
    required = [name for name in CONFIG_FIELDS if name not in CONFIG_DEFAULTS]
    _check_fields(config, {*CONFIG_FIELDS, "scheduler_block_size"}, required, "config: ")
    config = {**CONFIG_DEFAULTS, **config}
    sizes = config["group_block_sizes"]
    _expect(
        isinstance(sizes, list) and all(_is_int(s) for s in sizes),
        f"config group_block_sizes must be a list of ints, got {sizes!r}",
    )
    for name in CONFIG_FIELDS:
        if name in ("lazy", "kv_events"):
            _expect(
                isinstance(config[name], bool),
                f"config {name} must be a bool, got {config[name]!r}",
            )
        elif name in ("sliding_windows", "attention_chunks"):
            per_group = config[name]
            _expect(
                isinstance(per_group, list) and all(w is None or _is_int(w) for w in per_group),
                f"config {name} must be a list of ints or nulls, got {per_group!r}",
            )
        elif name == "mamba":
            flags = config[name]
            _expect(
                isinstance(flags, list) and all(isinstance(f, bool) for f in flags),
                f"config mamba must be a list of bools, got {flags!r}",
            )
        elif name != "group_block_sizes":
            _expect(_is_int(config[name]), f"config {name} must be an int, got {config[name]!r}")
    try:
        built = OffloadConfig(
            config["gpu_blocks"],
            config["cpu_blocks"],
            tuple(sizes),
            config["hash_block_size"],
            config["world_size"],
            config["lazy"],
            tuple(config["sliding_windows"]),
            config["kv_events"],
            tuple(config["attention_chunks"]),
            config["dcp_world_size"],
            tuple(config["mamba"]),
        )
    except ConfigError as error:
        raise FailureFileError(f"config is not valid: {error}") from None
    derived = config.get("scheduler_block_size", built.scheduler_block_size)
    _expect(
        derived == built.scheduler_block_size,
        f"config scheduler_block_size {derived!r} is not the LCM of the group block sizes "
        f"({built.scheduler_block_size})",
    )
    return built


def validate(data: object) -> Failure:
    """The failure ``data`` holds, or :class:`FailureFileError` naming what is wrong."""
    _expect(isinstance(data, dict), f"a failure must be a JSON object, got {type(data).__name__}")
    assert isinstance(data, dict)
    known = {"format", "adapter", "variant", "release", "seed", "config", "program"}
    known |= {"rule_steps", "disagreement"}
    _check_fields(data, known, ["adapter", "config", "program", "disagreement"], "")
    _expect(data.get("format", FORMAT) == FORMAT, f"format {data.get('format')!r} is not 1")
    adapter = _check_adapter(data["adapter"])
    variant = data.get("variant", "fixed")
    _expect(
        isinstance(variant, str) and is_variant(variant),
        f"unknown variant {variant!r}; known: {sorted(VARIANTS)}",
    )
    program = data["program"]
    _expect(isinstance(program, list), f"program must be a list, got {program!r}")
    _expect(bool(program), "program is empty: there is nothing to replay")
    calls = tuple(_check_call(n, call) for n, call in enumerate(program))
    rule_steps = data.get("rule_steps", len(calls))
    _expect(
        _is_int(rule_steps) and rule_steps >= 0,
        f"rule_steps must be an int >= 0, got {rule_steps!r}",
    )
    disagreement = data["disagreement"]
    _expect(isinstance(disagreement, str), f"disagreement must be a string, got {disagreement!r}")
    release = data.get("release")
    _expect(
        release is None or (isinstance(release, str) and _RELEASE.fullmatch(release) is not None),
        f"release must be a version such as 0.34.0 or null, got {release!r}",
    )
    seed = data.get("seed")
    _expect(seed is None or _is_int(seed), f"seed must be an int or null, got {seed!r}")
    return Failure(
        adapter,
        variant,
        _check_config(data["config"]),
        calls,
        rule_steps,
        disagreement,
        release,
        seed,
    )


def load(path: str | Path) -> Failure:
    """Read and validate a failure file; every way it can be unreadable is a
    :class:`FailureFileError` naming the file and the problem."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise FailureFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FailureFileError(f"{path}: not UTF-8 text ({error.reason})") from None
    if not text.strip():
        raise FailureFileError(f"{path}: the file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise FailureFileError(
            f"{path}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from None
    except (RecursionError, ValueError) as error:
        # nested too deeply, or an integer too long for Python to convert
        raise FailureFileError(f"{path}: not JSON a failure can hold ({error})") from None
    try:
        return validate(data)
    except FailureFileError as error:
        raise FailureFileError(f"{path}: {error}") from None


def save(failure: Failure, folder: Path = FAILURES) -> Path:
    """Write ``failure`` to its file (:attr:`Failure.file_name`) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / failure.file_name
    path.write_text(json.dumps(failure.to_dict(), indent=1) + "\n")
    return path
