"""Bad input gets a typed exception naming the problem and leaves the state unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, overload

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
from kvoffload.model.limits import MAX_REQUEST_TOKENS, MAX_STEP_TOKENS

from helpers import make, prompt

T = TypeVar("T")


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


# -- the same bad call, the same error, on both sides -------------------------------------


def _pair(busy: bool) -> tuple[OffloadModel, OffloadImpl]:
    """A fresh model and implementation of one configuration, or both after the same calls
    (:func:`_busy`'s)."""
    if busy:
        model, impl = _busy("model"), _busy("impl")
        assert isinstance(model, OffloadModel) and isinstance(impl, OffloadImpl)
        return model, impl
    config = make(world_size=2).config
    return OffloadModel(config, check=True), OffloadImpl(config, device="cpu", lockstep=True)


def _refusal(target: Target, call: Callable[[Target], object]) -> tuple[type, str]:
    """The error ``call`` raises on ``target``, which must be left as it was."""
    before = target.snapshot()
    with pytest.raises(Exception) as raised:
        call(target)
    assert target.snapshot() == before
    return type(raised.value), str(raised.value)


HUGE = 10**5000  # an int Python refuses to write as digits
BAD_CALLS: dict[str, Callable[[Target], object]] = {
    "list as request id": lambda t: t.add_request(["a"], [1]),  # type: ignore[arg-type]
    "dict as request id": lambda t: t.add_request({"a": 1}, [1]),  # type: ignore[arg-type]
    "int as request id": lambda t: t.add_request(7, [1]),  # type: ignore[arg-type]
    "finish a list": lambda t: t.finish(["a"]),  # type: ignore[arg-type]
    "finish a dict": lambda t: t.finish({"a": 1}),  # type: ignore[arg-type]
    "finish an int": lambda t: t.finish(3),  # type: ignore[arg-type]
    "finish an unknown id": lambda t: t.finish("nope"),
    "str as prompt": lambda t: t.add_request("x", "abc"),  # type: ignore[arg-type]
    "bytes as prompt": lambda t: t.add_request("x", b"ab"),
    "set as prompt": lambda t: t.add_request("x", {1, 2}),  # type: ignore[arg-type]
    "int as prompt": lambda t: t.add_request("x", 5),  # type: ignore[arg-type]
    "empty prompt": lambda t: t.add_request("x", []),
    "negative token": lambda t: t.add_request("x", [1, -2]),
    "huge token": lambda t: t.add_request("x", [1, HUGE]),
    "float token": lambda t: t.add_request("x", [1.0]),  # type: ignore[list-item]
    "bool max_tokens": lambda t: t.add_request("x", [1], True),
    "float max_tokens": lambda t: t.add_request("x", [1], 1.5),  # type: ignore[arg-type]
    "list max_tokens": lambda t: t.add_request("x", [1], [1]),  # type: ignore[arg-type]
    "huge max_tokens": lambda t: t.add_request("x", [1], HUGE),
    "int flag of add": lambda t: t.add_request("x", [1], 1, 1),  # type: ignore[arg-type]
    "list flag of add": lambda t: t.add_request("x", [1], 1, [True]),  # type: ignore[arg-type]
    "str as lookup": lambda t: t.lookup("abc"),  # type: ignore[arg-type]
    "int as lookup": lambda t: t.lookup(5),  # type: ignore[arg-type]
    "empty lookup": lambda t: t.lookup([]),
    "lookup past int32": lambda t: t.lookup([2**31]),
    "bool budget": lambda t: t.step(True),
    "float budget": lambda t: t.step(1.0),  # type: ignore[arg-type]
    "list budget": lambda t: t.step([1]),  # type: ignore[arg-type]
    "negative budget": lambda t: t.step(-1),
    "huge budget": lambda t: t.step(HUGE),
    "int reset_connector": lambda t: t.reset_prefix_cache(1),  # type: ignore[arg-type]
    "int reset_running": lambda t: t.reset_prefix_cache(False, 1),  # type: ignore[arg-type]
    "str reset_running": lambda t: t.reset_prefix_cache(False, "yes"),  # type: ignore[arg-type]
    "list reset_connector": lambda t: t.reset_prefix_cache([True]),  # type: ignore[arg-type]
    "list as store event": lambda t: t.complete_store([0]),  # type: ignore[arg-type]
    "dict as store event": lambda t: t.complete_store({0: 1}),  # type: ignore[arg-type]
    "bool store event": lambda t: t.complete_store(True),
    "huge store event": lambda t: t.complete_store(HUGE),
    "list as store worker": lambda t: t.complete_store(0, [0]),  # type: ignore[arg-type]
    "huge store worker": lambda t: t.complete_store(0, HUGE),
    "store never issued": lambda t: t.complete_store(99),
    "list as load event": lambda t: t.complete_load([0]),  # type: ignore[arg-type]
    "load never issued": lambda t: t.complete_load(0),
    "list as failed store": lambda t: t.fail_store([0]),  # type: ignore[arg-type]
    "failed store of no worker": lambda t: t.fail_store(0, 5),
    "corrupt a list": lambda t: t.corrupt([1]),  # type: ignore[arg-type]
    "corrupt the null block": lambda t: t.corrupt(0),
    "corrupt a free block": lambda t: t.corrupt(1),
    "corrupt on a list of workers": lambda t: t.corrupt(1, [0]),  # type: ignore[arg-type]
    "outstanding of neither kind": lambda t: t.outstanding("both"),
    "outstanding of a list": lambda t: t.outstanding(["store"]),  # type: ignore[arg-type]
}
UNHASHABLE_OR_NOT_STR = [
    "list as request id",
    "dict as request id",
    "int as request id",
    "finish a list",
    "finish a dict",
    "finish an int",
]


@pytest.mark.parametrize("busy", [False, True], ids=["fresh", "busy"])
@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_a_bad_call_raises_the_same_error_on_the_model_and_the_implementation(
    name: str, busy: bool
) -> None:
    """The same type and message on both, a KVOffloadError naming the problem in one short
    line, and neither changed."""
    model, impl = _pair(busy)
    with impl:
        mine = _refusal(model, BAD_CALLS[name])
        theirs = _refusal(impl, BAD_CALLS[name])
    assert theirs == mine
    error, message = mine
    assert issubclass(error, KVOffloadError), message
    assert len(message) < 400
    if name in UNHASHABLE_OR_NOT_STR:
        assert error is InvalidArgumentError and "request id must be a non-empty str" in message
    model.check()


# -- a sequence is taken once: what is checked is what is kept -----------------------------


class Changing(Sequence[T]):
    """A sequence whose items are ``first`` on its first iteration and ``later`` on every one
    after, with the length of ``first``; ``passes`` counts its iterations."""

    def __init__(self, first: list[T], later: list[T]) -> None:
        self.first, self.later, self.passes = first, later, 0

    def _items(self) -> list[T]:
        return self.first if self.passes <= 1 else self.later

    def __len__(self) -> int:
        return len(self.first)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        return self._items()[index]

    def __iter__(self) -> Iterator[T]:
        self.passes += 1
        return iter(list(self._items()))


VALID, INVALID = prompt(9, 3), [*prompt(8, 3), -1]
CACHED = prompt(33, 1)  # _busy's "done": its first two blocks are on the CPU once stored


def _stored_prompt(target: Target, request_id: str) -> tuple[int, ...]:
    if isinstance(target, OffloadModel):
        return target.engine.requests[request_id].prompt
    request = target.engine.requests[request_id]
    return tuple(request.tokens[: request.num_prompt])


def _prompt_and_lookup_are_taken_once(kind: str) -> None:
    """add_request's prompt and lookup's tokens, valid on the first pass and not after, and
    the reverse, on one side."""
    target = _busy(kind)
    changing = Changing(VALID, INVALID)
    target.add_request("changing", changing, max_tokens=1)
    assert _stored_prompt(target, "changing") == tuple(VALID) and changing.passes == 1
    target.step(16)
    assert _stored_prompt(target, "changing") == tuple(VALID)
    before = target.snapshot()
    with pytest.raises(InvalidArgumentError, match="token id must be >= 0, got -1"):
        target.add_request("refused", Changing(INVALID, VALID), max_tokens=1)
    assert target.snapshot() == before and "refused" not in target.live_requests()
    for e, w in target.outstanding("store"):
        target.complete_store(e, w)
    assert target.lookup(CACHED) == 32
    assert target.lookup(Changing(CACHED, [1] * 33)) == 32
    assert target.lookup(Changing([1] * 33, CACHED)) == 0
    with pytest.raises(InvalidArgumentError, match="got -1"):
        target.lookup(Changing([*CACHED[:-1], -1], CACHED))
    if isinstance(target, OffloadModel):
        target.check()


def test_every_sequence_a_call_takes_is_taken_once_and_kept_as_validated() -> None:
    """add_request's prompt and lookup's tokens on both sides, and the implementation's fault
    names: a sequence valid on its first pass and not after is used as validated; one
    invalid on its first pass is refused, whatever a later pass would give. (The
    configuration's per-group tuples: tests/test_config_and_keys.py.)"""
    for kind in ("model", "impl"):
        _prompt_and_lookup_are_taken_once(kind)
    config = OffloadConfig(gpu_blocks=4, cpu_blocks=4)
    names = Changing(["no-final-flush"], ["nope"])
    impl = OffloadImpl(config, faults=names, device="cpu")
    assert impl.faults == ("no-final-flush",) and names.passes == 1
    assert type(impl.connector).__mro__[1].__name__ == "NoFinalFlush"
    with pytest.raises(ConfigError, match=r"unknown faults \['nope'\]"):
        OffloadImpl(config, faults=Changing(["nope"], ["no-final-flush"]), device="cpu")


def test_fault_names_are_a_sequence_of_str() -> None:
    config = OffloadConfig(gpu_blocks=4, cpu_blocks=4)
    with pytest.raises(ConfigError, match="faults must be a sequence of fault names, got 'nope'"):
        OffloadImpl(config, faults="nope", device="cpu")
    with pytest.raises(ConfigError, match=r"a fault name must be a str, got \['nope'\]"):
        OffloadImpl(config, faults=[["nope"]], device="cpu")  # type: ignore[list-item]


# -- the bounds of a call ------------------------------------------------------------------


class Endless(Sequence[int]):
    """A sequence that says it holds ``length`` tokens; ``items`` is what iterating it gives
    (None: iterating it at all is a failure of the test)."""

    def __init__(self, length: int, items: Iterator[int] | None = None) -> None:
        self.length, self.items = length, items

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        raise AssertionError("indexed")

    def __iter__(self) -> Iterator[int]:
        if self.items is None:
            raise AssertionError("iterated before its length was asked")
        return self.items


def _both(call: Callable[[Target], object]) -> tuple[type, str]:
    """The error ``call`` raises on a fresh model and a fresh implementation: the same."""
    model, impl = _pair(busy=False)
    with impl:
        mine, theirs = _refusal(model, call), _refusal(impl, call)
    assert theirs == mine
    return mine


def test_a_prompt_past_the_request_bound_is_refused_by_its_length_alone() -> None:
    error, message = _both(lambda t: t.add_request("x", Endless(MAX_REQUEST_TOKENS + 1)))
    assert error is InvalidArgumentError and "MAX_REQUEST_TOKENS" in message
    error, message = _both(lambda t: t.lookup(Endless(MAX_REQUEST_TOKENS + 1)))
    assert error is InvalidArgumentError and "MAX_REQUEST_TOKENS" in message


def test_a_prompt_whose_length_lies_is_taken_no_further_than_the_bound() -> None:
    """It says one token and never ends: no more than the bound's tokens are taken."""
    error, message = _both(lambda t: t.add_request("x", Endless(1, itertools.repeat(1))))
    assert error is InvalidArgumentError
    assert f"got at least {MAX_REQUEST_TOKENS + 1}" in message and "MAX_REQUEST_TOKENS" in message


def test_prompt_and_outputs_past_the_request_bound_are_refused() -> None:
    error, message = _both(lambda t: t.add_request("x", [1], MAX_REQUEST_TOKENS))
    assert error is InvalidArgumentError and "MAX_REQUEST_TOKENS" in message
    # at the bound: past the bound check, refused by the GPU pool's (as vLLM's max_model_len)
    error, message = _both(lambda t: t.add_request("x", [1], MAX_REQUEST_TOKENS - 1))
    assert "MAX_REQUEST_TOKENS" not in message and "GPU blocks" in message


@pytest.mark.parametrize("kind", ["model", "impl"])
def test_a_step_budget_past_its_bound_is_refused_and_at_it_taken(kind: str) -> None:
    model, impl = _pair(busy=False)
    with impl:
        target: Target = model if kind == "model" else impl
        with pytest.raises(InvalidArgumentError, match="MAX_STEP_TOKENS"):
            target.step(MAX_STEP_TOKENS + 1)
        target.add_request("x", [1, 2, 3], max_tokens=1)
        assert target.step(MAX_STEP_TOKENS).scheduled == {"x": (0, 3)}


def test_an_error_naming_a_large_value_stays_one_short_line() -> None:
    long_prompt = [1] * 10**6
    long_prompt[-1] = -7
    error, message = _both(lambda t: t.add_request("x", long_prompt))
    assert error is InvalidArgumentError and "got -7" in message and len(message) < 400
    for call in [
        lambda t: t.add_request("x", "a" * 10**6),
        lambda t: t.add_request([0] * 10**6, [1]),
        lambda t: t.finish([0] * 10**6),
        lambda t: t.lookup(b"b" * 10**6),
        lambda t: t.outstanding("k" * 10**6),
    ]:
        error, message = _both(call)
        assert error is InvalidArgumentError and len(message) < 400, message
