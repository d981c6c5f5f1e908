"""The fault catalogue: named variants of the implementation, each reproducing a real bug
class of CPU offloading under its id in the bug catalogue (:mod:`kvoffload.model.catalogue`).
All are off by default; ``OffloadImpl(faults=[name, ...])`` selects them. Each class
overrides one behaviour of :class:`Connector`, :class:`Worker` or :class:`Validation` and
says which vLLM issue, PR or code (or which part of kvoffload's own contract: the integrity
of host blocks, the input checks) it comes from.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, replace

from kvoffload.impl.connector import Connector, Copy, Meta, Offer, Scheduled, Tracker
from kvoffload.impl.engine import ImplRequest
from kvoffload.impl.pool import NULL, Pool, block_key
from kvoffload.impl.validation import Validation
from kvoffload.impl.worker import Worker
from kvoffload.model.config import OffloadConfig
from kvoffload.model.types import NO_EVENT, ConnectorMetadata, OffloadStats
from kvoffload.model.validate import require_new_request


class PhantomPrimary(Connector):
    """vLLM #53498 (fixed by PR #53532): CPU blocks are stamped with the GPU block's key at
    allocation, and completion registers through ``_insert_block_hash`` without
    ``reset_hash()``; its first guard returns early, so the primary never enters the map."""

    def reserve(self, picked: list[int]) -> list[int]:
        cpu = super().reserve(picked)
        for gpu_block, cpu_block in zip(picked, cpu, strict=True):
            self.cpu.key[cpu_block] = self.gpu.key[gpu_block]
        return cpu

    def forget(self, copy: Copy) -> None:
        for block in copy.cpu:
            self.cpu.key[block] = None  # vLLM <= 0.29.0 reset the stamp before releasing
        super().forget(copy)


class NoFinalFlush(Connector):
    """vLLM #53498 (fixed by PR #53532): finishing a request queues nothing, so blocks
    confirmed after its last scan are never stored."""

    def queue_final_flush(self, request: ImplRequest, tables: tuple[list[int], ...]) -> Copy | None:
        return None


class SecondaryKeysNotCopied(Connector):
    """vLLM #53498 (fixed by PR #53532): completion registers the primary key only; the GPU
    block's secondary (fine-grained) keys never reach the CPU block."""

    def publish(self, copy: Copy) -> None:
        for gpu_block, cpu_block in zip(copy.gpu, copy.cpu, strict=True):
            key = self.gpu.key[gpu_block]
            assert key is not None
            self.cpu.register(key, cpu_block, self.gpu.key_tokens[gpu_block])


class SecondaryKeysUnannounced(Connector):
    """The event side of vLLM #53498's first bug: a completed store registers every key of
    its source, but publishes a ``stored`` event for the primary only, so a router indexing
    the CPU tier from its events never learns of the secondary (fine-grained) keys it holds."""

    def publish(self, copy: Copy) -> None:
        events = self.cpu.events
        start = len(events) if events is not None else 0
        super().publish(copy)
        if events is not None:
            primaries = {block_key(self.gpu.key[b]) for b in copy.gpu}
            events[start:] = [e for e in events[start:] if e.key in primaries]


class _Flushing(Connector):
    """Marks the final flush's selection, for faults that break only that selection."""

    flushing = False

    def queue_final_flush(self, request: ImplRequest, tables: tuple[list[int], ...]) -> Copy | None:
        self.flushing = True
        try:
            return super().queue_final_flush(request, tables)
        finally:
            self.flushing = False


class FlushStoresPresent(_Flushing):
    """PR #53532 ("existing CPU entries are skipped"): a final flush that does not skip
    blocks whose key is already in the CPU map stores them a second time."""

    def storable(self, window: Sequence[int]) -> list[int]:
        if self.flushing:
            key = self.gpu.key
            return [
                b for b in window if b != NULL and key[b] is not None and b not in self.in_flight
            ]
        return super().storable(window)


class FlushIgnoresCapacity(_Flushing):
    """PR #53532 ("the flush respects CPU capacity"): a final flush that selects every
    confirmed block asks the CPU pool for more blocks than it has free."""

    def select(
        self, tracker: Tracker, tables: tuple[list[int], ...]
    ) -> tuple[list[int], list[int], bool]:
        if not self.flushing:
            return super().select(tracker, tables)
        confirmed = tracker.request.num_computed_tokens // self.align * self.align
        picked = [
            b
            for g, table in enumerate(tables)
            for b in self.storable(
                table[tracker.cursors[g] : min(len(table), confirmed // self.sizes[g])]
            )
        ]
        return picked, [0] * len(tables), False


class PendingIgnoresFlush(Connector):
    """PR #53532, commit 2bbfe699: ``has_pending_stores()`` ignoring queued final flushes
    lets the engine go idle with a flush never submitted and its GPU blocks pinned."""

    def pending(self) -> bool:
        return bool(self.stores or self.abandoned_stores)


class ResetLeaksFlush(Connector):
    """PR #53532's reset() addition: without it, unsubmitted final flushes survive
    ``reset()`` and keep their CPU and GPU blocks pinned, so the CPU cache cannot reset."""

    def release_flushes(self) -> None:
        return None


class AbandonedStoreRegisters(Connector):
    """vLLM's reset() (PR #39726): a store in flight at reset is abandoned; registering its
    data when it completes serves KV computed before the reset (e.g. under old weights)."""

    def store_done(self, event: int) -> None:
        copy = self.abandoned_stores.get(event)
        if copy is not None and event not in self.stores:
            keyed = [(g, c) for g, c in zip(copy.gpu, copy.cpu, strict=True) if self.gpu.key[g]]
            self.publish(Copy([g for g, _ in keyed], [c for _, c in keyed]))
        super().store_done(event)


class PinDroppedEarly(Connector):
    """vLLM's eager store path pins each source GPU block (``touch``, "to prevent freeing
    during async copy") until completion; dropping the pin at submission lets the block be
    reallocated and overwritten while the copy may still read it."""

    def __init__(self, config: OffloadConfig, gpu: Pool) -> None:
        super().__init__(config, gpu)
        self.early: set[int] = set()

    def build_meta(
        self,
        scheduled: list[Scheduled],
        preempted: Sequence[str] = (),
        offers: Sequence[Offer] = (),
    ) -> ConnectorMetadata:
        meta = super().build_meta(scheduled, preempted, offers)
        if meta.store_event != NO_EVENT:
            self.early.add(meta.store_event)
            self.gpu.release(self.stores[meta.store_event].gpu)
        return meta

    def store_done(self, event: int) -> None:
        copy = self.stores.get(event) or self.abandoned_stores.get(event)
        if copy is not None and event in self.early:
            self.early.discard(event)
            self.gpu.pin(copy.gpu)  # balances the release that completion performs
        super().store_done(event)


class PartialCompletionsDropped(Connector):
    """vLLM's ``_store_event_pending_counts`` ("for TP/PP: track partial store completions
    across steps"): without it, workers reporting in different steps never add up to
    ``world_size`` and the store never completes."""

    def count_store(self, event: int, count: int) -> None:
        self.partial.pop(event, None)
        if count >= self.workers:
            self.store_done(event)
        else:
            self.partial[event] = count


class NoHitPins(Connector):
    """vLLM <= 0.21.0 (S1, #39702, fixed by PR #42289): without vLLM's ``_pending_cpu_hits``
    pin ("so they survive LRU eviction until update_state_after_alloc() consumes them"), a
    hit can be evicted and reused between the lookup and the load."""

    def pin_hit(self, blocks: list[list[int]]) -> None:
        return None

    def unpin_hit(self, hit: object) -> None:
        return None


class ServesSkipReading(Connector):
    """vLLM <= 0.29.0 (PR #54998): the connector never looks at the request's
    ``skip_reading_prefix_cache`` and serves a prompt-logprobs request a CPU hit."""

    def reads_for(self, request: ImplRequest) -> bool:
        return True


class LazyReturnsToTail(Connector):
    """vLLM 0.30.0 to 0.33.0 (S26, #40332): a completed lazy store frees its GPU blocks as
    any others, to the tail of the queue (most recently used), though the CPU now holds
    them: offloading then frees no GPU room before fresher blocks."""

    def return_gpu_blocks(self, blocks: list[int]) -> None:
        self.gpu.release(blocks)


class LazyStaleCursor(Connector):
    """vLLM 0.30.0 to 0.33.0 (S27): the lazy scan resumes after the block it visited last,
    kept across steps and dropped only when that block is taken or at ``reset()``; blocks
    before it that need storing again (their CPU copies evicted) are never scanned."""

    cursor: int | None = None

    def lazy_queue(self) -> Iterable[int]:
        if self.cursor is not None and self.gpu.ref[self.cursor] > 0:
            self.cursor = None
        return self.gpu.free.after(self.cursor)

    def visited(self, block: int) -> None:
        self.cursor = block

    def reset(self) -> bool:
        self.cursor = None
        return super().reset()


class WindowTailNotRecovered(Connector):
    """vLLM <= 0.29.0 (S14, recovered in 0.30.0 by ``_cached_gpu_block``): a sliding-window
    group's blocks that left the window are the null block in the table the scan reads, and
    the scan passes over them, so the retained tail the GPU prefix cache still holds is
    never stored."""

    def recover(self, key: str) -> int:
        return NULL


class WindowStaleIds(Connector):
    """vLLM 0.24.0 to 0.34.0 (live, found by the machine: docs/upstream.md): the eager scan
    takes the block its copy of a sliding-window table names at a position, though the
    window freed it and another position reused it, and stores it under that position's
    token metadata."""

    def reused(self, held: str | None, key: str | None) -> bool:
        return False


class ScanBreaksUnhashed(Connector):
    """vLLM <= 0.21.0 (S3, PR #42296): the eager scan of a sliding-window group stops at
    the first block without a key (a position no hit can end on) instead of passing over
    it, so its cursor never moves past it and no later block of the group is stored."""

    def window_of(
        self, request: ImplRequest, group: int, start: int, window: list[int]
    ) -> list[int]:
        blocks = super().window_of(request, group, start, window)
        key = self.gpu.key
        unkeyed = next((i for i, b in enumerate(blocks) if b != NULL and key[b] is None), None)
        return blocks if unkeyed is None else blocks[:unkeyed]


class PreemptKeepsTable(Connector):
    """vLLM <= 0.31.0 (S20, fixed in 0.32.0): a preempted request's tracker keeps its table
    and cursors (reset only for a resumption flagged as resumed, which vLLM's newer model
    runner never sends), so the resumed request's whole new table goes after the old one
    and the blocks it computes again are never stored."""

    def forget_table(self, rid: str) -> None:
        pass


class StatsPendingSkipsAbandoned(Connector):
    """vLLM's ``get_stats()`` (0.31.0 on) counts as pending the CPU blocks of stores in
    flight, of queued final flushes and of stores a reset abandoned: those stay pinned
    until their copies complete. A gauge over the live stores alone shows the CPU blocks a
    reset left behind as neither free nor pending."""

    def stats(self) -> OffloadStats:
        abandoned = self.abandoned_stores
        self.abandoned_stores = {}
        try:
            return super().stats()
        finally:
            self.abandoned_stores = abandoned


class StatsLoadCountKept(Connector):
    """vLLM's ``get_stats()`` drains ``_interval_load_blocks_completed``: the load count is
    a counter's increase since the previous report. Kept instead of restarted, every report
    counts each completed load again."""

    def stats(self) -> OffloadStats:
        loaded = self.loaded_since_drain
        report = super().stats()
        self.loaded_since_drain = loaded
        return report


class ResetGpuOnly(Connector):
    """vLLM issue #57727 (live in 0.34.0): ``Scheduler.reset_prefix_cache`` without the
    connector's reset answers with the GPU's reset alone, so a reset reported as done
    leaves the CPU tier serving hits computed before it (under old weights, say)."""

    def serves_nothing(self) -> bool:
        return True


class StoreSkipsComputeWait(Worker):
    """vLLM #45704: the store copy must wait on an event recorded after the step's compute;
    without the wait it can read KV the compute stream has not written yet."""

    def store_waits(self) -> bool:
        return False


class IntegritySpotCheck(Connector):
    """kvoffload's integrity contract (a damaged host block is never loaded): a check that
    reads only the first block of each group's hit, a common shortcut, lets a damaged block
    further in be loaded into the GPU."""

    def verify(self, blocks: list[list[int]]) -> list[int]:
        return super().verify([group[:1] for group in blocks])


class FailedStoreRegisters(Connector):
    """A worker whose copy failed (its DMA erred, its rank died) reports the store failed;
    registering the store anyway serves CPU blocks that hold no whole copy of the KV."""

    def store_done(self, event: int) -> None:
        self.failed.discard(event)
        super().store_done(event)


class DuplicateReportCounted(Validation):
    """vLLM sums ``completed_store_events`` over the workers' outputs without asking which
    worker sent them; a worker whose report is delivered twice then completes the store
    before another worker has copied. The driver contract rejects the second report."""

    def completion(
        self, kind: str, event: int, worker: int, counter: int, reported: set[int]
    ) -> None:
        super().completion(kind, event, worker, counter, set())


class FitCountsCpuPool(Validation):
    """vLLM refuses a request the GPU KV cache cannot hold on its own (``max_model_len``):
    CPU offloading keeps copies, it adds no room to compute in. Checking the request against
    the GPU and CPU pools together queues a request that can never be scheduled, in front of
    every later one."""

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        known: Container[str],
        skip_reading_prefix_cache: object = False,
    ) -> tuple[int, ...]:
        both = replace(self.config, gpu_blocks=self.config.gpu_blocks + self.config.cpu_blocks)
        return require_new_request(
            both, request_id, prompt, max_tokens, known, skip_reading_prefix_cache
        )


class DcpPerRankBlocks(Connector):
    """vLLM 0.24.0 (S6, PR #46394 in 0.25.0): with decode context parallelism the eager scan
    counts confirmed tokens in a full-attention spec's per-rank blocks, so it reaches
    ``dcp_world_size`` times the confirmed blocks: blocks not computed yet, passed over for
    good while they hold no key."""

    def ready(self, group: int, confirmed: int, table_len: int) -> int:
        per_rank = self.sizes[group] // self.config.dcp_world_size
        return min(table_len, confirmed // per_rank)


class ChunkUnalignedHits(Connector):
    """vLLM <= 0.32.0 (S24, fixed in 0.33.0): a CPU hit follows a local prefix that ends
    inside an attention chunk; the lookup counts the chunks from its own start, so the
    chunked local group's hit sits one chunk boundary off, and its load writes a block of a
    chunk the request has left into the null block its table holds there."""

    def starts_on_chunk_boundary(self, computed: int) -> bool:
        return True


class HandoffStoresCached(Connector):
    """A boundary-state hand-off is stored even when the CPU already holds its key (a
    state loaded from the CPU is cached, and handed off, again when its load completes):
    a second CPU block for a key, taken from the pool's capacity."""

    def store_states(
        self,
        offers: Sequence[Offer],
        preempted: Sequence[str],
        gpu: list[int],
        cpu: list[int],
        reqs: list[str],
        meta: list[dict[str, Meta]] | None,
    ) -> None:
        index = self.cpu.index
        self.cpu.index = {}  # the admission check sees no CPU key
        try:
            super().store_states(offers, preempted, gpu, cpu, reqs, meta)
        finally:
            self.cpu.index = index


class NoPartialTail(Connector):
    """vLLM <= 0.29.0 (S13, PR #54736 in 0.30.0): with fine-grained hits, a prompt that ends
    on a hash boundary inside a full-attention block never has that tail stored: the final
    flush takes whole blocks only, so a hit can never end there from the CPU."""

    def prompt_tail(self, request: ImplRequest, tables: tuple[list[int], ...]) -> int | None:
        return None


class TailAtPromptEnd(Connector):
    """vLLM 0.30.0 to 0.33.0 (S28; 0.34.0 looks where the GPU side keys it): the final flush
    looks for the prompt tail at the prompt's last hash boundary, one boundary past the tail
    the GPU side registers when the prompt ends on a hash boundary, so it stores nothing."""

    def tail_boundary(self, request: ImplRequest) -> int:
        return request.num_prompt // self.hbs * self.hbs


class TailStoredTwice(Connector):
    """vLLM 0.34.0's guard (``partial_tail not in gpu_ids``) left out: when a decode filled
    the prompt tail's block, the final flush's scan selects it and the tail lookup appends
    it again, two CPU blocks for one GPU block in one store."""

    def tail_unpicked(self, tail: int, picked: list[int]) -> bool:
        return True


@dataclass(frozen=True)
class Fault:
    """A named fault; ``breaks`` is the invariant of ``docs/spec.md`` it violates, or
    ``KV-BYTES`` when what goes wrong is the data (a block not holding its key's KV)."""

    name: str
    cls: type[Connector] | type[Worker] | type[Validation]
    breaks: str

    @property
    def summary(self) -> str:
        return " ".join((self.cls.__doc__ or "").split("\n\n")[0].split())


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault("phantom-primary", PhantomPrimary, "REGISTERED"),
        Fault("no-final-flush", NoFinalFlush, "FLUSH-COMPLETE"),
        Fault("secondary-keys-not-copied", SecondaryKeysNotCopied, "REGISTERED"),
        Fault("secondary-keys-unannounced", SecondaryKeysUnannounced, "EVENT-STREAM"),
        Fault("flush-stores-present", FlushStoresPresent, "SKIP"),
        Fault("flush-ignores-capacity", FlushIgnoresCapacity, "CAPACITY"),
        Fault("pending-ignores-flush", PendingIgnoresFlush, "PENDING"),
        Fault("reset-leaks-flush", ResetLeaksFlush, "RESET"),
        Fault("abandoned-store-registers", AbandonedStoreRegisters, "RESET"),
        Fault("pin-dropped-early", PinDroppedEarly, "REF-GPU"),
        Fault("partial-completions-dropped", PartialCompletionsDropped, "EVENTS"),
        Fault("no-hit-pins", NoHitPins, "REF-CPU"),
        Fault("serves-skip-reading", ServesSkipReading, "NO-READ"),
        Fault("lazy-returns-to-tail", LazyReturnsToTail, "LAZY-EVICT-FIRST"),
        Fault("lazy-stale-cursor", LazyStaleCursor, "LAZY-SCAN"),
        Fault("window-tail-not-recovered", WindowTailNotRecovered, "RECOVER"),
        Fault("scan-breaks-unhashed", ScanBreaksUnhashed, "FLUSH-COMPLETE"),
        Fault("window-stale-ids", WindowStaleIds, "POSITION"),
        Fault("preempt-keeps-table", PreemptKeepsTable, "TABLE"),
        Fault("chunk-unaligned-hits", ChunkUnalignedHits, "LOAD-TARGET"),
        Fault("dcp-per-rank-blocks", DcpPerRankBlocks, "SKIP"),
        Fault("handoff-stores-cached", HandoffStoresCached, "BOUNDARY"),
        Fault("no-partial-tail", NoPartialTail, "TAIL"),
        Fault("tail-at-prompt-end", TailAtPromptEnd, "TAIL"),
        Fault("tail-stored-twice", TailStoredTwice, "TAIL"),
        Fault("stats-pending-skips-abandoned", StatsPendingSkipsAbandoned, "STATS"),
        Fault("stats-load-count-kept", StatsLoadCountKept, "STATS"),
        Fault("reset-gpu-only", ResetGpuOnly, "RESET"),
        Fault("store-skips-compute-wait", StoreSkipsComputeWait, "KV-BYTES"),
        Fault("integrity-spot-check", IntegritySpotCheck, "INTEGRITY"),
        Fault("failed-store-registers", FailedStoreRegisters, "UNREACHABLE"),
        Fault("duplicate-report-counted", DuplicateReportCounted, "INPUT"),
        Fault("fit-counts-cpu-pool", FitCountsCpuPool, "INPUT"),
    ]
}
