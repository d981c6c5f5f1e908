"""Eager store selection: each step, the newly confirmed GPU blocks of every scheduled request
that a store must copy, scanned from the request's cursor (``_select_eager_blocks_to_store``),
and the boundary states of Mamba groups the scheduler hands off.

Invariants kept (docs/spec.md): SKIP, CAPACITY, RECOVER, POSITION, TABLE, BOUNDARY, and
UNREACHABLE (a destination gets no key at allocation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.model.arith import align_down, plan_selection, ready_blocks
from kvoffload.model.block_pool import Block
from kvoffload.model.ghost import (
    BoundaryRecord,
    NullRecord,
    SelectionRecord,
)
from kvoffload.model.keys import BlockKey, block_keys, fine_key
from kvoffload.model.loads import (
    Loads,
)
from kvoffload.model.offload_state import (
    Disposition,
    Outcome,
    StoreMeta,
    StoreState,
)

if TYPE_CHECKING:
    from kvoffload.model.engine import Request, SchedulerOutput


# Why the eager scan would pass over a block, as a hand-off's outcome.
_OUTCOME_OF = {
    Disposition.NULL: Outcome.DROPPED_NULL_BLOCK,
    Disposition.UNHASHED: Outcome.DROPPED_NOT_HASHED,
    Disposition.IN_FLIGHT: Outcome.SKIPPED_IN_FLIGHT,
    Disposition.PRESENT: Outcome.SKIPPED_ALREADY_CACHED,
}


def _at(keys: list[BlockKey], index: int) -> BlockKey | None:
    """The key of position ``index`` (None past the request's hashes)."""
    return keys[index] if index < len(keys) else None


class EagerSelection(Loads):
    """The eager scan of confirmed blocks, and the boundary-state hand-offs."""

    def ready_count(self, num_computed: int, group_block_size: int, table_len: int) -> int:
        """How many of a group's table positions the eager scan may reach: those whole
        scheduler blocks of confirmed tokens fill (:func:`~kvoffload.model.arith.ready_blocks`);
        with fine-grained CPU hits, those the confirmed tokens fill (vLLM's
        ``get_num_cacheable_tokens`` rounds nothing then)."""
        if self.config.cpu_fine_grained_hits:
            return min(table_len, num_computed // group_block_size)
        return ready_blocks(num_computed, self.block_size, group_block_size, table_len)

    def _prepare_eager_store_specs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[int], list[int], list[str], list[dict[BlockKey, StoreMeta]] | None]:
        merged_gpu: list[int] = []
        merged_cpu: list[int] = []
        merged_meta: list[dict[BlockKey, StoreMeta]] | None = [] if self.config.kv_events else None
        req_ids: list[str] = []
        for req_id, entries in scheduler_output.boundary_offloads:
            if self._store_boundary_states(
                req_id, entries, scheduler_output, merged_gpu, merged_cpu, merged_meta
            ):
                req_ids.append(req_id)
        # vLLM 0.32.0 (bug S20 of docs/history.md): preemption freed the request's blocks; its
        # table and cursors start over, whatever shape its resumption comes in (up to 0.31.0
        # only a resumption flagged as such, which vLLM's newer model runner never sends).
        for req_id in sorted(scheduler_output.preempted_req_ids):
            self.forget_table(req_id)
        for req_id, new_block_ids in scheduler_output.req_data():
            state = self.reqs_to_store.get(req_id)
            if state is None or state.finished:
                continue
            # A resumed request's data is its whole table, as a new request's (0.33.0 clears
            # the table for it too: by then preemption has cleared it).
            for g, ids in enumerate(new_block_ids):
                state.block_ids[g].extend(ids)
            if scheduler_output.num_scheduled_tokens.get(req_id, 0) == 0:
                continue
            gpu_ids, advanced, meta = self._select_eager_blocks_to_store(
                state, state.block_ids, final_flush=False
            )
            if gpu_ids:
                cpu_blocks = self.allocate_store_destinations(gpu_ids)
                req_ids.append(req_id)
                merged_gpu.extend(gpu_ids)
                merged_cpu.extend(b.block_id for b in cpu_blocks)
                if merged_meta is not None and meta is not None:
                    merged_meta.extend(meta)
                self.in_flight_store_gpu_blocks.update(gpu_ids)
                self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
            for g, n in enumerate(advanced):
                state.num_stored_blocks[g] += n
        # A request with both a hand-off and a scan in the event is named once.
        return merged_gpu, merged_cpu, list(dict.fromkeys(req_ids)), merged_meta

    def _store_boundary_states(
        self,
        req_id: str,
        entries: tuple[tuple[int, int, int], ...],
        scheduler_output: SchedulerOutput,
        merged_gpu: list[int],
        merged_cpu: list[int],
        merged_meta: list[dict[BlockKey, StoreMeta]] | None,
    ) -> bool:
        """Store a request's boundary-state hand-offs (Mamba states the scheduler cached
        this step, which leave the table at once), each under the key its block holds, while
        the CPU pool has room; whether any was stored. A request finished, preempted or not
        tracked gives up its blocks, which may be another's now: none is read (vLLM 0.30.0,
        PR #54736)."""
        state = self.reqs_to_store.get(req_id)
        live = not (state is None or state.finished or req_id in scheduler_output.preempted_req_ids)
        stored = False
        for _, gpu_id, _ in entries:
            block = self.gpu_pool.blocks[gpu_id]
            reason = self._classify(block)
            if not live:
                outcome = Outcome.DROPPED_REQUEST_GONE
            elif reason is not None:
                outcome = _OUTCOME_OF[reason]
            elif self.cpu_pool.num_free_blocks <= 0:
                outcome = Outcome.DROPPED_CPU_FULL
            else:
                outcome = Outcome.STORED
            self.boundary_log.append(
                BoundaryRecord(
                    req_id,
                    gpu_id,
                    outcome,
                    live,
                    block.is_null,
                    block.block_hash,
                    gpu_id in self.in_flight_store_gpu_blocks,
                    block.block_hash is not None and block.block_hash in self.cpu_pool.cached,
                )
            )
            self.save_outcomes[outcome] = self.save_outcomes.get(outcome, 0) + 1
            self.decided_outcomes.append(outcome)
            if outcome is not Outcome.STORED:
                continue
            (cpu_block,) = self.allocate_store_destinations([gpu_id])
            merged_gpu.append(gpu_id)
            merged_cpu.append(cpu_block.block_id)
            if merged_meta is not None:
                # Its keys are the block's own, resolved at completion: nothing is captured
                # (an event without tokens, as vLLM's).
                merged_meta.append({})
            self.in_flight_store_gpu_blocks.add(gpu_id)
            self.gpu_pool.touch([block])
            stored = True
        return stored

    def forget_table(self, req_id: str) -> None:
        """A preempted request's store state: no table, every cursor at 0."""
        state = self.reqs_to_store.get(req_id)
        if state is not None:
            for ids in state.block_ids:
                ids.clear()
            state.num_stored_blocks = [0] * len(state.block_ids)

    def _classify(self, block: Block) -> Disposition | None:
        """Why the scan passes over this block, or None when it may be stored."""
        if block.is_null:
            return Disposition.NULL
        if block.block_hash is None:
            return Disposition.UNHASHED
        if block.block_id in self.in_flight_store_gpu_blocks:
            return Disposition.IN_FLIGHT
        if self.cpu_pool.get_one_block(block.block_hash) is not None:
            return Disposition.PRESENT
        return None

    def _select_eager_blocks_to_store(
        self, state: StoreState, block_ids: tuple[list[int], ...], final_flush: bool
    ) -> tuple[list[int], list[int], list[dict[BlockKey, StoreMeta]] | None]:
        """Confirmed blocks to store from each group's cursor on, the cursor advances, and,
        with kv-cache events, what each selected block's keys cover.

        Shared by the per-step scan and the final flush (PR #53532). When the final flush
        stops for capacity, the blocks it did not reach are recorded as dropped.
        """
        request = state.request
        num_free = self.cpu_pool.num_free_blocks
        # Per group, the request's key of each position: what the scan, its records and the
        # kv-cache events compare a block with.
        keys = [
            block_keys(request.digests, g, size, self.hash_block_size)
            for g, size in enumerate(self.group_block_sizes)
        ]
        candidates = [
            [
                (i, self._scan_block(request.request_id, g, i, ids[i], _at(keys[g], i)))
                for i in range(
                    state.num_stored_blocks[g],
                    self.ready_count(request.num_computed_tokens, size, len(ids)),
                )
            ]
            # A Mamba table is not scanned: its states leave it at once, and go by hand-offs
            # (vLLM's has_positionally_stable_blocks).
            if not self.config.is_mamba(g)
            else []
            for g, (ids, size) in enumerate(zip(block_ids, self.group_block_sizes, strict=True))
        ]
        candidates = [self.scannable(group) for group in candidates]
        reasons = [[self._classify(block) for _, block in group] for group in candidates]
        picks, advanced, full = self.plan(
            [[reason is None for reason in group] for group in reasons], num_free
        )
        marks = self.dispositions[request.request_id]
        chosen = [[candidates[g][j] for j in group] for g, group in enumerate(picks)]
        observed = [
            self._observe(i, block, _at(keys[g], i))
            for g, group in enumerate(chosen)
            for i, block in group
        ]
        selected = [block.block_id for group in chosen for _, block in group]
        for g, group in enumerate(candidates):
            for j in range(advanced[g]):
                i, _ = group[j]
                marks[g].setdefault(i, reasons[g][j] or Disposition.STORED)
        if final_flush and full:
            for g, group in enumerate(candidates):
                for i, _ in group:
                    marks[g].setdefault(i, Disposition.DROPPED_CAPACITY)
        self.selection_log.append(
            SelectionRecord(
                request.request_id,
                final_flush,
                num_free,
                tuple(observed),
                request.num_computed_tokens
                if self.config.cpu_fine_grained_hits
                else align_down(request.num_computed_tokens, self.block_size),
            )
        )
        meta = None
        if self.config.kv_events:
            meta = [
                self._store_meta(request, g, keys[g], i, block)
                for g, group in enumerate(chosen)
                for i, block in group
            ]
        return selected, advanced, meta

    def scannable(self, candidates: list[tuple[int, Block]]) -> list[tuple[int, Block]]:
        """The positions of a group the scan goes over: all of them (an unkeyed block is
        passed over, its cursor advancing, since 0.22.0)."""
        return candidates

    def _store_meta(
        self, request: Request, group: int, keys: list[BlockKey], index: int, block: Block
    ) -> dict[BlockKey, StoreMeta]:
        """What position ``index`` of ``group`` covers in ``request`` (whose keys in that
        group are ``keys``), under the selected block's primary key and under every
        fine-grained key of the request inside it (vLLM's ``BlockStoreMeta`` per hash): the
        tokens past the key before, and that key's digest. As vLLM 0.34.0 captures it: the
        primary is the block's, the tokens are the request's (EVENT-STORED says whether they
        agree)."""
        size, hbs = self.group_block_sizes[group], self.hash_block_size
        tokens = request.all_token_ids
        start = index * size
        assert block.block_hash is not None, f"selected GPU block {block.block_id} has no key"
        meta: dict[BlockKey, StoreMeta] = {
            block.block_hash: (
                None if index == 0 else keys[index - 1].digest,
                tuple(tokens[start : start + size]),
                # vLLM's BlockStoreMeta of the primary names no block size: should that key
                # be a secondary one at completion (a window's block reused at a finer
                # position), its event is of size 0 and carries nothing.
                0,
            )
        }
        for j in range(start // hbs, (start + size) // hbs):
            key = fine_key(request.digests, j, group, hbs)
            if key != block.block_hash:
                parent = None if j == 0 else request.digests[j - 1]
                meta[key] = (parent, tuple(tokens[j * hbs : (j + 1) * hbs]), hbs)
        return meta

    def _scan_block(
        self, request_id: str, group: int, index: int, block_id: int, key: BlockKey | None
    ) -> Block:
        """The GPU block the scan considers at a position of a table whose key is ``key``:
        the table's, or, where a sliding window left the null block, the block the GPU
        prefix cache still holds under that key (vLLM 0.30.0: the retained tail the window
        freed)."""
        block = self.gpu_pool.blocks[block_id]
        if not block.is_null and not self.reused(group, block, key):
            return block
        recovered = None if key is None else self.recover_null_block(key)
        self.null_log.append(
            NullRecord(
                request_id,
                group,
                index,
                key,
                key is not None and key in self.gpu_pool.cached,
                None if recovered is None else recovered.block_id,
            )
        )
        return self.gpu_pool.null_block if recovered is None else recovered

    def reused(self, group: int, block: Block, key: BlockKey | None) -> bool:
        """Whether a sliding-window table's block was freed when it left the window and is
        now another position's: it holds a key, not this position's. The scan's copy of the
        table still names it (its positions are confirmed a step after they are computed),
        so the position is taken as the null it is (found by the machine: vLLM 0.34.0 stores
        the reused block, with this position's tokens in its BlockStored event)."""
        return (
            not self.config.full_attention(group)
            and block.block_hash is not None
            and block.block_hash != key
        )

    def recover_null_block(self, key: BlockKey) -> Block | None:
        """The GPU block cached under ``key``, if any."""
        return self.gpu_pool.get_one_block(key)

    def plan(
        self, storable: list[list[bool]], num_free: int
    ) -> tuple[list[list[int]], list[int], bool]:
        """The selection plan (:func:`~kvoffload.model.arith.plan_selection`)."""
        return plan_selection(storable, num_free)
