"""The implementation takes every call the model takes: the same driver methods with the same
signatures, and the calls the lockstep comparison had no program for (a prefix-cache reset
that preempts the running requests, every completion owed reported at once) agreeing with
the model's, result, snapshot and bytes."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.testing.adapters import Injectable, Target
from kvoffload.testing.lockstep import compare, first_disagreement, outcome

Call = tuple[Any, ...]

# Public methods of OffloadModel that are no driver call, each with why. Every other public
# method is one, and the implementation must have it with the same signature.
NOT_DRIVER_CALLS = {
    # The model's own named invariants over its engine's ghost state (logs, finish records):
    # the implementation keeps none of it and is held to the invariants through the
    # lockstep comparison with a model that checks them.
    "check": "checks the model's invariants over the model's own engine",
}


def _public_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def _protocol_methods(protocol: type) -> set[str]:
    return {name for name, member in vars(protocol).items() if inspect.isfunction(member)} - {
        name for name in vars(protocol) if name.startswith("_")
    }


DRIVER_CALLS = sorted(set(_public_methods(OffloadModel)) - set(NOT_DRIVER_CALLS))


def test_the_implementation_has_every_driver_call() -> None:
    """The list derived from the model holds what the conformance machine drives (the
    ``Target`` protocol) and the injected faults, complete_all too; every exclusion names a
    method the model has; the implementation has every call of the list."""
    assert _protocol_methods(Target) <= set(DRIVER_CALLS)
    assert _protocol_methods(Injectable) <= set(DRIVER_CALLS)
    assert "complete_all" in DRIVER_CALLS
    assert set(NOT_DRIVER_CALLS) <= set(_public_methods(OffloadModel))
    missing = sorted(set(DRIVER_CALLS) - set(_public_methods(OffloadImpl)))
    assert not missing, f"OffloadImpl lacks the driver calls {missing}"


@pytest.mark.parametrize("name", DRIVER_CALLS)
def test_the_implementation_has_each_driver_call_with_the_models_signature(name: str) -> None:
    """Names, kinds, defaults and annotations of every parameter, and the return annotation:
    a call a program makes of the model, the implementation takes alike."""
    theirs = _public_methods(OffloadImpl).get(name)
    assert theirs is not None, f"OffloadImpl has no {name}()"
    mine = inspect.signature(getattr(OffloadModel, name))
    found = inspect.signature(theirs)

    def shape(signature: inspect.Signature) -> list[tuple[str, object, object, object]]:
        return [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]

    assert shape(found) == shape(mine), f"{name}{found} is not the model's {name}{mine}"
    assert found.return_annotation == mine.return_annotation


# -- reset_prefix_cache(reset_connector, reset_running_requests) --------------------------

# A weight update in the middle of generation: r0 computed in part, r1 hitting it, both
# running; the reset preempts them (its store done first), and both run again from nothing.
WEIGHT_UPDATE: list[Call] = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 3),
    ("step", 6),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1], 2),
    ("step", 6),
    ("drain",),
    ("reset_prefix_cache", True, True),
    ("step", 16),
    ("drain",),
    ("step", 16),
    ("drain",),
    ("step", 16),
]
# A store in flight holds two GPU blocks: the reset is refused, nothing changes; once the
# store is reported, the same reset preempts both; a later one preempts r0, running again.
REFUSED_THEN_DONE: list[Call] = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 3),
    ("step", 6),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1], 2),
    ("step", 6),
    ("reset_prefix_cache", True, True),
    ("drain",),
    ("reset_prefix_cache", False, True),
    ("step", 16),
    ("drain",),
    ("step", 16),
    ("reset_prefix_cache", False, True),
    ("step", 16),
]
# r2 loads from the CPU (its GPU hit cleared by a reset of the GPU alone) while r1 runs: the
# load holds its GPU blocks, refused; the load reported, r2 holds its loaded blocks waiting,
# refused again; once r2 runs, both are preempted, r1 is finished before the next step tells
# the connector, and r2 runs again from nothing.
LOAD_IN_FLIGHT: list[Call] = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 2),
    ("step", 16),
    ("step", 16),
    ("drain",),
    ("reset_prefix_cache", False),
    ("add", "r1", [5, 5, 5, 5, 5], 4),
    ("step", 8),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 6], 2),
    ("step", 8),
    ("reset_prefix_cache", True, True),
    ("drain",),
    ("reset_prefix_cache", False, True),
    ("step", 8),
    ("drain",),
    ("reset_prefix_cache", True, True),
    ("finish", "r1"),
    ("step", 16),
    ("drain",),
    ("step", 16),
    ("drain",),
    ("step", 16),
]

LAYOUTS = {
    "one-group": OffloadConfig(12, 16, (4,), 4),
    "two-sizes": OffloadConfig(16, 12, (4, 8), 4),
    "sliding-window": OffloadConfig(16, 12, (4, 4), 4, sliding_windows=(None, 5)),
    "chunked-local": OffloadConfig(16, 12, (4, 4), 4, attention_chunks=(None, 8)),
    "mamba": OffloadConfig(16, 12, (4, 4), 4, mamba=(False, True)),
    "two-workers": OffloadConfig(16, 12, (4, 4), 4, world_size=2),
    "lazy": OffloadConfig(12, 12, (4,), 4, lazy=True),
}


def _running_resets(config: OffloadConfig, program: list[Call]) -> list[str]:
    """What each reset with ``reset_running_requests`` did on the model alone: how many
    running requests it preempted, or that it was refused."""
    model = OffloadModel(config, check=True)
    seen: list[str] = []
    for call in program:
        running = len(model.engine.running)
        result = outcome(model, call)
        if call[0] == "reset_prefix_cache" and len(call) > 2 and call[2]:
            refused = isinstance(result, str) and "cannot free GPU blocks" in result
            seen.append("refused" if refused else f"preempted {running}")
    return seen


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_reset_that_preempts_the_running_requests_agrees_with_the_model(layout: str) -> None:
    config = LAYOUTS[layout]
    flags = [(True, True), (False, True)]
    for reset_connector, running in flags:
        program = [
            ("reset_prefix_cache", reset_connector, running)
            if call[0] == "reset_prefix_cache"
            else call
            for call in WEIGHT_UPDATE
        ]
        assert _running_resets(config, program)[0].startswith("preempted"), layout
        assert _running_resets(config, program)[0] != "preempted 0", layout
        assert first_disagreement(config, program) is None


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        (REFUSED_THEN_DONE, ["refused", "preempted 2", "preempted 1"]),
        (LOAD_IN_FLIGHT, ["refused", "refused", "preempted 2"]),
    ],
    ids=["store-in-flight", "load-in-flight"],
)
def test_a_reset_refused_while_a_transfer_holds_blocks_agrees_with_the_model(
    program: list[Call], expected: list[str]
) -> None:
    """The refusal (the same error and message, nothing changed), and the resets that
    follow it, on both sides."""
    config = LAYOUTS["one-group"]
    assert _running_resets(config, program) == expected
    assert first_disagreement(config, program) is None


def test_a_refused_reset_leaves_the_implementation_as_it_was() -> None:
    config = LAYOUTS["one-group"]
    impl = OffloadImpl(config, device="cpu", lockstep=True)
    model = OffloadModel(config)
    for call in LOAD_IN_FLIGHT[:9]:
        outcome(model, call)
        outcome(impl, call)
    before = impl.snapshot()
    with pytest.raises(Exception) as refused:
        impl.reset_prefix_cache(True, reset_running_requests=True)
    with pytest.raises(Exception) as expected:
        model.reset_prefix_cache(True, reset_running_requests=True)
    assert (type(refused.value), str(refused.value)) == (type(expected.value), str(expected.value))
    assert impl.snapshot() == before and impl.engine.running == ["r1"]


# -- complete_all -------------------------------------------------------------------------

# Two workers: a store half reported, then every store and load owed reported at once, with
# a load in flight among them (r2's, from the CPU copy of r0's prompt).
COMPLETE_ALL: list[Call] = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 2),
    ("step", 16),
    ("step", 16),
    ("store", 0, 1),
    ("complete_all",),
    ("reset_prefix_cache", False),
    ("add", "r1", [5, 5, 5, 5, 5], 4),
    ("step", 8),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 6], 2),
    ("step", 8),
    ("complete_all",),
    ("step", 8),
    ("complete_all",),
    ("step", 16),
    ("complete_all",),
    ("complete_all",),
]


@pytest.mark.parametrize("world_size", [1, 2])
def test_complete_all_agrees_with_the_model(world_size: int) -> None:
    """Result, snapshot and KV bytes after each ``complete_all``, and every call between
    them compared as the lockstep comparison does."""
    config = OffloadConfig(12, 16, (4,), 4, world_size=world_size)
    model = OffloadModel(config, check=True)
    with OffloadImpl(config, device="cpu", lockstep=True) as impl:
        results: list[tuple[str, ...]] = []
        for n, call in enumerate(COMPLETE_ALL):
            if call[0] != "complete_all":
                if call[0] == "store" and call[2] >= world_size:
                    continue
                assert compare(model, impl, call, n, incremental=False) is None
                continue
            results.append(model.complete_all())
            assert impl.complete_all() == results[-1], f"call {n}"
            assert impl.snapshot() == model.snapshot(), f"call {n}"
            assert impl.check_data() == [], f"call {n}"
            assert model.outstanding("store") == impl.outstanding("store") == []
            assert model.outstanding("load") == impl.outstanding("load") == []
        assert ("r2",) in results  # the load in flight was among those reported
