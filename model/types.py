"""Plain result types of the driver API, shared by the model and every implementation.

They carry what vLLM's scheduler and connector return to their callers, as immutable
values, so that two implementations can be compared with ``==``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NO_EVENT = -1


@dataclass(frozen=True)
class ConnectorMetadata:
    """What ``build_connector_meta`` sends to the workers for one step.

    ``store_event`` and ``load_event`` are ``NO_EVENT`` (-1) when the step has no such
    transfer. ``load_event_to_reqs`` is the full map of load events still outstanding, as
    vLLM sends it every step.
    """

    store_event: int = NO_EVENT
    store_gpu_blocks: tuple[int, ...] = ()
    store_cpu_blocks: tuple[int, ...] = ()
    load_event: int = NO_EVENT
    load_gpu_blocks: tuple[int, ...] = ()
    load_cpu_blocks: tuple[int, ...] = ()
    load_event_to_reqs: dict[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """One engine step.

    ``scheduled`` maps each request computed this step to its token range ``[start, end)``;
    ``loading`` lists requests whose CPU load was set up this step (they compute nothing
    until it completes); ``finished`` lists requests that reached ``max_tokens`` and were
    finished (connector told, GPU blocks freed).
    """

    scheduled: dict[str, tuple[int, int]]
    loading: tuple[str, ...]
    finished: tuple[str, ...]
    metadata: ConnectorMetadata


@dataclass(frozen=True)
class FinishResult:
    """A finish: the final-flush transfer it queued (empty when nothing was queued)."""

    request_id: str
    flush_gpu_blocks: tuple[int, ...] = ()
    flush_cpu_blocks: tuple[int, ...] = ()
