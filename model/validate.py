"""The driver-input contract shared by every implementation: what counts as bad input and
the error it raises. Checks only; nothing here changes state."""

from __future__ import annotations

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

# vLLM keeps token ids as int32 (the input batch's ``token_ids_cpu``), so a larger id is not
# a token of any vocabulary; Python would take it, and the hashes and KV bytes with it.
MAX_TOKEN_ID = 2**31 - 1


def require_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def require_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """The prompt as a tuple of valid token ids. The tuple is taken first and validated
    after: a sequence whose items change between two iterations must not slip ids past the
    check (the tuple checked is the tuple used)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidArgumentError(f"tokens must be a non-empty sequence of ints, got {tokens!r}")
    taken = tuple(tokens)
    if not taken:
        raise InvalidArgumentError(f"tokens must be a non-empty sequence of ints, got {tokens!r}")
    for t in taken:
        require_int("token id", t, 0, MAX_TOKEN_ID)
    return taken


def require_request_fits(
    config: OffloadConfig, request_id: object, tokens: Sequence[int], max_tokens: int
) -> None:
    """As vLLM's max_model_len check: a request must fit in the GPU pool on its own
    (:meth:`~kvoffload.model.config.OffloadConfig.blocks_for`). The last sampled token is
    never computed, so it needs no slot."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(f"request id must be a non-empty str, got {request_id!r}")
    require_int("max_tokens", max_tokens, 1)
    need = config.blocks_for(len(tokens) + max_tokens - 1)
    if need > config.gpu_blocks - 1:
        raise InvalidArgumentError(
            f"request {request_id!r} needs {need} GPU blocks for {len(tokens)} prompt and "
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
        raise DuplicateRequestError(f"request {request_id!r} already exists")
    require_flag("skip_reading_prefix_cache", skip_reading_prefix_cache)
    return tokens


def require_flag(name: str, value: object) -> bool:
    """A flag of a call must be a bool (an int is not taken for one)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


def require_live_request(request_id: str, status: str | None) -> None:
    """A request to finish must exist (``status`` None: unknown) and not be finished.
    ``status`` is the request's status, whose value names it (``"finished"``)."""
    if status is None:
        raise UnknownRequestError(f"unknown request {request_id!r}")
    if status == "finished":
        raise RequestFinishedError(f"request {request_id!r} has already finished")


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
            f"worker {worker} is out of range for world_size {config.world_size}"
        )
    if event >= counter:
        raise UnknownEventError(f"{kind} event {event} was never issued (next is {counter})")
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
