"""Saved conformance failures: their schema, where they are kept, and the programs made from
them (the reproducer a campaign prints, the pytest file ``kvoffload replay`` writes).

A failure file is data from outside (a colleague's, a CI artifact, an old run), so it is
validated in full before anything is built from it, and everything generated from it holds
its values only as Python literals (``repr`` of validated ints, strings and lists), never as
source text: no field of a failure file can run code, whatever it holds.

Invariants kept:

- SCHEMA: :func:`validate` accepts exactly the documented fields with their types (the machine
  it came from, one of :data:`MACHINES`, and that machine's call names with their arity and
  argument types, a configuration ``OffloadConfig`` accepts, a target of the registry
  (:mod:`kvoffload.testing.targets`) the machine drives and a model variant, a non-empty
  program) and raises :class:`FailureFileError` naming the first problem otherwise.
- ONE FORMAT: the failures of every machine (the offload machine,
  :mod:`kvoffload.testing.stateful`; the scheduler machine,
  :mod:`kvoffload.testing.scheduler_machine`) are this one format, saved, reduced and
  replayed alike; a file of format 1 (before the machine was recorded) is the offload
  machine's.
- LITERALS: the text of :meth:`Failure.reproducer` and :meth:`Failure.regression_test` is
  built from ``repr`` of validated values and fixed source only.
- ONE FILE PER CHECK: :func:`save` keeps one file per target (a release, a tree by the digest
  of its sources, an environment by vLLM's version and folder), model variant and kind of
  verdict, so that the checks of one release, two trees or two targets never overwrite each
  other's failures.
- BOUNDED: a file is read with a cap (:data:`~kvoffload.model.limits.MAX_FAILURE_BYTES`) and
  its program has at most :data:`~kvoffload.model.limits.MAX_PROGRAM_CALLS` calls; every
  value an error names is cut (:func:`~kvoffload.model.limits.brief`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, KVOffloadError
from kvoffload.model.limits import MAX_FAILURE_BYTES, MAX_PROGRAM_CALLS, brief
from kvoffload.model.variants import VARIANTS, is_variant
from kvoffload.testing.isolation import failures_folder
from kvoffload.testing.targets import UnknownTargetError, spec, with_scheduler
from kvoffload.vllm_target.worker import WorkerLayout

FORMAT = 2
FORMATS = (1, 2)  # read: 1 has no "machine" (the offload machine's)
# What a failure shows: the target differs from the model with every invariant holding on
# its own state (a change to review), the target's own state breaks an invariant of the spec
# (a bug, issue 34), or the model itself broke one of its invariants on the program (a bug
# of the specification: exit status 3).
DIFFERS, BREAKS, MODEL_BROKE = "differs", "breaks-invariant", "model-broke-invariant"
VERDICTS = (DIFFERS, BREAKS, MODEL_BROKE)
# How a difference names a broken invariant of the model (kvoffload.testing.lockstep).
MODEL_BROKE_WORDS = "the model broke "
# How a difference names an invariant the target's own state breaks.
TARGET_BROKE_WORDS = "the target breaks "

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
    "reset_prefix_cache": ("flag", "flag?"),
    "lookup": ("ints",),
    "stats": (),
    "drain": (),
    "fail_store": ("int", "int"),
    "corrupt": ("int", "int"),
}
# The scheduler machine's calls (kvoffload.vllm_target.scheduler): a step says whether its
# output reports every completion sent so far, or which (its picks); an abort finishes a
# request from outside.
SCHEDULER_CALLS: dict[str, tuple[str, ...]] = {
    "add": ("str", "ints", "int", "flag?"),
    "step": ("int", "flag", "ints?"),
    "abort": ("str",),
    "reset_prefix_cache": ("flag", "flag?"),
}
OFFLOAD, SCHEDULER, WORKER = "offload", "scheduler", "worker"
# The worker machine is the scheduler machine with vLLM's own workers on every rank (issue 33):
# the same calls, and the layout of the workers' KV caches.
MACHINES: dict[str, dict[str, tuple[str, ...]]] = {
    OFFLOAD: CALLS,
    SCHEDULER: SCHEDULER_CALLS,
    WORKER: SCHEDULER_CALLS,
}
SCHEDULED = (SCHEDULER, WORKER)  # the machines over vLLM's own scheduler
# The scheduler machine's target when it runs the model alone, every invariant checked.
MODEL_ALONE = "model"
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
# A target's identity (kvoffload.vllm_target.forms.VllmTarget.identity): a release, a tree by
# its absolute folder and the digest of its sources, or the vLLM of an environment.
_TARGET_KINDS = {"release": (), "tree": ("path", "digest"), "current": ("path",)}
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_PATH = 4096
_INVARIANT = re.compile(r"[A-Z][A-Z0-9+-]{0,39}")


def _named(found: str, words: str) -> str | None:
    if not found.startswith(words):
        return None
    name = found.removeprefix(words).split(" ", 1)[0]
    return name if _INVARIANT.fullmatch(name) else None


def model_broke(found: str) -> str | None:
    """The invariant a difference says the model broke (``the model broke NAME at call N
    ...``: at the start, where no call's arguments can put it), or None for a difference
    between the model and the target (``call N ...``)."""
    return _named(found, MODEL_BROKE_WORDS)


def target_broke(found: str) -> str | None:
    """The invariant a difference says the target's own state breaks (``the target breaks
    NAME at call N ...``), or None."""
    return _named(found, TARGET_BROKE_WORDS)


def verdict_of(found: str) -> str:
    """The class of a difference: :data:`MODEL_BROKE`, :data:`BREAKS` or :data:`DIFFERS`."""
    if model_broke(found) is not None:
        return MODEL_BROKE
    return BREAKS if target_broke(found) is not None else DIFFERS


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
    # vLLM's failures: the target exactly (kvoffload.vllm_target.forms.VllmTarget.identity)
    target: dict[str, str] | None = None
    machine: str = OFFLOAD  # the machine that found it (MACHINES)
    # the scheduler machine's: vLLM's whole-sequence admission on or off, for both sides
    whole_sequence_admission: bool | None = None
    # the worker machine's: how the workers' KV caches are laid out
    workers: WorkerLayout | None = None

    @property
    def broken_invariant(self) -> str | None:
        """The invariant the model itself broke on the program, or None (a difference)."""
        return model_broke(self.disagreement)

    @property
    def verdict(self) -> str:
        """The class of the failure (:data:`VERDICTS`): the target differs with every
        invariant holding, the target breaks one, or the model broke one."""
        return verdict_of(self.disagreement)

    @property
    def target_identity(self) -> dict[str, str] | None:
        """The vLLM target it failed on: as recorded, or for a file written before targets
        were recorded, the release it names."""
        if self.target is not None:
            return self.target
        if self.elsewhere and self.release:
            return {"kind": "release", "version": self.release}
        return None

    @property
    def elsewhere(self) -> bool:
        """Whether it replays in the environment it names (a vLLM release or tree), not in
        the one that reads it."""
        return self.adapter != MODEL_ALONE and spec(self.adapter).elsewhere

    # -- the wire form ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "format": FORMAT,
                "machine": self.machine,
                "adapter": self.adapter,
                "variant": self.variant,
                "release": self.release,
                "target": self.target,
                "verdict": self.verdict,
                "seed": self.seed,
                "config": {name: _plain(getattr(self.config, name)) for name in CONFIG_FIELDS},
                "program": [list(call) for call in self.program],
                "rule_steps": self.rule_steps,
                "disagreement": self.disagreement,
            }
            | (
                {"whole_sequence_admission": self.whole_sequence_admission}
                if self.machine in SCHEDULED
                else {}
            )
            | ({"workers": self.workers._asdict()} if self.workers is not None else {})
        )

    @property
    def file_name(self) -> str:
        """``ADAPTER[-TARGET]-VARIANT[-model-broke].json``, in characters safe in any file
        system; ``TARGET`` is a release's version, ``tree-DIGEST`` for a tree (the first
        hex digits of its sources' digest), ``env-VERSION-H`` for an environment (``H`` from
        its folder): one file per target, never another target's."""
        where: str | None = self.release
        identity = self.target_identity
        if identity is not None and identity["kind"] == "tree":
            where = "tree-" + identity.get("digest", "sha256:unknown").removeprefix("sha256:")[:12]
        elif identity is not None and identity["kind"] == "current":
            place = hashlib.sha256(identity.get("path", "").encode()).hexdigest()[:8]
            where = f"env-{identity.get('version') or 'unknown'}-{place}"
        kind = "model-broke" if self.verdict == MODEL_BROKE else None
        machine = None if self.machine == OFFLOAD else self.machine
        parts = [machine, self.adapter, where, self.variant, kind]
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
        """The arguments of the replay call: the machine's, then the target's."""
        if self.machine in SCHEDULED:
            workers = "" if self.workers is None else f", workers={self.workers!r}"
            return (
                f"{self.variant!r}, whole_sequence_admission={self.whole_sequence_admission!r}, "
                f"vllm={self.adapter != MODEL_ALONE!r}{workers}"
            )
        row = spec(self.adapter)
        if row.device is None:
            return f"adapter={self.adapter!r}, variant={self.variant!r}"
        return f"faults={list(row.faults)!r}, device={row.device!r}"

    def _replay_source(self) -> tuple[str, str]:
        """The module and function that replay the program on its machine."""
        if self.machine in SCHEDULED:
            return "kvoffload.testing.scheduler_lockstep", "first_difference"
        return "kvoffload.testing.lockstep", "first_disagreement"

    def _layout_import(self) -> str:
        return (
            "from kvoffload.vllm_target.worker import WorkerLayout\n"
            if self.workers is not None
            else ""
        )

    def where(self) -> str:
        """Where the program must run: vLLM's failures with their target's code."""
        if not self.elsewhere:
            return ""
        identity = self.target_identity
        if identity is None:
            on = "the vLLM release it came from"
        elif identity["kind"] == "release":
            on = f"vllm=={identity['version']}"
        elif identity["kind"] == "tree":
            on = "the vLLM tree at " + identity["path"]
        else:
            on = "the vLLM of the environment at " + identity["path"]
        # (a tree's folder is a validated path without line breaks: it stays in the comment)
        return (
            f"# In the environment of {on} (`kvoffload replay --run FILE` runs it there\n"
            "# for you, FILE being this failure's JSON file).\n"
        )

    def reproducer(self) -> str:
        """A standalone program that prints the first disagreement (None once fixed)."""
        module, function = self._replay_source()
        return (
            self.where() + "from kvoffload.model import OffloadConfig\n"
            f"from {module} import {function}\n" + self._layout_import() + "\n"
            f"config = {self._config_source()}\n"
            f"program = {self._program_source()}\n"
            f"print({function}(config, program, {self._target_source()}))\n"
        )

    def regression_test(self) -> str:
        """A pytest file that fails while the disagreement is there."""
        machine = "" if self.machine == OFFLOAD else f"{self.machine}_"
        name = "test_regression_" + machine + re.sub(r"\W+", "_", self.adapter).strip("_")
        summary = f"Regression from a saved conformance failure of {self.adapter}:\n"
        if self.elsewhere:
            return self._vllm_regression_test(name, summary)
        module, function = self._replay_source()
        imports = f"from kvoffload.model import OffloadConfig\nfrom {module} import {function}\n"
        skip = ""
        # a target the machine running the test lacks (impl-cuda without a GPU): it skips
        if self.adapter != MODEL_ALONE:
            imports = (
                "import pytest\n\n"
                "from kvoffload.model import OffloadConfig\n"
                f"from {module} import {function}\n"
                "from kvoffload.testing.targets import spec\n"
            )
            skip = (
                "    if not spec(ADAPTER).available():\n"
                "        pytest.skip(f'the target {ADAPTER} is not available here')\n"
            )
        return (
            f"{_literal(summary + self.disagreement)}\n\n" + imports + self._layout_import() + "\n"
            f"ADAPTER = {self.adapter!r}\n"
            f"CONFIG = {self._config_source()}\n"
            f"PROGRAM = {self._program_source()}\n\n\n"
            f"def {name}() -> None:\n"
            + skip
            + f"    found = {function}(CONFIG, PROGRAM, {self._target_source()})\n"
            "    assert found is None, found\n"
        )

    def _vllm_regression_test(self, name: str, summary: str) -> str:
        """vLLM's failure as a pytest file for any environment kvoffload is installed in:
        the failure's program replayed on its own target (the release or tree in the
        cache's environment, :mod:`kvoffload.replaying`), or a skip saying in one
        line what is missing. The failure is held as the text of its JSON (a literal)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return (
            f"{_literal(summary + self.disagreement)}\n\n"
            "import json\n\n"
            "from kvoffload.testing.failure import validate\n"
            "from kvoffload.replaying import replay_or_skip\n\n"
            f"FAILURE = validate(json.loads({_literal(text)}))\n\n\n"
            f"def {name}() -> None:\n"
            "    found = replay_or_skip(FAILURE)\n"
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
        _expect(isinstance(value, int), f"{where} must be a bool or an int, got {brief(value)}")
        return value
    if kind == "int":
        _expect(_is_int(value), f"{where} must be an int, got {brief(value)}")
        return value
    if kind == "str":
        _expect(isinstance(value, str), f"{where} must be a string, got {brief(value)}")
        return value
    if not (isinstance(value, list) and all(_is_int(v) for v in value)):
        raise FailureFileError(f"{where} must be a list of ints, got {brief(value)}")
    return list(value)


def _check_call(n: int, call: object, calls: dict[str, tuple[str, ...]]) -> tuple[Any, ...]:
    _expect(
        isinstance(call, list) and bool(call) and isinstance(call[0], str),
        f"program[{n}] must be a list starting with a call name, got {brief(call)}",
    )
    assert isinstance(call, list)
    name, *args = call
    _expect(name in calls, f"program[{n}]: unknown call {brief(name)}; known: {sorted(calls)}")
    kinds = calls[name]
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


def _check_adapter(adapter: object, machine: str) -> str:
    """A target of the registry that ``machine`` drives (the scheduler machine: one with
    vLLM's scheduler, or the model alone)."""
    _expect(isinstance(adapter, str), f"adapter must be a string, got {brief(adapter)}")
    assert isinstance(adapter, str)
    if machine in SCHEDULED:
        drivable = [MODEL_ALONE, *with_scheduler()]
        _expect(
            adapter in drivable,
            f"the {machine} machine drives {', '.join(drivable)}, not {brief(adapter)}",
        )
        return adapter
    try:
        spec(adapter)
    except UnknownTargetError as error:
        raise FailureFileError(f"unknown adapter {brief(adapter)}; known: {error.known}") from None
    return adapter


def _check_fields(data: dict[str, Any], allowed: set[str], required: list[str], what: str) -> None:
    extra = sorted(set(data) - allowed)
    _expect(not extra, f"{what}unknown fields {brief(extra)}")
    missing = [name for name in required if name not in data]
    _expect(not missing, f"{what}missing fields {missing}")


def _check_workers(workers: object, machine: str) -> WorkerLayout | None:
    """The worker machine's layout of the workers' KV caches (absent for other machines)."""
    if machine != WORKER:
        _expect(workers is None, f"workers is for the worker machine only, got {brief(workers)}")
        return None
    _expect(isinstance(workers, dict), f"workers must be an object, got {brief(workers)}")
    assert isinstance(workers, dict)
    # (every field named; the backend may be left out: pinned host memory)
    required = [name for name in WorkerLayout._fields if name != "backend"]
    _check_fields(workers, set(WorkerLayout._fields), required, "workers: ")
    layout = WorkerLayout(**workers)
    problem = layout.problem()
    _expect(problem is None, f"workers: {problem}")
    return layout


def _check_config(config: object) -> OffloadConfig:
    _expect(isinstance(config, dict), f"config must be an object, got {brief(config)}")
    assert isinstance(config, dict)
    required = [name for name in CONFIG_FIELDS if name not in CONFIG_DEFAULTS]
    _check_fields(config, {*CONFIG_FIELDS, "scheduler_block_size"}, required, "config: ")
    config = {**CONFIG_DEFAULTS, **config}
    sizes = config["group_block_sizes"]
    _expect(
        isinstance(sizes, list) and all(_is_int(s) for s in sizes),
        f"config group_block_sizes must be a list of ints, got {brief(sizes)}",
    )
    for name in CONFIG_FIELDS:
        if name in ("lazy", "kv_events"):
            _expect(
                isinstance(config[name], bool),
                f"config {name} must be a bool, got {brief(config[name])}",
            )
        elif name in ("sliding_windows", "attention_chunks"):
            per_group = config[name]
            _expect(
                isinstance(per_group, list) and all(w is None or _is_int(w) for w in per_group),
                f"config {name} must be a list of ints or nulls, got {brief(per_group)}",
            )
        elif name == "mamba":
            flags = config[name]
            _expect(
                isinstance(flags, list) and all(isinstance(f, bool) for f in flags),
                f"config mamba must be a list of bools, got {brief(flags)}",
            )
        elif name != "group_block_sizes":
            _expect(
                _is_int(config[name]), f"config {name} must be an int, got {brief(config[name])}"
            )
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
        f"config scheduler_block_size {brief(derived)} is not the LCM of the group block sizes "
        f"({built.scheduler_block_size})",
    )
    return built


def _check_target(target: object, adapter: str, release: str | None) -> dict[str, str] | None:
    """A vLLM failure's target identity: a release (its version), a tree (its absolute
    folder, the digest of its sources), or an environment (vLLM's version and folder)."""
    if target is None:
        return None
    _expect(
        adapter != MODEL_ALONE and spec(adapter).elsewhere,
        f"target names a vLLM target, but the adapter is {adapter!r}",
    )
    _expect(isinstance(target, dict), f"target must be an object, got {brief(target)}")
    assert isinstance(target, dict)
    kind = target.get("kind")
    _expect(kind in _TARGET_KINDS, f"target kind must be one of {sorted(_TARGET_KINDS)}")
    assert isinstance(kind, str)
    _check_fields(target, {"kind", "version", *_TARGET_KINDS[kind]}, ["kind"], "target: ")
    version = target.get("version")
    _expect(
        version is None or (isinstance(version, str) and _RELEASE.fullmatch(version) is not None),
        f"target version must be a version such as 0.34.0 or null, got {brief(version)}",
    )
    _expect(kind != "release" or version is not None, "a release target needs its version")
    _expect(
        kind != "release" or release in (None, version),
        f"target version {version!r} is not the failure's release {release!r}",
    )
    path = target.get("path")
    if "path" in _TARGET_KINDS[kind]:
        _expect(
            isinstance(path, str)
            and 0 < len(path) <= _MAX_PATH
            and path.startswith("/")
            and path.isprintable(),
            f"target path must be an absolute folder name, got {brief(path)}",
        )
    digest = target.get("digest")
    if kind == "tree":
        _expect(
            isinstance(digest, str) and _DIGEST.fullmatch(digest) is not None,
            f"target digest must be sha256: and 64 hex digits, got {brief(digest)}",
        )
    return {k: v for k, v in target.items() if v is not None}


def validate(data: object) -> Failure:
    """The failure ``data`` holds, or :class:`FailureFileError` naming what is wrong."""
    _expect(isinstance(data, dict), f"a failure must be a JSON object, got {type(data).__name__}")
    assert isinstance(data, dict)
    known = {"format", "adapter", "variant", "release", "target", "verdict", "seed", "config"}
    known |= {"program", "rule_steps", "disagreement", "machine", "whole_sequence_admission"}
    known |= {"workers"}
    _check_fields(data, known, ["adapter", "config", "program", "disagreement"], "")
    form = data.get("format", FORMAT)
    _expect(
        _is_int(form) and form in FORMATS,
        f"format {brief(form)} is not one of {', '.join(map(str, FORMATS))}",
    )
    machine = data.get("machine", OFFLOAD)
    _expect(
        machine in MACHINES and (form > 1 or machine == OFFLOAD),
        f"machine must be one of {sorted(MACHINES)} (format 1: offload), got {brief(machine)}",
    )
    assert isinstance(machine, str)
    whole = data.get("whole_sequence_admission")
    _expect(
        isinstance(whole, bool) if machine in SCHEDULED else whole is None,
        "whole_sequence_admission must be a bool for the scheduler and worker machines, and "
        f"absent for the others; got {brief(whole)}",
    )
    workers = _check_workers(data.get("workers"), machine)
    adapter = _check_adapter(data["adapter"], machine)
    variant = data.get("variant", "fixed")
    _expect(
        isinstance(variant, str) and is_variant(variant),
        f"unknown variant {brief(variant)}; known: {sorted(VARIANTS)}",
    )
    program = data["program"]
    _expect(isinstance(program, list), f"program must be a list, got {brief(program)}")
    _expect(bool(program), "program is empty: there is nothing to replay")
    _expect(
        len(program) <= MAX_PROGRAM_CALLS,
        f"program has {len(program)} calls, more than the {MAX_PROGRAM_CALLS} a failure may hold",
    )
    calls = tuple(_check_call(n, call, MACHINES[machine]) for n, call in enumerate(program))
    rule_steps = data.get("rule_steps", len(calls))
    _expect(
        _is_int(rule_steps) and 0 <= rule_steps <= MAX_PROGRAM_CALLS,
        f"rule_steps must be an int from 0 to {MAX_PROGRAM_CALLS}, got {brief(rule_steps)}",
    )
    disagreement = data["disagreement"]
    _expect(
        isinstance(disagreement, str), f"disagreement must be a string, got {brief(disagreement)}"
    )
    release = data.get("release")
    _expect(
        release is None or (isinstance(release, str) and _RELEASE.fullmatch(release) is not None),
        f"release must be a version such as 0.34.0 or null, got {brief(release)}",
    )
    target = _check_target(data.get("target"), adapter, release)
    seed = data.get("seed")
    _expect(seed is None or _is_int(seed), f"seed must be an int or null, got {brief(seed)}")
    failure = Failure(
        adapter,
        variant,
        _check_config(data["config"]),
        calls,
        rule_steps,
        disagreement,
        release,
        seed,
        target,
        machine,
        whole,
        workers,
    )
    verdict = data.get("verdict", failure.verdict)
    _expect(
        verdict == failure.verdict,
        f"verdict {brief(verdict)} is not what the disagreement says ({failure.verdict})",
    )
    return failure


def load(path: str | Path) -> Failure:
    """Read and validate a failure file; every way it can be unreadable is a
    :class:`FailureFileError` naming the file and the problem."""
    try:
        # At most one byte past the cap: /dev/zero or a huge file is refused, never read.
        with Path(path).open("rb") as file:
            raw = file.read(MAX_FAILURE_BYTES + 1)
    except OSError as error:
        raise FailureFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(raw) > MAX_FAILURE_BYTES:
        raise FailureFileError(
            f"{path}: larger than the {MAX_FAILURE_BYTES} bytes a failure file may have"
        )
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


def save(failure: Failure, folder: Path | None = None) -> Path:
    """Write ``failure`` to its file (:attr:`Failure.file_name`) under ``folder`` (default:
    :func:`kvoffload.testing.isolation.failures_folder`, the caller's even in a subprocess)."""
    folder = folder if folder is not None else failures_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / failure.file_name
    path.write_text(json.dumps(failure.to_dict(), indent=1) + "\n")
    return path
