"""Plain result types of the driver API, shared by the model and every implementation.

They carry what vLLM's scheduler and connector return to their callers, as immutable
values, so that two implementations can be compared with ``==``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvoffload.model.keys import BlockKey

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
    finished (connector told, GPU blocks freed); ``preempted`` lists running requests that
    made room for others (blocks freed, back to the front of the waiting queue), in the
    order they were preempted.
    """

    scheduled: dict[str, tuple[int, int]]
    loading: tuple[str, ...]
    finished: tuple[str, ...]
    metadata: ConnectorMetadata
    preempted: tuple[str, ...] = ()


@dataclass(frozen=True)
class FinishResult:
    """A finish: the final-flush transfer it queued (empty when nothing was queued)."""

    request_id: str
    flush_gpu_blocks: tuple[int, ...] = ()
    flush_cpu_blocks: tuple[int, ...] = ()


# What a kv-cache event of the CPU tier says (vLLM's ``kv_events``).
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True)
class KVEvent:
    """One kv-cache event of the CPU tier, as vLLM's offload scheduler publishes it.

    ``stored`` (vLLM's ``BlockStored``): ``key`` became reachable on the CPU; ``token_ids``
    are the tokens the key covers past its parent, ``parent`` the digest of the key before
    (None for the first), ``block_size`` their count; all three empty (0) where the store
    captured nothing for that key (lazy stores). ``removed`` (``BlockRemoved``): ``key`` is
    no longer reachable. ``cleared`` (``AllBlocksCleared``): no key is. ``medium`` is the
    tier: the CPU, for this connector.
    """

    kind: str
    key: BlockKey | None = None
    parent: str | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str = MEDIUM_CPU

    def sort_key(self) -> tuple[str, str, str, tuple[int, ...], int, str]:
        """A total order, for comparing the events of one call as a multiset (vLLM emits a
        block's secondary keys in the order of a set)."""
        return (
            self.kind,
            str(self.key),
            self.parent or "",
            self.token_ids,
            self.block_size,
            self.medium,
        )


def announced(holders: Mapping[BlockKey, int], events: Iterable[KVEvent]) -> dict[BlockKey, int]:
    """How many CPU blocks hold each key, as an event stream says, read in order from
    ``holders`` (what it said before): ``stored`` adds a holder of its key, ``removed`` takes
    one away, ``cleared`` empties the tier (keys with no holder left out). vLLM announces
    each block's keys: two blocks holding one key are two ``stored`` events, and the first
    one evicted a ``removed`` while the other still serves it (EVENT-STREAM)."""
    counts = Counter(holders)
    for event in events:
        if event.kind == CLEARED:
            counts.clear()
        elif event.key is not None:
            counts[event.key] += 1 if event.kind == STORED else -1
    return {key: n for key, n in counts.items() if n}


@dataclass(frozen=True)
class OffloadStats:
    """What the connector's stats report when drained (vLLM's ``get_stats``, 0.31.0 on).

    ``load_blocks``: GPU blocks of the loads whose completion the connector processed since
    the previous drain (a load cleaned up before it was sent, or at its request's finish,
    counts nothing); ``used_blocks``: CPU blocks in use, the pool's size less its free
    blocks (the null block is always in use); ``pending_store_blocks``: CPU blocks of the
    stores in flight, queued as final flushes or abandoned by a reset; ``capacity_blocks``
    and ``lazy``: the configuration the report describes; ``save_outcomes``: per outcome
    (vLLM's ``SAVE_OUTCOMES`` label: stored, skipped or dropped and why), the boundary-state
    hand-offs decided since the previous drain, those with none left out, by label.
    """

    load_blocks: int
    used_blocks: int
    pending_store_blocks: int
    capacity_blocks: int
    lazy: bool
    save_outcomes: tuple[tuple[str, int], ...] = ()
