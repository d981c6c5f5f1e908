"""The exception hierarchy shared by the model and every implementation.

Every rejected call raises a subclass of :class:`KVOffloadError` whose message names the
problem, and leaves the state it was called on unchanged: a driver validates a call in full
before it mutates anything.

- :class:`ConfigError`: a configuration that vLLM would reject (sizes <= 0, block sizes that
  do not divide).
- :class:`InvalidArgumentError`: a malformed argument (negative token budget, bad token id,
  worker index out of range).
- :class:`UnknownRequestError`, :class:`DuplicateRequestError`,
  :class:`RequestFinishedError`: request ids the driver does not know, knows twice, or has
  already finished.
- :class:`UnknownEventError`: a store or load event id that was never issued.
- :class:`DuplicateCompletionError`: a worker reporting the same event twice, or more
  completions than ``world_size``.
- :class:`InvariantViolation`: a named invariant does not hold; ``invariant`` holds its ID.
- :class:`SetupError`: the tool cannot run what was asked (a target that cannot be built, a
  release environment that is broken): neither a verdict nor bad input (exit status 3).
"""

from __future__ import annotations


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises on purpose."""


class ConfigError(KVOffloadError, ValueError):
    """The configuration is not one vLLM accepts."""


class InvalidArgumentError(KVOffloadError, ValueError):
    """An argument is malformed or out of range."""


class UnknownRequestError(KVOffloadError, LookupError):
    """The request id was never added."""


class DuplicateRequestError(KVOffloadError, ValueError):
    """A request with this id already exists."""


class RequestFinishedError(KVOffloadError, ValueError):
    """The request has already finished."""


class UnknownEventError(KVOffloadError, LookupError):
    """The store or load event id was never issued."""


class DuplicateCompletionError(KVOffloadError, ValueError):
    """A completion was reported twice, or beyond world_size."""


class InvariantViolation(KVOffloadError, AssertionError):
    """A named invariant does not hold.

    ``invariant`` is the invariant's ID as listed in ``docs/spec.md``.
    """

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


class DataIntegrityError(KVOffloadError):
    """A CPU block's bytes no longer match the checksum recorded when it was registered."""


class SetupError(KVOffloadError):
    """The environment cannot run what was asked: a target that cannot be built, a release
    environment that fails to import or lacks what it needs."""
