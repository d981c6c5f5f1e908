"""The checker checked (issue 34): faults planted in the oracle itself, a catalogue of their own.

The implementation's faults (:mod:`kvoffload.impl.faults`) show that the machine finds a
buggy target. These show that the project's own tests find a buggy *checker*: each weakens
one seam of the comparison (the lockstep's incremental snapshot comparison, its kv-event and
byte comparisons), of the verdict (the observable forms judged on a target's state), or of
the model's own invariant checks, and ``tests/test_oracle_faults.py`` requires, for each, that
a named test of the project fails while it is planted. A weakened oracle that passed its own
tests would make every clean verdict worthless.

It keeps two rules:
- ORACLE-SEAM: every fault names a seam that exists (a module attribute, or an entry of a
  module's table) and weakens it alone.
- ORACLE-UNDONE: :func:`planted` restores the seam on exit, however the block ends; a name
  that is no fault is refused before anything changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvoffload.model.errors import InvariantViolation


@dataclass(frozen=True)
class OracleFault:
    """``weaken`` takes the seam's value (a function) and returns the weakened one."""

    name: str
    module: str  # the module whose attribute (or table entry) is the seam
    attribute: str
    key: str | None  # the entry of the table ``attribute`` names, or None for the attribute
    summary: str
    weaken: Callable[[Any], Any]


def _trusts_target(original: Any) -> Any:
    def unchanged_since(agreed: Any, mine: Any, theirs: Any) -> bool:
        return bool(theirs is agreed.target_snapshot)  # the model's side is not looked at

    return unchanged_since


def _finish_changes_nothing(original: Any) -> Any:
    def changes_nothing(call: tuple[Any, ...], expected: object) -> bool:
        return bool(original(call, expected) or call[0] == "finish")

    return changes_nothing


def _bytes_unchecked(original: Any) -> Any:
    return lambda model, impl, incremental: []


def _events_uncompared(original: Any) -> Any:
    def compare_events(model: Any, impl: Any) -> Any:
        return original(model, impl)._replace(difference=None)

    return compare_events


def _verdict_blind(original: Any) -> Any:
    return lambda observation, forms=None: []


def _verdict_always_breaks(original: Any) -> Any:
    def judge(observation: Any, forms: Any = None) -> list[InvariantViolation]:
        return original(observation, forms) or [InvariantViolation("POOL-QUEUE", "planted")]

    return judge


def _holds_always(original: Any) -> Any:
    def form(argument: Any) -> Iterator[str]:
        return iter(())

    return form


LOCKSTEP = "kvoffload.testing.lockstep"
ORACLE_FAULTS: dict[str, OracleFault] = {
    f.name: f
    for f in [
        OracleFault(
            "unchanged-trusts-target",
            LOCKSTEP,
            "unchanged_since",
            None,
            "the incremental comparison takes a call as agreeing when the target's snapshot "
            "is the object last found equal, whatever the model did",
            _trusts_target,
        ),
        OracleFault(
            "finish-changes-nothing",
            LOCKSTEP,
            "changes_nothing",
            None,
            "the incremental comparison reuses the model's snapshot after a finish",
            _finish_changes_nothing,
        ),
        OracleFault(
            "bytes-unchecked",
            LOCKSTEP,
            "wrong_bytes",
            None,
            "the byte check finds nothing wrong",
            _bytes_unchecked,
        ),
        OracleFault(
            "events-uncompared",
            LOCKSTEP,
            "compare_events",
            None,
            "the kv events of model and target are drained but not compared",
            _events_uncompared,
        ),
        OracleFault(
            "verdict-blind",
            LOCKSTEP,
            "judge",
            None,
            "the verdict judges nothing on the target's state: every difference is a change",
            _verdict_blind,
        ),
        OracleFault(
            "verdict-always-breaks",
            LOCKSTEP,
            "judge",
            None,
            "the verdict calls every difference a broken invariant",
            _verdict_always_breaks,
        ),
        OracleFault(
            "position-form-holds",
            "kvoffload.model.observed",
            "OBSERVED",
            "POSITION",
            "POSITION's observable form holds on every state",
            _holds_always,
        ),
        OracleFault(
            "registered-check-holds",
            "kvoffload.model.invariants",
            "CHECKS",
            "REGISTERED",
            "the model's check of REGISTERED holds on every state",
            _holds_always,
        ),
    ]
}


def _seam(fault: OracleFault) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """How to read the fault's seam and how to set it."""
    module = importlib.import_module(fault.module)
    if fault.key is None:
        attribute = fault.attribute
        return (lambda: getattr(module, attribute)), (lambda v: setattr(module, attribute, v))
    table, key = getattr(module, fault.attribute), fault.key
    if key not in table:
        raise ValueError(f"{fault.name}: {fault.module}.{fault.attribute} has no entry {key}")
    return (lambda: table[key]), (lambda v: table.__setitem__(key, v))


@contextmanager
def planted(name: str) -> Iterator[OracleFault]:
    """Plant the oracle fault ``name`` for the block: its seam weakened, restored on exit."""
    fault = ORACLE_FAULTS.get(name)
    if fault is None:
        raise ValueError(f"no oracle fault named {name!r}; known: {', '.join(ORACLE_FAULTS)}")
    read, write = _seam(fault)
    original = read()
    write(fault.weaken(original))
    try:
        yield fault
    finally:
        write(original)
