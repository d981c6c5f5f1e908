"""The integrity contract (kvoffload's, beyond vLLM's scheduler, which reads no bytes): a
damaged host block is never loaded, and a store a worker's copy failed on is never
registered. The model says it; the implementation does it with checksums; the two agree."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import (
    DuplicateCompletionError,
    InvalidArgumentError,
    KVOffloadError,
    OffloadModel,
    UnknownEventError,
)
from kvoffload.testing.lockstep import Call, apply, compare, first_disagreement

from helpers import config as cfg
from helpers import make, prompt

P = prompt(48)  # three blocks of 16
STORED: list[Call] = [("add", "a", P, 1), ("step", 64), ("step", 0), ("drain",)]
# A prompt as long as the GPU pool: once it has run, none of ``P``'s blocks is on the GPU.
EVICT: list[Call] = [("add", "filler", prompt(112, 3), 1), ("step", 128), ("step", 0)]
EVICT.append(("drain",))


def _stored() -> OffloadModel:
    model = make(gpu_blocks=8, cpu_blocks=16)
    for call in STORED:
        apply(model, call)
    return model


def _cpu_block_of(model: OffloadModel, position: int) -> int:
    """The CPU block holding block ``position`` of ``P``."""
    hits = [b for b in model.engine.connector.cpu_pool.blocks if b.block_hash is not None]
    return next(b.block_id for b in hits if b.block_hash_num_tokens == 16 * (position + 1))


def test_a_lookup_ends_before_a_damaged_block_and_evicts_it() -> None:
    model = _stored()
    assert model.lookup(P) == 32  # the last token is never served
    second = _cpu_block_of(model, 1)
    model.corrupt(second, 0)
    assert model.lookup(P) == 16  # read-only: passes over it, evicts nothing
    assert model.engine.connector.cpu_pool.blocks[second].block_hash is not None
    for call in EVICT:
        apply(model, call)
    model.add_request("b", P, 1)
    model.step(64)
    block = model.engine.connector.cpu_pool.blocks[second]
    assert block.block_hash is None and second not in model.engine.connector.cpu_pool.damaged
    assert model.snapshot().loads[0].transfer.cpu_block_ids == (_cpu_block_of(model, 0),)


def test_a_damaged_block_leaves_the_set_when_reallocated_or_reset() -> None:
    model = _stored()
    pool = model.engine.connector.cpu_pool
    model.corrupt(_cpu_block_of(model, 0), 0)
    assert model.reset() and not pool.damaged


def test_a_store_whose_copy_failed_is_dropped() -> None:
    model = make(gpu_blocks=8, cpu_blocks=8, world_size=2)
    model.add_request("a", P, 1)
    model.step(64)
    event = model.step(0).metadata.store_event
    assert model.fail_store(event, 0) is False
    assert model.complete_store(event, 1) is True
    cpu = model.snapshot().cpu
    assert not cpu.cached and all(b.primary is None for b in cpu.blocks)
    assert model.lookup(P) == 0 and not model.has_pending_stores()


BAD: list[tuple[Callable[[OffloadModel | OffloadImpl], object], type[KVOffloadError], str]] = [
    (lambda t: t.corrupt(0, 0), InvalidArgumentError, "cpu block must be >= 1, got 0"),
    (lambda t: t.corrupt(16, 0), InvalidArgumentError, "cpu block must be <= 15, got 16"),
    (lambda t: t.corrupt(1, 1), InvalidArgumentError, "worker must be <= 0, got 1"),
    (lambda t: t.corrupt(9, 0), InvalidArgumentError, "cpu block 9 is not registered"),
    (lambda t: t.fail_store(99, 0), UnknownEventError, "store event 99 was never issued"),
    (lambda t: t.fail_store(0, 0), DuplicateCompletionError, "worker 0 already reported"),
]


@pytest.mark.parametrize(("call", "error", "message"), BAD)
@pytest.mark.parametrize("kind", ["model", "impl"])
def test_injecting_into_what_cannot_take_it_is_refused(
    call: Callable[[OffloadModel | OffloadImpl], object],
    error: type[KVOffloadError],
    message: str,
    kind: str,
) -> None:
    model = _stored()
    target: OffloadModel | OffloadImpl = model
    if kind == "impl":
        target = OffloadImpl(model.config, device="cpu")
        for c in STORED:
            apply(target, c)
    before = target.snapshot()
    with pytest.raises(error, match=message):
        call(target)
    assert target.snapshot() == before


def test_a_pinned_block_cannot_be_damaged() -> None:
    model = _stored()
    for call in EVICT:
        apply(model, call)
    model.add_request("b", P, 1)
    model.step(64)  # b loads: its CPU blocks are pinned
    pinned = model.snapshot().loads[0].transfer.cpu_block_ids[0]
    with pytest.raises(InvalidArgumentError, match=f"cpu block {pinned} is in use"):
        model.corrupt(pinned, 0)


PROGRAMS: dict[str, list[Call]] = {
    "damaged second block": [
        *STORED,
        ("corrupt", 2, 0),
        ("lookup", P),
        *EVICT,
        ("add", "b", P, 1),
        ("step", 64),
        ("drain",),
        ("step", 64),
        ("lookup", P),
    ],
    "damaged on one worker of two": [*STORED, ("corrupt", 2, 1), ("lookup", P)],
    "failed store then repeat": [
        ("add", "a", P, 1),
        ("step", 64),
        ("step", 0),
        ("fail_store", 0, 0),
        *EVICT,
        ("add", "b", P, 1),
        ("step", 64),
        ("lookup", P),
    ],
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_implementation_agrees_with_the_model(name: str) -> None:
    config = cfg(8, 16, world_size=2 if "two" in name else 1)
    assert first_disagreement(config, PROGRAMS[name], device="cpu") is None


@pytest.mark.parametrize(
    ("fault", "program"),
    [
        ("integrity-spot-check", "damaged second block"),
        ("failed-store-registers", "failed store then repeat"),
    ],
)
def test_a_weakened_check_disagrees(fault: str, program: str) -> None:
    found = first_disagreement(cfg(8, 16), PROGRAMS[program], faults=[fault], device="cpu")
    assert found is not None


def test_the_data_check_exempts_a_block_damaged_on_purpose_only() -> None:
    model = _stored()
    impl = OffloadImpl(model.config, device="cpu")
    for call in STORED:
        apply(impl, call)
    assert compare(model, impl, ("corrupt", 3, 0), 0) is None
    assert impl.data_mismatches() and not impl.data_mismatches(frozenset({3}))
    impl.close()
