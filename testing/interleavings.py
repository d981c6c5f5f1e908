"""The interleavings of completions a program reaches (issue 34), by class.

vLLM's workers report the transfers they finished in whatever order their streams finish
them, each worker on its own: a connector that counts reports per event, releases blocks per
request or orders its queues by issue must hold under every interleaving, and a machine that
always completes transfers in issue order, every worker at once (vLLM's own test helper
does), never tries the others. These classes name the interleavings a program's completions
can take; ``tests/test_conformance_machine.py`` measures how often each machine's ci stream
reaches each (the floors are there), like the draw rates of the layouts.

Read from the transfers owed before each call (``outstanding``: per kind, the (event, worker)
reports still owed) and the call itself:

- ``stores out of order``: a store event completes (its last report) while a store issued
  before it is still owed;
- ``loads out of order``: the same for loads;
- ``load passes store``: a load completes while a store issued before it is still owed (a
  drain reports loads first);
- ``store passes load``: a store completes while a load issued before it is still owed;
- ``workers apart``: an event's workers report in different calls (some report, some remain);
- ``workers reversed``: a worker reports an event while a worker of lower rank still owes it.

Issue order is the order in which transfers first became owed; events of one kind are issued
in the order of their ids, and a step's load before its store (vLLM's worker starts the loads
before the forward and saves after it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STORES_OUT_OF_ORDER = "stores out of order"
LOADS_OUT_OF_ORDER = "loads out of order"
LOAD_PASSES_STORE = "load passes store"
STORE_PASSES_LOAD = "store passes load"
WORKERS_APART = "workers apart"
WORKERS_REVERSED = "workers reversed"
CLASSES = (
    STORES_OUT_OF_ORDER,
    LOADS_OUT_OF_ORDER,
    LOAD_PASSES_STORE,
    STORE_PASSES_LOAD,
    WORKERS_APART,
    WORKERS_REVERSED,
)

Owed = Mapping[str, Sequence[tuple[int, int]]]  # kind -> (event, worker) reports still owed
_PASSES = {
    ("store", "store"): STORES_OUT_OF_ORDER,
    ("load", "load"): LOADS_OUT_OF_ORDER,
    ("load", "store"): LOAD_PASSES_STORE,
    ("store", "load"): STORE_PASSES_LOAD,
}


@dataclass
class Interleavings:
    """The classes one program reached, fed the reports owed before each call and the
    reports the call made."""

    # (kind, event) -> when it was first owed: twice the call before which it was, plus one
    # for a store
    issued: dict[tuple[str, int], int] = field(default_factory=dict)
    reached: set[str] = field(default_factory=set)
    calls: int = 0

    def observe(self, owed: Owed, reports: Iterable[tuple[str, int, int]]) -> None:
        """One call: ``owed`` before it, and the (kind, event, worker) reports it made, in
        the order it made them."""
        left = {kind: set(pairs) for kind, pairs in owed.items()}
        for kind, pairs in owed.items():
            for event, _ in pairs:
                # (one step's load goes before its store: vLLM's worker starts loads before
                # the forward and saves after it)
                self.issued.setdefault((kind, event), 2 * self.calls + (kind == "store"))
        self.calls += 1
        reported: set[tuple[str, int]] = set()
        for kind, event, worker in reports:
            if (event, worker) not in left.get(kind, set()):
                continue  # (not owed: refused, or a duplicate)
            owing = {w for e, w in left[kind] if e == event}
            if any(w < worker for w in owing):
                self.reached.add(WORKERS_REVERSED)
            left[kind].discard((event, worker))
            reported.add((kind, event))
            if owing == {worker}:  # its last report: the event completes
                self._completed(kind, event, left)
        for kind, event in reported:
            if any(e == event for e, _ in left[kind]):
                self.reached.add(WORKERS_APART)

    def in_issue_order(self) -> list[tuple[str, int]]:
        """The (kind, event) pairs seen owed so far, in the order they were issued."""
        return sorted(self.issued, key=lambda seen: (self.issued[seen], seen[1]))

    def _completed(self, kind: str, event: int, left: dict[str, set[tuple[int, int]]]) -> None:
        when = self.issued[(kind, event)]
        for (earlier_kind, earlier), issued in self.issued.items():
            still = any(e == earlier for e, _ in left.get(earlier_kind, ()))
            if still and (issued < when or (earlier_kind == kind and earlier < event)):
                self.reached.add(_PASSES[(kind, earlier_kind)])


def reports_of(call: tuple[Any, ...], owed: Owed) -> list[tuple[str, int, int]]:
    """The reports a driver call makes, in order, given the reports owed before it: a
    ``store``, ``fail_store`` or ``load`` call its own; a ``drain`` every load owed, then
    every store (lockstep.apply's order)."""
    name = call[0]
    if name in ("store", "fail_store"):
        return [("store", call[1], call[2])]
    if name == "load":
        return [("load", call[1], call[2])]
    if name == "drain":
        return [(kind, e, w) for kind in ("load", "store") for e, w in owed.get(kind, ())]
    return []
