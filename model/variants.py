"""The bugs of vLLM issue #53498, and later releases' changes, as variants of the model.

A variant that models one bug is named by that bug's id in the catalogue
(:mod:`kvoffload.model.catalogue`), as the fault of the implementation and the row of the
history that are the same bug are.

Each bug variant overrides one step of :class:`~kvoffload.model.offload.OffloadScheduler`
and reproduces what vLLM did before PR #53532. ``check()`` names the invariant each one
breaks:

- ``phantom-primary``: CPU blocks are stamped with the GPU block's primary at
  allocation and the primary is then inserted through ``insert_block_hash`` without
  ``reset_hash``. Guard 1 returns early, so the primary never enters the map: the stored
  block is reachable by its secondary keys only. Caught by REGISTERED and POOL-PRIMARY.
- ``no-final-flush``: finishing a request queues nothing, so blocks confirmed
  after its last scan are never stored. Caught by FLUSH-COMPLETE.
- ``primary-only``: what vLLM 0.29.0 itself does (found by driving it, see
  ``docs/upstream.md``): the stamp at allocation is put into the map directly at completion,
  so the primary is reachable, without its token count, and no secondary key is registered.
  Caught by REGISTERED.
- ``serves-skip-reading``: vLLM <= 0.29.0 (PR #54998, in 0.30.0): the connector serves a CPU
  hit to a request that skips reading the prefix cache (prompt logprobs), which vLLM's own
  prefix cache never serves. Caught by NO-READ (S12 of ``docs/history.md``).
- ``window-tail-not-recovered``: vLLM <= 0.29.0 (S14): the store scan passes over the null
  block a sliding window leaves, though the block that left the window is still cached in the
  GPU free queue (0.30.0 stores it from there). Caught by RECOVER.
- ``window-stale-ids``: vLLM 0.24.0 to 0.34.0 (live; found by the machine): the store scan
  takes the block its copy of a sliding-window table names at a position, though the window
  freed it and another position reused it. Caught by POSITION and EVENT-STORED.
- ``preempt-keeps-table``: vLLM <= 0.31.0 (S20, fixed in 0.32.0): a preempted request's
  store state starts over only when its resumption comes flagged as resumed (the older
  model runner's shape); resumed as a new request, as vLLM's newer model runner does, it
  keeps the old table and cursors and the new table goes after them, so the blocks it
  computes again are never stored. Caught by TABLE.
- ``vllm-0.29``: vLLM 0.29.0 as it is: both bugs (``primary-only`` and
  ``no-final-flush``), ``serves-skip-reading``, ``window-tail-not-recovered``,
  ``window-stale-ids``, ``preempt-keeps-table``, and its
  selection loop, whose cursors also pass over blocks that need no store while the CPU pool
  is full (``SharedBudgetScheduler``).

Older releases had more bugs, fixed before #53532 (``docs/history.md``):

- ``no-hit-pins``: vLLM <= 0.21.0 (#39702, fixed by PR #42289 in 0.22.0): a CPU hit is not
  pinned between the lookup and the allocation that takes it, and the allocation looks it
  up again (asserting it is as long), so a store allocation in between can evict it. No
  state invariant demands the pin: the machine finds it as a difference (S1 of
  ``docs/history.md``).
- ``step-dedup``: vLLM <= 0.21.0 (PR #41289, in 0.22.0): stores are deduplicated within a
  step only, so a GPU block whose store is in flight is stored again by the next step's
  scan. Caught by IN-FLIGHT (nothing is in flight between steps).
- ``scan-breaks-unhashed``: vLLM <= 0.21.0 (PR #42296, S3's fix, in 0.22.0): the eager scan
  of a group stops at the first block without a key instead of passing over it. With full
  attention alone the machine meets one only in the table a preempted request kept
  (``preempt-keeps-table``): a block freed at preemption and allocated again, not yet full.
  No state invariant demands the pass: the machine finds it as a difference.
- ``vllm-0.21``: vLLM 0.19.0 to 0.21.0 as they are: ``vllm-0.29`` with all three.

Decode context parallelism had one in 0.24.0, the first release to allow it, fixed in 0.25.0:

- ``dcp-per-rank-blocks`` (S6, PR #46394): two conversions of tokens into blocks divide by a
  full-attention spec's per-rank block size, ``dcp_world_size`` times too small: the eager
  scan reaches that many times the confirmed blocks (storing blocks not yet computed, or
  passing over them for good while they have no key), and a load after a local prefix places
  its blocks from a back-trace of the local prefix counted in per-rank blocks, over the GPU
  hit's own blocks. Caught by SKIP (a block selected past the confirmed tokens) and
  LOAD-TARGET.

Chunked local attention had one up to 0.32.0, fixed in 0.33.0:

- ``chunk-unaligned-hits`` (S24): the CPU lookup follows a local prefix that ends inside a
  chunk; it counts the chunks from its own start, so the chunked local group's hit sits one
  chunk boundary off, and its load writes a block of a chunk the request has left into the
  null block its table holds there. Caught by LOAD-TARGET.

Lazy mode had two bugs up to 0.33.0, fixed in 0.34.0 (the lazy scan of vLLM 0.30.0 to 0.33.0
is the same code):

- ``lazy-stale-cursor`` (S27): the scan resumes after the block it visited last, a cursor kept
  across steps and dropped only when that block leaves the free queue (or at ``reset()``);
  a cursor that moved (its block freed again elsewhere in the queue) skips the blocks
  before it, and so does one left behind blocks that need storing again (their CPU copy
  evicted). Caught by LAZY-SCAN.
- ``lazy-returns-to-tail`` (S26, #40332): a completed lazy store frees its GPU blocks to the
  tail of the queue, as the most recently used, though the CPU now holds them. Caught by
  LAZY-EVICT-FIRST.
- ``lazy-0.33``: both.

Later vLLM releases changed the semantics on purpose; their variants add those changes to
the fixed model, so that a release is compared with what it means to do:

- ``reset-releases-hits`` (vLLM 0.32.0): ``reset()`` also releases the pins of CPU hits not
  yet allocated, which 0.30.0 and 0.31.0 keep until the request's next lookup.
- ``inclusive-cpu`` (vLLM 0.34.0): that, and the CPU copy of a GPU prefix hit is refreshed
  (moved to the most-recently-used end of the CPU free queue) when the request is allocated.

A variant may also be a composition, ``A+B`` (each part a variant above): the history of
bugs (``kvoffload history``) isolates one bug of a release with several by modelling the
others this way.
"""

from __future__ import annotations

import functools

from kvoffload.model.block_pool import AppendingBlockPool, Block, BlockPool
from kvoffload.model.catalogue import canonical
from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import Request, SchedulerOutput
from kvoffload.model.keys import BlockKey
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.offload import OffloadScheduler, PendingHit, Transfer
from kvoffload.model.types import ConnectorMetadata


class PhantomPrimaryScheduler(OffloadScheduler):
    """vLLM #53498, bug 1: stamp at allocation, insert without ``reset_hash``.

    Registration at completion is the fixed code's (primary first, then secondaries); with
    the stamp in place, guard 1 of ``insert_block_hash`` turns the primary insert into a
    no-op, which is the whole bug.
    """

    def allocate_store_destinations(self, gpu_ids: list[int]) -> list[Block]:
        cpu_blocks = self.cpu_pool.get_new_blocks(len(gpu_ids))
        for gpu_id, cpu_block in zip(gpu_ids, cpu_blocks, strict=True):
            # A direct write, as vLLM <= 0.29.0 did: no token count, no map entry.
            cpu_block.block_hash = self.gpu_pool.blocks[gpu_id].block_hash
        return cpu_blocks

    def _release_transfer_refs(self, transfer: Transfer) -> None:
        for block_id in transfer.cpu_block_ids:
            self.cpu_pool.blocks[block_id].reset_hash()
        super()._release_transfer_refs(transfer)


class PrimaryOnlyScheduler(PhantomPrimaryScheduler):
    """vLLM 0.29.0's registration: the stamped primary goes into the map by a direct insert
    (``cached_block_hash_to_block.insert``), bypassing ``_insert_block_hash`` and its
    guard; the GPU block's secondary keys are never looked at."""

    def register_stored_block(self, gpu_block: Block, cpu_block: Block) -> None:
        stamp = cpu_block.block_hash
        assert stamp is not None, f"CPU block {cpu_block.block_id} lost its stamp"
        self.cpu_pool._map_insert(stamp, cpu_block)


def plan_selection_029(
    storable: list[list[bool]], num_free: int
) -> tuple[list[list[int]], list[int], bool]:
    """vLLM 0.29.0's selection loop, as :func:`~kvoffload.model.arith.plan_selection` but
    entering a group even when the CPU pool is full: the cursor still passes over blocks that
    need no store (null, unhashed, in flight, present) up to the first block that does."""
    picks: list[list[int]] = [[] for _ in storable]
    advanced = [0] * len(storable)
    taken = 0
    for g, flags in enumerate(storable):
        for ok in flags:
            if ok:
                if taken >= num_free:
                    return picks, advanced, True
                picks[g].append(advanced[g])
                taken += 1
            advanced[g] += 1
    return picks, advanced, False


class SharedBudgetScheduler(OffloadScheduler):
    """vLLM 0.29.0's selection (:func:`plan_selection_029`). From 0.30.0 on, a group is not
    entered once the pool is full, and its cursor stays. Both retry the blocks not passed;
    only the cursors differ."""

    def plan(
        self, storable: list[list[bool]], num_free: int
    ) -> tuple[list[list[int]], list[int], bool]:
        return plan_selection_029(storable, num_free)


class NoFinalFlushScheduler(OffloadScheduler):
    """vLLM #53498, bug 2: a finished request's unscanned confirmed blocks are dropped."""

    def _queue_finished_eager_store(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        return None


class ServesSkipReadingScheduler(OffloadScheduler):
    """vLLM <= 0.29.0 (PR #54998): ``get_num_new_matched_tokens`` never looks at the
    request's ``skip_reading_prefix_cache``, so a prompt-logprobs request is served a CPU hit
    (its prompt logprobs then missing or short)."""

    def reads_for(self, request: Request) -> bool:
        return True


class NoHitPinsScheduler(OffloadScheduler):
    """vLLM <= 0.21.0 (#39702, fixed by PR #42289): the lookup does not pin its CPU hit, and
    ``update_state_after_alloc`` looks the hit up again from the request's local prefix,
    asserting it is as long as the tokens the scheduler accepted (the engine crash of
    #39702 when an eviction came in between)."""

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        super().__init__(config, gpu_pool)
        self.hit_starts: dict[str, int] = {}

    def _pin_hit(self, request_id: str, hit: PendingHit) -> None:
        self.hit_starts[request_id] = hit.num_computed_tokens  # found, never pinned

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        start = self.hit_starts.pop(request.request_id, None)
        if num_external_tokens and start is not None:
            blocks, hit = find_longest_cache_hit(
                self.cpu_pool, request.digests, start, num_external_tokens, self.config
            )
            assert hit == num_external_tokens, (
                f"Expected {num_external_tokens} hit tokens, got {hit}"
            )
            # The load's own touch below is then the only pin, as in 0.21.0.
            self.cpu_pool.touch([b for group in blocks for b in group if not b.is_null])
            self.pending_cpu_hits[request.request_id] = PendingHit(blocks, hit, start)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request: Request) -> None:
        self.hit_starts.pop(request.request_id, None)
        super().request_finished(request)


class StepDedupScheduler(OffloadScheduler):
    """vLLM <= 0.21.0 (PR #41289): the scan skips blocks selected earlier in the same step
    only (``gpu_blocks_this_step``): a block whose store from an earlier step is still in
    flight is selected again, and copied twice."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        self.in_flight_store_gpu_blocks.clear()
        meta = super().build_connector_meta(scheduler_output)
        self.in_flight_store_gpu_blocks.clear()  # nothing outlives the step
        return meta


class LazyStaleCursorScheduler(OffloadScheduler):
    """vLLM 0.30.0 to 0.33.0 (S27): the lazy scan starts after ``_cursor``, the block it
    visited last, unless that block has left the free queue (ref count above 0)."""

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        super().__init__(config, gpu_pool)
        self.lazy_cursor: int | None = None

    def lazy_scan_queue(self) -> list[int]:
        cursor = self.lazy_cursor
        if cursor is not None and self.gpu_pool.blocks[cursor].ref_cnt > 0:
            self.lazy_cursor = cursor = None  # stale: the block was taken
        queue = self.gpu_pool.free_queue
        return list(queue[0 if cursor is None else queue.index(cursor) + 1 :])

    def after_lazy_scan(self, visited: list[int]) -> None:
        if visited:
            self.lazy_cursor = visited[-1]

    def reset(self) -> bool:
        self.lazy_cursor = None  # reset() starts the next scan from the head again
        return super().reset()


class LazyReturnsToTailScheduler(OffloadScheduler):
    """vLLM 0.30.0 to 0.33.0 (S26, #40332): a completed lazy store's GPU blocks are freed as
    any others, the cached ones to the tail (most recently used)."""

    def return_lazy_blocks(self, gpu_blocks: list[Block]) -> None:
        self.gpu_pool.free_blocks(gpu_blocks)


class WindowTailNotRecoveredScheduler(OffloadScheduler):
    """vLLM <= 0.29.0 (S14; 0.30.0 recovers with ``_cached_gpu_block``): the eager scan and
    the final flush pass over the null block a sliding window leaves in a table, so the
    blocks that left the window, though still cached in the GPU free queue, are never
    stored from there. Caught by RECOVER."""

    def recover_null_block(self, key: BlockKey) -> Block | None:
        return None


class WindowStaleIdsScheduler(OffloadScheduler):
    """vLLM 0.24.0 to 0.34.0 (found by the machine, docs/upstream.md): the eager scan reads
    its own copy of a sliding-window table, which still names a block the window freed and
    another position (of this request or another) reused; it stores that block, and with
    kv-cache events publishes it with this position's tokens. Caught by POSITION (and
    EVENT-STORED, when the two positions' blocks are of one size)."""

    def reused(self, group: int, block: Block, key: BlockKey | None) -> bool:
        return False


class DcpPerRankBlocksScheduler(OffloadScheduler):
    """vLLM 0.24.0 (S6; PR #46394 in 0.25.0 scales the spec size by ``cp_world_size``): the
    eager scan's ready count divides the confirmed tokens by the per-rank block size, and the
    load's back-trace counts the local prefix's full-attention blocks in per-rank tokens.
    Caught by SKIP and LOAD-TARGET."""

    def ready_count(self, num_computed: int, group_block_size: int, table_len: int) -> int:
        per_rank = group_block_size // self.config.dcp_world_size
        return super().ready_count(num_computed, per_rank, table_len)

    def load_start(
        self, pending: PendingHit, group_block_size: int, num_taken: int, num_external: int
    ) -> int:
        fa_size = next(
            size for g, size in enumerate(self.group_block_sizes) if self.config.full_attention(g)
        )
        local_fa_blocks = pending.num_computed_tokens // fa_size
        total = local_fa_blocks * (fa_size // self.config.dcp_world_size) + num_external
        return -(-total // group_block_size) - num_taken


class ChunkUnalignedHitsScheduler(OffloadScheduler):
    """vLLM <= 0.32.0 (S24; 0.33.0 returns no CPU hit after a local prefix that is not a
    whole number of chunks): the lookup runs after any scheduler-block-aligned prefix, and
    counts a chunked local group's chunks from there. Caught by LOAD-TARGET."""

    def starts_on_chunk_boundary(self, num_computed_tokens: int) -> bool:
        return True


class TailAtPromptEndScheduler(OffloadScheduler):
    """vLLM 0.30.0 to 0.33.0 (S28; 0.34.0 takes the last boundary a resend can hit): the
    final flush looks for the prompt tail at the prompt's last hash boundary. From 0.33.0
    the GPU side registers the tail one boundary earlier when the prompt ends on a hash
    boundary, so the flush finds no key there and leaves that tail behind."""

    def fa_tail_boundary(self, request: Request) -> int:
        return len(request.prompt) // self.hash_block_size * self.hash_block_size


class PreemptKeepsTableScheduler(OffloadScheduler):
    """vLLM <= 0.31.0 (S20; 0.32.0 starts over on ``preempted_req_ids``): the store state of a
    preempted request is reset only for a resumption flagged as resumed, which vLLM's newer
    model runner never sends (it resumes the request as a new one): the old table, whose
    blocks preemption freed, and its cursors stay, and the new table is appended to them.
    Caught by TABLE."""

    def forget_table(self, req_id: str) -> None:
        pass


class ScanBreaksUnhashedScheduler(OffloadScheduler):
    """vLLM <= 0.21.0 (PR #42296 passes over them from 0.22.0): the eager scan of a group
    stops at the first block that is not null and holds no key; its cursor stays there."""

    def scannable(self, candidates: list[tuple[int, Block]]) -> list[tuple[int, Block]]:
        for j, (_, block) in enumerate(candidates):
            if not block.is_null and block.block_hash is None:
                return candidates[:j]
        return candidates


class AppendingPoolScheduler(OffloadScheduler):
    """vLLM before 0.24.0: both pools free every block to the tail of their queue
    (:class:`~kvoffload.model.block_pool.AppendingBlockPool`). Their ``free_blocks``
    decrements every block's count first and then appends each block at 0 as often as the
    list names it, which corrupts the linked free queue; a store that names a block twice
    (the table a preempted request keeps, ``preempt-keeps-table``) does. So that the machine
    compares those releases with a model, their engine does not preempt: a running request
    that cannot grow waits, as the model's engine did before preemption was modelled."""

    pool_class = AppendingBlockPool
    preempts = False


class ResetReleasesHitsScheduler(OffloadScheduler):
    """vLLM 0.32.0 (bug S21 of ``docs/history.md``): ``reset()`` releases the pins of CPU
    hits not yet allocated, so that the CPU cache can be cleared; 0.30.0 and 0.31.0 kept
    them until the request's next lookup, and ``reset()`` could not succeed meanwhile."""

    def reset(self) -> bool:
        for pending in self.pending_cpu_hits.values():
            self._free_pending_cpu_hit(pending)
        self.pending_cpu_hits.clear()
        return super().reset()


class InclusiveCpuScheduler(ResetReleasesHitsScheduler):
    """vLLM 0.34.0: "eager CPU is inclusive". A GPU prefix hit also has a CPU copy (eager
    stores put every computed block there), which the eager scan then skips; so that this
    copy is not evicted first, the lookup remembers the local prefix and the allocation
    touches and frees its CPU blocks, moving them to the tail of the free queue."""

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        super().__init__(config, gpu_pool)
        self.pending_local_hits: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self.pending_local_hits.pop(request.request_id, None)
        if num_computed_tokens and not self.config.lazy:  # lazy stores skip nothing on GPU
            # Recorded before any reason to return 0: a misaligned local hit is refreshed too.
            self.pending_local_hits[request.request_id] = num_computed_tokens
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        num_local = self.pending_local_hits.pop(request.request_id, 0)
        if num_local:
            prefix, _ = find_longest_cache_hit(
                self.cpu_pool,
                request.digests,
                0,
                num_local,
                self.config,
                fine=self.config.cpu_fine_grained_hits,
            )
            blocks = [b for group in prefix for b in group if not b.is_null]
            self.cpu_pool.touch(blocks)
            self.cpu_pool.free_blocks(reversed(blocks))
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request: Request) -> None:
        self.pending_local_hits.pop(request.request_id, None)
        super().request_finished(request)

    def reset(self) -> bool:
        self.pending_local_hits.clear()
        return super().reset()


class ResetGpuOnlyScheduler(OffloadScheduler):
    """vLLM issue #57727, every release: ``Scheduler.reset_prefix_cache`` without
    ``reset_connector`` answers with the GPU's reset alone, though the CPU tier still
    serves hits (the connector is not asked)."""

    def serves_nothing(self) -> bool:
        return True


_VLLM_029 = (
    PrimaryOnlyScheduler,
    NoFinalFlushScheduler,
    ServesSkipReadingScheduler,
    SharedBudgetScheduler,
    WindowTailNotRecoveredScheduler,
    WindowStaleIdsScheduler,
    PreemptKeepsTableScheduler,
    ResetGpuOnlyScheduler,
)
VARIANTS: dict[str, type[OffloadScheduler]] = {
    "fixed": OffloadScheduler,
    "phantom-primary": PhantomPrimaryScheduler,
    "no-final-flush": NoFinalFlushScheduler,
    "primary-only": PrimaryOnlyScheduler,
    "vllm-0.29": type("Vllm029Scheduler", _VLLM_029, {}),
    "serves-skip-reading": ServesSkipReadingScheduler,
    "no-hit-pins": NoHitPinsScheduler,
    "step-dedup": StepDedupScheduler,
    "vllm-0.23": type("Vllm023Scheduler", (*_VLLM_029, AppendingPoolScheduler), {}),
    "vllm-0.21": type(
        "Vllm021Scheduler",
        (
            NoHitPinsScheduler,
            StepDedupScheduler,
            ScanBreaksUnhashedScheduler,
            *_VLLM_029,
            AppendingPoolScheduler,
        ),
        {},
    ),
    "scan-breaks-unhashed": ScanBreaksUnhashedScheduler,
    "selection-0.29": SharedBudgetScheduler,
    "window-tail-not-recovered": WindowTailNotRecoveredScheduler,
    "window-stale-ids": WindowStaleIdsScheduler,
    "preempt-keeps-table": PreemptKeepsTableScheduler,
    "chunk-unaligned-hits": ChunkUnalignedHitsScheduler,
    "tail-at-prompt-end": TailAtPromptEndScheduler,
    "dcp-per-rank-blocks": DcpPerRankBlocksScheduler,
    "lazy-stale-cursor": LazyStaleCursorScheduler,
    "lazy-returns-to-tail": LazyReturnsToTailScheduler,
    "lazy-0.33": type(
        "Lazy033Scheduler", (LazyStaleCursorScheduler, LazyReturnsToTailScheduler), {}
    ),
    "pool-0.23": AppendingPoolScheduler,
    "reset-releases-hits": ResetReleasesHitsScheduler,
    "inclusive-cpu": InclusiveCpuScheduler,
    "reset-gpu-only": ResetGpuOnlyScheduler,
}
# The variants that change what vLLM means to do; every other one models a bug.
INTENDED = ("fixed", "reset-releases-hits", "inclusive-cpu", "selection-0.29", "pool-0.23")
# The variants that are a release's bugs together; every other bug variant is one bug of the
# catalogue (kvoffload.model.catalogue), under that bug's id.
RELEASE_MODELS = ("vllm-0.29", "vllm-0.23", "vllm-0.21", "lazy-0.33")


def _parts(variant: str) -> list[str]:
    # A part may be an old name of a bug's variant (kvoffload.model.catalogue.RENAMED).
    return [canonical(p) for p in variant.split("+")]


def is_variant(variant: str) -> bool:
    """A variant of :data:`VARIANTS`, or a composition ``A+B`` of them."""
    return isinstance(variant, str) and all(p in VARIANTS for p in _parts(variant))


def scheduler_class(variant: str) -> type[OffloadScheduler]:
    """The scheduler of ``variant``; a composition ``A+B`` has the behaviours of both."""
    return _composed("+".join(_parts(variant)))


@functools.cache
def _composed(variant: str) -> type[OffloadScheduler]:
    parts = variant.split("+")
    if len(parts) == 1:
        return VARIANTS[parts[0]]
    # The fixed model is every variant's base: as a part it adds nothing.
    classes = [VARIANTS[p] for p in parts if VARIANTS[p] is not OffloadScheduler]
    return type(variant, tuple(dict.fromkeys(classes)) or (OffloadScheduler,), {})


def keeps_invariants(variant: str) -> bool:
    """Whether ``variant`` keeps every invariant: the fixed model and later releases' changes
    do; a variant with a bug breaks one by design."""
    return all(p in INTENDED for p in _parts(variant))
