"""Bad input gets a typed exception naming the problem and leaves the state unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import (
    ConfigError,
    DuplicateCompletionError,
    DuplicateRequestError,
    InvalidArgumentError,
    KVOffloadError,
    OffloadConfig,
    OffloadModel,
    RequestFinishedError,
    UnknownEventError,
    UnknownRequestError,
)

from helpers import make, prompt


def _busy(kind: str) -> OffloadModel | OffloadImpl:
    """A finished request, a running one, and a store event half reported."""
    model: OffloadModel | OffloadImpl = (
        make(world_size=2) if kind == "model" else OffloadImpl(make(world_size=2).config)
    )
    model.add_request("done", prompt(33, 1), max_tokens=1)
    model.add_request("live", prompt(40, 2), max_tokens=5)
    model.step(80)
    model.step(8)
    model.complete_store(0, worker=0)
    return model


class Shifty(Sequence[int]):
    """A prompt whose items change each time it is iterated: valid ids the first time, a
    negative one after."""

    def __init__(self) -> None:
        self.rounds = 0

    def __len__(self) -> int:
        return 3

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(3))]
        if not 0 <= index < 3:
            raise IndexError(index)
        return -1 if self.rounds > 1 else index

    def __iter__(self) -> Iterator[int]:
        self.rounds += 1
        return iter([self[i] for i in range(3)])


Target = OffloadModel | OffloadImpl
CASES: list[tuple[Callable[[Target], object], type[KVOffloadError], str]] = [
    (lambda m: m.add_request("live", [1]), DuplicateRequestError, "'live' already exists"),
    (lambda m: m.add_request("", [1]), InvalidArgumentError, "non-empty str"),
    (lambda m: m.add_request("x", []), InvalidArgumentError, "non-empty sequence"),
    (lambda m: m.add_request("x", [1, -2]), InvalidArgumentError, "token id must be >= 0"),
    (lambda m: m.add_request("x", "abc"), InvalidArgumentError, "sequence of ints"),  # type: ignore[arg-type]
    (lambda m: m.add_request("x", [1, 10**30]), InvalidArgumentError, "must be <= 2147483647"),
    (lambda m: m.add_request("x", [True]), InvalidArgumentError, "token id must be an int"),
    (lambda m: m.lookup([2**31]), InvalidArgumentError, "token id must be <= 2147483647"),
    (lambda m: m.add_request("x", [1], max_tokens=0), InvalidArgumentError, "max_tokens"),
    (
        lambda m: m.add_request("x", [1], 1, 1),  # type: ignore[arg-type]
        InvalidArgumentError,
        "skip_reading_prefix_cache must be a bool, got 1",
    ),
    (lambda m: m.step(-1), InvalidArgumentError, "token_budget must be >= 0"),
    (lambda m: m.finish("nope"), UnknownRequestError, "unknown request 'nope'"),
    (lambda m: m.finish("done"), RequestFinishedError, "'done' has already finished"),
    (lambda m: m.complete_store(99), UnknownEventError, "store event 99 was never issued"),
    (lambda m: m.complete_store(0, worker=0), DuplicateCompletionError, "already reported"),
    (lambda m: m.complete_store(0, worker=2), InvalidArgumentError, "out of range"),
    (lambda m: m.complete_store(-1), InvalidArgumentError, "event must be >= 0"),
    (lambda m: m.complete_load(0), UnknownEventError, "load event 0 was never issued"),
    (lambda m: m.lookup([]), InvalidArgumentError, "non-empty sequence"),
]


@pytest.mark.parametrize("kind", ["model", "impl"])
@pytest.mark.parametrize(("call", "error", "message"), CASES)
def test_bad_input_raises_and_leaves_state_unchanged(
    call: Callable[[Target], object], error: type[KVOffloadError], message: str, kind: str
) -> None:
    target = _busy(kind)
    before = target.snapshot()
    with pytest.raises(error, match=message):
        call(target)
    assert target.snapshot() == before
    if isinstance(target, OffloadModel):
        target.check()


@pytest.mark.parametrize("kind", ["model", "impl"])
def test_a_prompt_is_validated_as_it_is_used(kind: str) -> None:
    """The tuple taken from a prompt is the one checked: a sequence that changes between two
    iterations adds the tokens it held when validated, never unvalidated ones."""
    target = _busy(kind)
    target.add_request("shifty", Shifty(), max_tokens=1)
    added = next(r for r in target.snapshot().requests if r.request_id == "shifty")
    assert added.num_tokens == 3
    target.step(8)
    if isinstance(target, OffloadModel):
        assert target.engine.requests["shifty"].prompt == (0, 1, 2)
        target.check()


def test_an_unknown_variant_or_fault_is_a_config_error() -> None:
    config = OffloadConfig(gpu_blocks=4, cpu_blocks=4)
    with pytest.raises(ConfigError, match="unknown variant 'nope'"):
        OffloadModel(config, variant="nope")
    with pytest.raises(ConfigError, match=r"unknown faults \['nope'\]"):
        OffloadImpl(config, faults=["nope"])


def test_errors_share_one_base_and_the_usual_builtin_bases() -> None:
    assert issubclass(UnknownRequestError, LookupError)
    assert issubclass(ConfigError, ValueError)
    assert all(issubclass(e, KVOffloadError) for _, e, _ in CASES)


def test_a_request_larger_than_the_gpu_pool_is_rejected() -> None:
    model = make(gpu_blocks=4, group_block_sizes=(4,))
    with pytest.raises(InvalidArgumentError, match=r"needs 4 GPU blocks .* the GPU pool has 3"):
        model.add_request("big", prompt(13), max_tokens=1)
    assert model.live_requests() == []
