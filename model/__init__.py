"""kvoffload.model: the executable specification of KV-cache CPU offloading.

A pure-Python, deterministic state machine of vLLM's block pools and SimpleCPUOffload
connector in eager mode, as fixed by PR #53532 (vLLM 0.30.0 and later). Drive it with
:class:`OffloadModel`; read it with :meth:`OffloadModel.snapshot`; check it with
:func:`check`, which names the violated invariant (see ``docs/spec.md``).
"""

from kvoffload.model.config import OffloadConfig
from kvoffload.model.driver import OffloadModel
from kvoffload.model.errors import (
    ConfigError,
    DataIntegrityError,
    DuplicateCompletionError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolation,
    KVOffloadError,
    RequestFinishedError,
    SetupError,
    UnknownEventError,
    UnknownRequestError,
)
from kvoffload.model.invariants import CHECKS, check, violations
from kvoffload.model.keys import BlockKey
from kvoffload.model.snapshot import Snapshot
from kvoffload.model.types import (
    NO_EVENT,
    ConnectorMetadata,
    FinishResult,
    OffloadStats,
    StepResult,
)
from kvoffload.model.variants import VARIANTS

__all__ = [
    "CHECKS",
    "NO_EVENT",
    "VARIANTS",
    "BlockKey",
    "ConfigError",
    "ConnectorMetadata",
    "DataIntegrityError",
    "DuplicateCompletionError",
    "DuplicateRequestError",
    "FinishResult",
    "InvalidArgumentError",
    "InvariantViolation",
    "KVOffloadError",
    "OffloadConfig",
    "OffloadModel",
    "OffloadStats",
    "RequestFinishedError",
    "SetupError",
    "Snapshot",
    "StepResult",
    "UnknownEventError",
    "UnknownRequestError",
    "check",
    "violations",
]
