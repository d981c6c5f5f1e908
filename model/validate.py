"""The driver-input contract shared by every implementation: what counts as bad input and
the error it raises. Checks only; nothing here changes state.

Invariants kept (the INPUT contract of ``docs/spec.md``):

- every check raises a :class:`~kvoffload.model.errors.KVOffloadError` naming the problem
  before the caller changes anything, and its message shows a value the caller passed
  through :func:`~kvoffload.model.limits.brief` alone (a value of any size, a short line);
- a sequence argument is iterated once: the tuple taken is the tuple checked and the tuple
  the caller uses, and no more than the bound's items are ever taken from it;
- a request id is a str before anything looks it up (an unhashable one never reaches a
  dict);
- the work a call asks for is bounded (:mod:`kvoffload.model.limits`): a request's tokens by
  ``MAX_REQUEST_TOKENS``, a step's budget by ``MAX_STEP_TOKENS``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Sequence

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import (
    DuplicateCompletionError,
    DuplicateRequestError,
    InvalidArgumentError,
    RequestFinishedError,
    UnknownEventError,
    UnknownRequestError,
)
from kvoffload.model.limits import MAX_REQUEST_TOKENS, MAX_STEP_TOKENS, brief

# vLLM keeps token ids as int32 (the input batch's ``token_ids_cpu``), so a larger id is not
# a token of any vocabulary; Python would take it, and the hashes and KV bytes with it.
MAX_TOKEN_ID = 2**31 - 1


def require_int(
    name: str, value: object, minimum: int, maximum: int | None = None, bound: str = ""
) -> int:
    """``value`` as an int in ``[minimum, maximum]``; ``bound`` names the limit ``maximum``
    is (``"MAX_STEP_TOKENS"``), said in the message when the value passes it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {brief(value)}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {brief(value)}")
    if maximum is not None and value > maximum:
        named = f" ({bound})" if bound else ""
        raise InvalidArgumentError(f"{name} must be <= {maximum}{named}, got {brief(value)}")
    return value


def require_token_budget(token_budget: object) -> int:
    """A step's token budget: an int from 0 to ``MAX_STEP_TOKENS``."""
    return require_int("token_budget", token_budget, 0, MAX_STEP_TOKENS, "MAX_STEP_TOKENS")


def require_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """The prompt as a tuple of valid token ids. The tuple is taken first and validated
    after: a sequence whose items change between two iterations must not slip ids past the
    check (the tuple checked is the tuple used). Its length is asked before it is iterated,
    and no more than ``MAX_REQUEST_TOKENS + 1`` items are taken even where the length lies,
    so that a prompt past the bound costs nothing to refuse."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidArgumentError(
            f"tokens must be a non-empty sequence of ints, got {brief(tokens)}"
        )
    if len(tokens) > MAX_REQUEST_TOKENS:
        raise _too_many_tokens(len(tokens))
    taken = tuple(itertools.islice(tokens, MAX_REQUEST_TOKENS + 1))
    if len(taken) > MAX_REQUEST_TOKENS:  # its length said less than it holds
        raise _too_many_tokens(len(taken), "at least ")
    if not taken:
        raise InvalidArgumentError(
            f"tokens must be a non-empty sequence of ints, got {brief(tokens)}"
        )
    for t in taken:
        require_int("token id", t, 0, MAX_TOKEN_ID)
    return taken


def _too_many_tokens(count: int, qualifier: str = "") -> InvalidArgumentError:
    return InvalidArgumentError(
        f"tokens must be at most {MAX_REQUEST_TOKENS} (MAX_REQUEST_TOKENS), got {qualifier}{count}"
    )


def require_request_id(request_id: object) -> str:
    """A request id to look up: a str. An id of another type names no request, and is not
    looked up at all (an unhashable one, a list say, would raise ``TypeError`` from the
    lookup instead of this contract's error)."""
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request id must be a non-empty str, got {brief(request_id)}")
    return request_id


def require_request_fits(
    config: OffloadConfig, request_id: object, tokens: Sequence[int], max_tokens: int
) -> None:
    """As vLLM's max_model_len check: a request must fit in the GPU pool on its own
    (:meth:`~kvoffload.model.config.OffloadConfig.blocks_for`), and its prompt and outputs
    in ``MAX_REQUEST_TOKENS``. The last sampled token is never computed, so it needs no
    slot."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"request id must be a non-empty str, got {brief(request_id)}")
    require_int("max_tokens", max_tokens, 1)
    if len(tokens) + max_tokens > MAX_REQUEST_TOKENS:
        raise InvalidArgumentError(
            f"request {brief(request_id)} asks for {len(tokens)} prompt and "
            f"{brief(max_tokens)} output tokens: more than {MAX_REQUEST_TOKENS} "
            "(MAX_REQUEST_TOKENS)"
        )
    need = config.blocks_for(len(tokens) + max_tokens - 1)
    if need > config.gpu_blocks - 1:
        raise InvalidArgumentError(
            f"request {brief(request_id)} needs {need} GPU blocks for {len(tokens)} prompt and "
            f"{max_tokens - 1} computed output tokens; the GPU pool has {config.gpu_blocks - 1}"
        )


def require_new_request(
    config: OffloadConfig,
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int,
    known: Container[str],
    skip_reading_prefix_cache: object = False,
) -> tuple[int, ...]:
    """A new request: valid tokens, fits the GPU pool alone, an id not used before, a flag
    that is a bool. Returns the prompt's tokens."""
    tokens = require_tokens(prompt)
    require_request_fits(config, request_id, tokens, max_tokens)
    if request_id in known:
        raise DuplicateRequestError(f"request {brief(request_id)} already exists")
    require_flag("skip_reading_prefix_cache", skip_reading_prefix_cache)
    return tokens


def require_flag(name: str, value: object) -> bool:
    """A flag of a call must be a bool (an int is not taken for one)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {brief(value)}")
    return value


def require_live_request(request_id: str, status: str | None) -> None:
    """A request to finish must exist (``status`` None: unknown) and not be finished.
    ``status`` is the request's status, whose value names it (``"finished"``)."""
    if status is None:
        raise UnknownRequestError(f"unknown request {brief(request_id)}")
    if status == "finished":
        raise RequestFinishedError(f"request {brief(request_id)} has already finished")


def require_completion(
    config: OffloadConfig,
    kind: str,
    event: int,
    worker: int,
    counter: int,
    reported: set[int],
) -> None:
    """A completion must name an issued event and a worker that has not reported it."""
    require_int("event", event, 0)
    require_int("worker", worker, 0)
    if worker >= config.world_size:
        raise InvalidArgumentError(
            f"worker {brief(worker)} is out of range for world_size {config.world_size}"
        )
    if event >= counter:
        raise UnknownEventError(f"{kind} event {brief(event)} was never issued (next is {counter})")
    if worker in reported:
        raise DuplicateCompletionError(f"worker {worker} already reported {kind} event {event}")


def owed_completions(
    config: OffloadConfig, counter: int, reports: dict[int, set[int]]
) -> list[tuple[int, int]]:
    """The (event, worker) completions still owed: every issued event below ``counter``, for
    every worker that has not reported it (the other side of :func:`require_completion`)."""
    return [
        (event, worker)
        for event in range(counter)
        for worker in range(config.world_size)
        if worker not in reports.get(event, set())
    ]


def require_damageable(
    config: OffloadConfig,
    block_id: object,
    worker: object,
    state: Callable[[int], tuple[object | None, int]],
) -> None:
    """An injected fault (``corrupt``) damages the bytes of a cached CPU block: one in the
    pool, not the null block, registered and unpinned (``state(block_id)`` gives its
    primary key, None when it has none, and its ref count), on a worker of the world."""
    block = require_int("cpu block", block_id, 1, config.cpu_blocks - 1)
    require_int("worker", worker, 0, config.world_size - 1)
    key, ref_cnt = state(block)
    if key is None:
        raise InvalidArgumentError(f"cpu block {block} is not registered: no KV to damage")
    if ref_cnt:
        raise InvalidArgumentError(
            f"cpu block {block} is in use (ref count {ref_cnt}): only a cached block is damaged"
        )


def require_resettable(kept: Sequence[int]) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request,
    which frees their blocks alone: ``kept`` (the GPU blocks in use that preempting would
    not free: a load's, a transfer's) must be empty, or the reset is refused before any
    request is preempted (vLLM preempts, then raises)."""
    if kept:
        raise InvalidArgumentError(
            f"reset_prefix_cache(reset_running_requests=True) cannot free GPU blocks "
            f"{brief(list(kept))}: a load or a transfer holds them, and vLLM raises once it "
            "has preempted"
        )
