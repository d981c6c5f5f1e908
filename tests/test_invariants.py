"""Every invariant can fail: each test breaks one on purpose and ``check`` names it.

A check that cannot fail proves nothing, so each ID in ``CHECKS`` has a corruption here. The
registry is docs/spec.md's table: the same IDs in the same order, kinds, subjects, statements
and check functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvoffload.model import CHECKS, InvariantViolation, OffloadModel, check, violations
from kvoffload.model.block_pool import FreshRecord
from kvoffload.model.engine import FinishRecord
from kvoffload.model.invariants import CONTRACTS, REGISTRY, exercised, invariant
from kvoffload.model.keys import BlockKey
from kvoffload.model.offload import (
    BoundaryRecord,
    CompletionRecord,
    LazyReturnRecord,
    LazyScanRecord,
    LoadState,
    NullRecord,
    Outcome,
    PickRecord,
    ResetRecord,
    SelectionRecord,
    StatsRecord,
    StoredRecord,
    TailRecord,
    Transfer,
)
from kvoffload.model.types import STORED, KVEvent

from helpers import drain, make, prompt

ALIEN = BlockKey(0, 999, "f" * 16)


def busy() -> OffloadModel:
    """A state with every kind of holder: a load in flight, a store in flight, a queued
    final flush, running and finished requests."""
    model = make(gpu_blocks=10, cpu_blocks=16)
    tokens = prompt(40)
    model.add_request("a", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    model.add_request("filler", prompt(144, 5), max_tokens=1)
    model.step(160)
    drain(model)
    model.add_request("b", tokens, max_tokens=2)  # loads a's 32 tokens
    model.add_request("c", prompt(40, 7), max_tokens=9)
    model.step(16)
    model.step(40)  # c's first blocks are now in a store event in flight
    model.add_request("d", prompt(33, 8), max_tokens=1)
    model.step(64)  # d finishes: its flush is queued
    snap = model.snapshot()
    assert snap.loads and snap.store_events and snap.pending_flushes
    return model


def _free_hashed_cpu_block(m: OffloadModel) -> int:
    cpu = m.engine.connector.cpu_pool
    return next(b.block_id for b in cpu.blocks if b.ref_cnt == 0 and b.block_hash is not None)


def _break_pool_primary(m: OffloadModel) -> None:
    cpu = m.engine.connector.cpu_pool
    block = cpu.blocks[_free_hashed_cpu_block(m)]
    assert block.block_hash is not None
    del cpu.cached[block.block_hash]


def _break_keys(m: OffloadModel) -> None:
    ids = m.engine.req_to_blocks["c"][0]
    m.engine.gpu_pool.blocks[ids[0]].block_hash = ALIEN


def _break_unreachable(m: OffloadModel) -> None:
    c = m.engine.connector
    dest = next(iter(c.store_event_to_blocks.values())).cpu_block_ids[0]
    c.cpu_pool.cached[ALIEN] = [dest]


def _break_load_pinned(m: OffloadModel) -> None:
    c = m.engine.connector
    block = c.cpu_pool.blocks[c.reqs_to_load["b"].transfer.cpu_block_ids[0]]
    assert block.block_hash is not None
    del c.cpu_pool.cached[block.block_hash]


def _break_in_flight(m: OffloadModel) -> None:
    in_flight = m.engine.connector.in_flight_store_gpu_blocks
    in_flight.add(next(i for i in range(1, m.config.gpu_blocks) if i not in in_flight))


def _break_pending(m: OffloadModel) -> None:
    m.engine.connector.has_pending_stores = lambda: False  # type: ignore[method-assign]


BREAKS: dict[str, Callable[[OffloadModel], None]] = {
    "POOL-QUEUE": lambda m: m.engine.gpu_pool.free_queue.append(m.engine.gpu_pool.free_queue[0]),
    "POOL-MAP": lambda m: m.engine.connector.cpu_pool.cached.__setitem__(ALIEN, [1]),
    "POOL-PRIMARY": _break_pool_primary,
    "POOL-NULL": lambda m: setattr(m.engine.gpu_pool.null_block, "block_hash", ALIEN),
    "POOL-FRESH": lambda m: m.engine.gpu_pool.allocation_log.append(
        FreshRecord(3, 2, None, frozenset(), frozenset())
    ),
    "REF-GPU": lambda m: setattr(
        m.engine.gpu_pool.blocks[m.engine.req_to_blocks["c"][0][0]], "ref_cnt", 7
    ),
    "REF-CPU": lambda m: setattr(
        m.engine.connector.cpu_pool.blocks[
            m.engine.connector.reqs_to_load["b"].transfer.cpu_block_ids[0]
        ],
        "ref_cnt",
        5,
    ),
    "KEYS": _break_keys,
    "SKIP": lambda m: m.engine.connector.selection_log.append(
        SelectionRecord("c", False, 4, (PickRecord(3, False, ALIEN, False, True),))
    ),
    "CAPACITY": lambda m: m.engine.connector.selection_log.append(
        SelectionRecord(
            "c",
            False,
            1,
            (PickRecord(3, False, ALIEN, False, False), PickRecord(4, False, ALIEN, False, False)),
        )
    ),
    "UNREACHABLE": _break_unreachable,
    "REGISTERED": lambda m: m.engine.connector.completion_log.append(
        CompletionRecord(0, 1, _free_hashed_cpu_block(m), ALIEN, 999, frozenset())
    ),
    "PENDING": _break_pending,
    "IN-FLIGHT": _break_in_flight,
    "RESET": lambda m: m.engine.connector.reset_log.append(ResetRecord(True, True, True)),
    "EVENTS": lambda m: m.engine.connector.processed_store_events.extend([0, 0]),
    "FLUSH-COMPLETE": lambda m: m.engine.finish_records.append(
        FinishRecord("x", (3,), ({0: "stored"},))  # type: ignore[dict-item]
    ),
    "LOAD-PINNED": _break_load_pinned,
    # a block a load reads marked damaged, as if the lookup had not verified it
    "INTEGRITY": lambda m: m.engine.connector.cpu_pool.damaged.add(
        m.engine.connector.reqs_to_load["b"].transfer.cpu_block_ids[0]
    ),
    # b loads from the CPU: as if it had asked to skip reading the prefix cache
    "NO-READ": lambda m: setattr(m.engine.requests["b"], "skip_reading_prefix_cache", True),
    # a scan that passed over the cached block at the head of the queue
    "LAZY-SCAN": lambda m: m.engine.connector.lazy_scan_log.append(
        LazyScanRecord(((3, ALIEN, False), (4, None, False)), 100, 5, ())
    ),
    # a lazily stored block freed behind another one
    "LAZY-EVICT-FIRST": lambda m: m.engine.connector.lazy_return_log.append(
        LazyReturnRecord((5,), (1, 5))
    ),
    # a null at the start of a full-attention table (c's first block dropped from it)
    "WINDOW": lambda m: m.engine.req_to_blocks["c"][0].__setitem__(0, 0),
    # a scan that took a block for a position whose key it does not hold
    "POSITION": lambda m: m.engine.connector.selection_log.append(
        SelectionRecord(
            "c", False, 4, (PickRecord(3, False, ALIEN, False, False, 0, BlockKey(0, 4, "0" * 16)),)
        )
    ),
    # a stored event for a key the CPU does not hold, with tokens that are not the key's
    "EVENT-STORED": lambda m: m.engine.connector.stored_log.append(
        StoredRecord(KVEvent(STORED, ALIEN, None, (1, 2, 3, 4), 4), False)
    ),
    # events published from now on, none of them for the keys the CPU map already holds
    # (stores registered without their events)
    "EVENT-STREAM": lambda m: setattr(m.engine.connector.cpu_pool, "events", []),
    # c's store state names one block more than its table (a preemption not forgotten)
    "TABLE": lambda m: m.engine.connector.reqs_to_store["c"].block_ids[0].append(1),
    # a drain of the stats that counts a load no completion processed
    "STATS": lambda m: m.engine.connector.stats_log.append(
        StatsRecord(replace(m.engine.connector.stats(), load_blocks=1), ())
    ),
    # a load of c that writes a CPU block into the GPU's null block (S24's load)
    "LOAD-TARGET": lambda m: m.engine.connector.reqs_to_load.__setitem__(
        "c", LoadState("c", Transfer([0], [1]))
    ),
    # c's full-attention table read as a Mamba group's: more states than it keeps
    "MAMBA": lambda m: setattr(m.engine, "mamba_groups", frozenset({0})),
    # a hand-off stored though its key was in the CPU map, and one of a live request
    # dropped as gone
    "BOUNDARY": lambda m: m.engine.connector.boundary_log.extend(
        [
            BoundaryRecord("c", 3, Outcome.STORED, True, False, ALIEN, False, True),
            BoundaryRecord("c", 4, Outcome.DROPPED_REQUEST_GONE, True, False, ALIEN, False, False),
        ]
    ),
    # a final flush that took a prompt tail already on the CPU, and one that left a due
    # tail behind
    "TAIL": lambda m: m.engine.connector.tail_log.extend(
        [
            TailRecord("c", 4, 3, True, False, True, False, True, True),
            TailRecord("c", 4, 3, True, False, False, False, True, False),
        ]
    ),
    # c, running, reserved for as a parked load
    "QUEUES": lambda m: m.engine.parked.__setitem__("c", 1),
    # a scan that passed over a null position whose key the GPU pool still caches
    "RECOVER": lambda m: m.engine.connector.null_log.append(
        NullRecord("c", 0, 0, next(iter(m.engine.gpu_pool.cached)), True, None)
    ),
}


def test_every_invariant_has_a_corruption() -> None:
    assert set(BREAKS) == set(CHECKS)


def test_the_busy_state_satisfies_every_invariant() -> None:
    model = busy()
    model.engine.connector.clear_logs()
    check(model.engine)


@pytest.mark.parametrize("invariant", sorted(CHECKS))
def test_breaking_an_invariant_is_reported_under_its_id(invariant: str) -> None:
    model = busy()
    model.engine.connector.clear_logs()
    BREAKS[invariant](model)
    found = {v.invariant for v in violations(model.engine)}
    assert invariant in found
    # a state that breaks an invariant has its subject: the check was exercised there
    assert invariant in exercised(model.engine)
    with pytest.raises(InvariantViolation) as caught:
        check(model.engine)
    assert caught.value.invariant in found
    assert str(caught.value).startswith(caught.value.invariant + ": ")


def _spec_rows() -> list[list[str]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "spec.md").read_text()
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split(" | ")]
        for line in section.splitlines()
        if re.match(r"^\| [A-Z-]+ \| (state|transition) \|", line)
    ]


def test_the_spec_table_is_the_registry_in_its_check_order() -> None:
    rows = _spec_rows()
    assert [r[0] for r in rows] == list(REGISTRY) == list(CHECKS)
    from kvoffload.model.observed import OBSERVED

    for (id_, kind, subject, on_target, statement, checked_by, _kept_by), inv in zip(
        rows, REGISTRY.values(), strict=True
    ):
        assert (kind, subject) == (inv.kind, inv.subject), id_
        form = OBSERVED.get(id_)
        assert on_target == (f"`observed.{form.__name__}`" if form else "ghost record"), id_
        assert statement == inv.statement, id_
        assert checked_by == f"`invariants.{inv.check.__name__}`", id_


def test_the_module_names_only_registered_invariants() -> None:
    """No second list of the invariants to drift from the registry: the module's docstring
    names none of them."""
    import kvoffload.model.invariants as module

    assert not set(re.findall(r"\b[A-Z]+(?:-[A-Z]+)+\b|\b[A-Z]{4,}\b", module.__doc__ or "")) & set(
        REGISTRY
    )


def test_the_decorator_refuses_a_second_registration_and_a_check_without_statement() -> None:
    def nothing(state: object) -> Iterator[str]:
        yield from ()

    with pytest.raises(ValueError, match="POOL-QUEUE is registered twice"):
        invariant("POOL-QUEUE", "state", "pools", present=lambda s: True)(nothing)
    with pytest.raises(ValueError, match="needs a kind and a statement"):
        invariant("UNSTATED", "state", "pools", present=lambda s: True)(nothing)
    assert "UNSTATED" not in REGISTRY


def test_every_invariant_a_module_says_it_keeps_is_registered() -> None:
    """A module's list of the invariants it keeps names registered IDs only (or the input
    and data contracts), so a renamed or dropped invariant cannot linger in a docstring."""
    import importlib
    import pkgutil

    import kvoffload.impl
    import kvoffload.model

    named: dict[str, set[str]] = {}
    for package in (kvoffload.model, kvoffload.impl):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            doc = importlib.import_module(info.name).__doc__ or ""
            if "Invariants kept" in doc:
                # (names in backquotes are code: a table, a function, not an invariant)
                kept = re.sub(r"`[^`]*`", "", doc.split("Invariants kept", 1)[1])
                named[info.name] = set(re.findall(r"\b[A-Z]+(?:-[A-Z]+)+\b|\b[A-Z]{4,}\b", kept))
    assert "kvoffload.model.selection" in named and "kvoffload.impl.connector" in named
    contracts = set(CONTRACTS)  # kvoffload's own (docs/spec.md)
    for module, ids in named.items():
        assert ids <= set(REGISTRY) | contracts, (module, sorted(ids - set(REGISTRY)))
