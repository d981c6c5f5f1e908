"""The implementation's offload scheduler: CPU offloading as vLLM 0.30.0's
``SimpleCPUOffloadScheduler`` for full-attention, sliding-window, chunked local and Mamba
groups (their states stored as the scheduler hands them off), with kv-cache events, eager or
lazy as 0.34.0 has it, written for speed.

State is in arrays (:mod:`kvoffload.impl.pool`): transfers, hits and loads hold block ids,
and every pool operation takes a whole batch. Selection walks each group's block table from
its cursor once, filtering a window with one comprehension; the in-flight set and the CPU
index are hash lookups on key strings. Fault variants override single methods
(``kvoffload.impl.faults``).

Invariants kept (``docs/spec.md``): SKIP, CAPACITY, UNREACHABLE, REGISTERED, PENDING,
IN-FLIGHT, RESET, EVENTS, LOAD-PINNED, NO-READ, LAZY-SCAN, LAZY-EVICT-FIRST, BOUNDARY.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.impl.pool import NULL, Pool, block_key
from kvoffload.model.arith import window_run
from kvoffload.model.types import NO_EVENT, STORED, ConnectorMetadata, KVEvent, OffloadStats

if TYPE_CHECKING:
    from kvoffload.impl.engine import ImplRequest
    from kvoffload.model.config import OffloadConfig


# What a store captured for a key's ``stored`` event: (parent digest, token ids, block size).
Meta = tuple[str | None, tuple[int, ...], int]


@dataclass
class Copy:
    """Paired GPU and CPU block ids of one transfer; with kv-cache events, what each stored
    block's keys covered when it was selected (None: nothing captured)."""

    gpu: list[int]
    cpu: list[int]
    meta: list[dict[str, Meta]] | None = None


@dataclass
class Load:
    request_id: str
    copy: Copy
    event: int | None = None
    finished: bool = False


# What the connector reads of a scheduled request: its id, the block ids per group (the
# whole table for a new or resumed request, else the step's new blocks), tokens scheduled.
Scheduled = tuple[str, tuple[list[int], ...], int]
# A boundary-state hand-off: the request and the GPU block of the state it cached.
Offer = tuple[str, int]


@dataclass
class Tracker:
    """Eager store tracking of one request."""

    request: ImplRequest
    tables: tuple[list[int], ...]
    cursors: list[int]
    events: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class Hit:
    blocks: list[list[int]]
    length: int
    start: int


class Connector:
    """Scheduler side of CPU offloading, eager or lazy (``OffloadConfig.lazy``)."""

    def __init__(self, config: OffloadConfig, gpu: Pool) -> None:
        self.config = config
        self.lazy = config.lazy
        self.lazy_target = config.lazy_target_free
        self.sizes = config.group_block_sizes
        self.align = config.scheduler_block_size
        self.hbs = config.hash_block_size
        # Fine-grained CPU hits. The lookups stay scheduler-block-aligned: in every layout
        # the configuration admits with them (each Mamba block the scheduler block, keyed
        # at its end only), a hit at a hash boundary inside a scheduler block has no Mamba
        # state to end on, so the hash-aligned lookup finds what the aligned one does
        # (tests/test_lookup.py checks the model's two lookups agree there).
        self.fine = config.cpu_fine_grained_hits
        # The first full-attention group: the one whose prompt tail a final flush stores.
        self.tail_group = config.first_full_attention_group
        # Spec groups (block size, window, chunk, Mamba, group ids): full attention first;
        # one group list empty when every group is full attention (looked up together, the
        # fast path).
        specs: dict[tuple[int | None, int | None, bool, int], list[int]] = {}
        for g, size in enumerate(self.sizes):
            kind = (config.window(g), config.chunk(g), config.is_mamba(g), size)
            specs.setdefault(kind, []).append(g)
        ordered = sorted(specs.items(), key=lambda item: item[0][:3] != (None, None, False))
        self.specs: list[tuple[int, int | None, int | None, bool, list[int]]] = [
            (size, window, chunk, mamba, groups) for (window, chunk, mamba, size), groups in ordered
        ]
        if all(config.full_attention(g) for g in range(len(self.sizes))):
            self.specs = [(0, None, None, False, [])]
        self.simple_hybrid = len(self.specs) == 2 and self.specs[0][1:4] == (None, None, False)
        # Groups whose blocks leave the table (a sliding window's, a chunked local group's,
        # a Mamba group's).
        self.local = [not config.full_attention(g) for g in range(len(self.sizes))]
        # Mamba groups: not scanned (their states come by hand-offs).
        self.mamba = [config.is_mamba(g) for g in range(len(self.sizes))]
        # The longest hit one kind of group found in the last hybrid lookup (past the
        # common hit where a group caches a longer prefix: a Mamba prefill's junction).
        self.longest = 0
        self.chunks = [c for g in range(len(self.sizes)) if (c := config.chunk(g)) is not None]
        self.gpu = gpu
        self.cpu = Pool(config.cpu_blocks, "cpu")
        if config.kv_events:
            self.cpu.events = []
        self.workers = config.world_size
        self.loads: dict[str, Load] = {}
        self.abandoned_loads: dict[str, Load] = {}
        self.load_events: dict[int, list[str]] = {}
        self.hits: dict[str, Hit] = {}
        self.stores: dict[int, Copy] = {}
        self.abandoned_stores: dict[int, Copy] = {}
        self.store_reqs: dict[int, list[str]] = {}
        self.trackers: dict[str, Tracker] = {}
        self.in_flight: set[int] = set()
        self.flushes: list[Copy] = []
        self.next_store_event = 0
        self.next_load_event = 0
        self.partial: dict[int, int] = {}
        self.failed: set[int] = set()  # store events a worker reported failed
        self.loaded_since_drain = 0  # GPU blocks of sent loads completed since the stats
        self.outcomes: dict[str, int] = {}  # boundary hand-offs per outcome, since then too
        # CPU block ids -> those whose bytes fail their checksum; the driver gives the
        # workers' check (the scheduler alone holds no bytes: nothing is ever damaged).
        self.integrity_check: Callable[[list[int]], set[int]] = lambda ids: set()

    # -- lookup and load ------------------------------------------------------------------

    def longest_hit(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        start_tokens: int,
        limit: int,
        skip: Container[int] = (),
    ) -> tuple[list[list[int]], int]:
        """Per group, the blocks of the longest hit from ``start_tokens`` that every group
        agrees on, and its length (vLLM's hybrid coordinator: full attention first, left to
        right; sliding windows right to left; asked again until no group lowers the hit).
        Blocks in ``skip`` are passed over as if they were not cached."""
        if not self.specs[0][4]:  # full attention only
            return self._full_hit(pool, keys, self.specs[0][4], start_tokens, limit, skip)
        found: list[list[int]] = [[] for _ in self.sizes]
        full_hits: dict[int, int] = {}
        hit = max(limit, 0)
        longest = 0
        while True:
            candidate = hit
            for s, (_, window, chunk, mamba, groups) in enumerate(self.specs):
                full = window is None and chunk is None and not mamba
                if full and s in full_hits:
                    candidate = min(candidate, full_hits[s])
                    continue
                if full:
                    blocks, candidate = self._full_hit(
                        pool, keys, groups, start_tokens, candidate, skip
                    )
                    full_hits[s] = candidate
                elif mamba:
                    blocks, candidate = self._mamba_hit(
                        pool, keys, groups, start_tokens, candidate, skip
                    )
                elif chunk is not None:
                    blocks, candidate = self._chunk_hit(
                        pool, keys, groups, chunk, start_tokens, candidate, skip
                    )
                else:
                    assert window is not None
                    blocks, candidate = self._window_hit(
                        pool, keys, groups, window, start_tokens, candidate, skip
                    )
                for g, group_blocks in zip(groups, blocks, strict=True):
                    found[g] = group_blocks
                longest = max(longest, candidate)
            if candidate >= hit:
                break
            hit = candidate
            if self.simple_hybrid:
                break
        for g, size in enumerate(self.sizes):
            if not self.local[g]:
                del found[g][-(-hit // size) :]
        self.longest = longest
        return found, hit

    def _position(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        groups: list[int],
        i: int,
        skip: Container[int],
    ) -> list[int] | None:
        """The blocks of absolute position ``i`` in every group of a spec, or None."""
        found: list[int] = []
        for g in groups:
            if i >= len(keys[g]):
                return None
            block = pool.find(keys[g][i], skip) if skip or pool.dups else pool.index.get(keys[g][i])
            if block is None:
                return None
            found.append(block)
        return found

    def _full_hit(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        groups: list[int],
        start_tokens: int,
        limit: int,
        skip: Container[int],
    ) -> tuple[list[list[int]], int]:
        """Full attention: the run of cached blocks from the start, aligned down. Without
        ``groups`` (the full-attention-only layout), every group at once."""
        groups = groups or list(range(len(self.sizes)))
        runs: list[list[int]] = [[] for _ in groups]
        hit = limit
        for k, g in enumerate(groups):
            size = self.sizes[g]
            first = start_tokens // size
            index, run = pool.index, runs[k]
            if skip or pool.dups:
                for key in keys[g][first : first + limit // size]:
                    block = pool.find(key, skip)
                    if block is None:
                        break
                    run.append(block)
            else:  # one holder per key: the index alone answers
                for key in keys[g][first : first + limit // size]:
                    block = index.get(key)
                    if block is None:
                        break
                    run.append(block)
            reach = len(run) * size
            hit = min(hit, reach - reach % self.align)
        hit = max(hit, 0)
        return [run[: -(-hit // self.sizes[g])] for run, g in zip(runs, groups, strict=True)], hit

    def _window_hit(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        groups: list[int],
        window: int,
        start_tokens: int,
        limit: int,
        skip: Container[int],
    ) -> tuple[list[list[int]], int]:
        """A sliding window: from the end of ``limit`` back to the first run of
        ``window_run`` cached blocks ending on an aligned boundary; nulls before it."""
        size = self.sizes[groups[0]]
        need = window_run(window, size)
        first = start_tokens // size
        count = limit // size
        blocks = [[NULL] * count for _ in groups]
        run = 0
        for i in range(count - 1, -1, -1):
            found = self._position(pool, keys, groups, first + i, skip)
            if found is None:
                run = 0
                continue
            if run == 0 and size != self.align and (i + 1) * size % self.align:
                continue
            for group_blocks, block in zip(blocks, found, strict=True):
                group_blocks[i] = block
            run += 1
            if run >= need:
                return [b[: i + run] for b in blocks], (i + run) * size
        blocks = [b[:run] for b in blocks]
        while size != self.align and len(blocks[0]) * size % self.align:
            blocks = [b[:-1] for b in blocks]
        return blocks, len(blocks[0]) * size

    def _chunk_hit(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        groups: list[int],
        chunk: int,
        start_tokens: int,
        limit: int,
        skip: Container[int],
    ) -> tuple[list[list[int]], int]:
        """Chunked local attention: nulls for the chunks before the one ``limit`` ends in
        (counted from ``start_tokens``), then that chunk's cached blocks up to a miss."""
        size = self.sizes[groups[0]]
        first = start_tokens // size
        start = limit // chunk * chunk // size
        blocks = [[NULL] * start for _ in groups]
        for i in range(start, limit // size):
            found = self._position(pool, keys, groups, first + i, skip)
            if found is None:
                break
            for group_blocks, block in zip(blocks, found, strict=True):
                group_blocks.append(block)
        return blocks, len(blocks[0]) * size

    def _mamba_hit(
        self,
        pool: Pool,
        keys: Sequence[Sequence[str]],
        groups: list[int],
        start_tokens: int,
        limit: int,
        skip: Container[int],
    ) -> tuple[list[list[int]], int]:
        """Mamba (align mode): the last cached state below ``limit`` that ends on an
        aligned boundary; nulls before it."""
        size = self.sizes[groups[0]]
        first = start_tokens // size
        for i in range(limit // size - 1, -1, -1):
            if (i + 1) * size % self.align:
                continue
            found = self._position(pool, keys, groups, first + i, skip)
            if found is not None:
                return [[NULL] * i + [block] for block in found], (i + 1) * size
        return [[] for _ in groups], 0

    def match(self, request: ImplRequest, computed: int) -> tuple[int, bool]:
        stale = self.hits.pop(request.request_id, None)
        if stale is not None:
            self.unpin_hit(stale)
        if not self.reads_for(request):
            return 0, False
        limit = request.num_tokens - 1 - computed
        if computed % self.align or not self.starts_on_chunk_boundary(computed):
            return 0, False
        if len(request.digests) * self.hbs <= computed or limit <= 0:
            return 0, False
        blocks, hit = self.intact_hit(request.block_keys(), computed, limit)
        if hit <= 0:
            return 0, False
        self.pin_hit(blocks)
        self.hits[request.request_id] = Hit(blocks, hit, computed)
        return hit, True

    def starts_on_chunk_boundary(self, computed: int) -> bool:
        """A CPU hit follows a local prefix of whole chunks only: the lookup counts the
        chunks from its own start (vLLM 0.33.0, S24)."""
        return all(computed % chunk == 0 for chunk in self.chunks)

    def reads_for(self, request: ImplRequest) -> bool:
        """No CPU hit for a request that skips reading the prefix cache: prompt logprobs
        need every prompt token computed (PR #54998)."""
        return not request.skip_reading_prefix_cache

    def intact_hit(
        self, keys: Sequence[Sequence[str]], start: int, limit: int
    ) -> tuple[list[list[int]], int]:
        """The longest CPU hit whose blocks pass the integrity check: a damaged block is
        evicted (its keys dropped, its queue place kept) and the lookup made again."""
        while True:
            blocks, hit = self.longest_hit(self.cpu, keys, start, limit)
            damaged = self.verify(blocks)
            if not damaged:
                return blocks, hit
            for block in damaged:
                self.cpu.drop_keys(block)

    def lookup(self, keys: Sequence[Sequence[str]], limit: int) -> int:
        """The hit a request would get now, read-only: what ``intact_hit`` would find,
        passing over damaged blocks instead of evicting them."""
        damaged: set[int] = set()
        while True:
            blocks, hit = self.longest_hit(self.cpu, keys, 0, limit, damaged)
            found = self.verify(blocks)
            if not found:
                return hit
            damaged.update(found)

    def verify(self, blocks: list[list[int]]) -> list[int]:
        """The hit blocks whose bytes fail their checksum on some worker."""
        candidates = [b for group in blocks for b in group if b != NULL]
        bad = self.integrity_check(candidates)
        return [b for b in candidates if b in bad] if bad else []

    def pin_hit(self, blocks: list[list[int]]) -> None:
        self.cpu.pin(b for group in blocks for b in group if b != NULL)

    def unpin_hit(self, hit: Hit) -> None:
        self.cpu.release(b for group in hit.blocks for b in group if b != NULL)

    def after_alloc(
        self, request: ImplRequest, tables: tuple[list[int], ...], external: int
    ) -> None:
        rid = request.request_id
        if not self.lazy and rid not in self.trackers:  # eager stores follow requests
            self.trackers[rid] = Tracker(request, tuple([] for _ in tables), [0] * len(tables))
        hit = self.hits.pop(rid, None)
        if hit is None:
            return
        if external == 0:
            self.unpin_hit(hit)
            return
        gpu: list[int] = []
        cpu: list[int] = []
        for table, blocks, size in zip(tables, hit.blocks, self.sizes, strict=True):
            base = hit.start // size
            taken = blocks[: -(-external // size)]
            if NULL not in taken:  # every position loads: the table's run, as it is
                gpu += table[base : base + len(taken)]
                cpu += taken
                continue
            for i, block in enumerate(taken):
                if block != NULL:  # a sliding window's position before its run
                    gpu.append(table[base + i])
                    cpu.append(block)
        if cpu != [b for group in hit.blocks for b in group if b != NULL]:
            self.cpu.pin(cpu)
            self.unpin_hit(hit)
        # else the load takes the whole hit: its pins become the load's (pin, then unpin)
        self.gpu.pin(gpu)
        self.loads[rid] = Load(rid, Copy(gpu, cpu))

    # -- stores ---------------------------------------------------------------------------

    def build_meta(
        self,
        scheduled: list[Scheduled],
        preempted: Sequence[str] = (),
        offers: Sequence[Offer] = (),
    ) -> ConnectorMetadata:
        """``scheduled``: (request id, new block ids per group, tokens scheduled), new and
        resumed requests first, as vLLM's ``yield_req_data``; ``preempted``: the requests
        preempted this step; ``offers``: the step's boundary-state hand-offs."""
        gpu: list[int] = []
        cpu: list[int] = []
        reqs: list[str] = []
        # what eager stores captured for their kv-cache events (lazy ones capture nothing)
        meta: list[dict[str, Meta]] | None = (
            [] if self.cpu.events is not None and not self.lazy else None
        )
        if self.lazy:
            gpu = self.select_lazy()
            cpu = self.reserve(gpu)
            self.gpu.pin(gpu)
        if not self.lazy:
            if offers:
                self.store_states(offers, preempted, gpu, cpu, reqs, meta)
            for rid in preempted:  # their blocks are gone: tables and cursors start over
                self.forget_table(rid)
        for rid, new_ids, num_tokens in scheduled:
            tracker = self.trackers.get(rid)
            if tracker is None or tracker.finished:
                continue
            for table, ids in zip(tracker.tables, new_ids, strict=True):
                table.extend(ids)
            if num_tokens == 0:
                continue
            picked, advanced, _ = self.select(tracker, tracker.tables)
            if picked:
                if meta is not None:
                    meta += self.meta_of(tracker, tracker.tables, picked)
                gpu += picked
                cpu += self.reserve(picked)
                reqs.append(rid)
                self.in_flight.update(picked)
                self.gpu.pin(picked)
            for g, n in enumerate(advanced):
                tracker.cursors[g] += n
        for flush in self.flushes:
            gpu += flush.gpu
            cpu += flush.cpu
            if meta is not None and flush.meta is not None:
                meta += flush.meta
        self.flushes = []
        store_event = NO_EVENT
        if gpu:
            store_event = self.next_store_event
            self.next_store_event += 1
            self.stores[store_event] = Copy(gpu, cpu, meta)
            reqs = list(dict.fromkeys(reqs))  # a hand-off and a scan of one request
            if reqs:
                self.store_reqs[store_event] = reqs
                for rid in reqs:
                    self.trackers[rid].events.add(store_event)
        load_gpu: list[int] = []
        load_cpu: list[int] = []
        load_reqs = [rid for rid, load in self.loads.items() if load.event is None]
        load_event = NO_EVENT
        if load_reqs:
            load_event = self.next_load_event
            self.next_load_event += 1
            for rid in load_reqs:
                load = self.loads[rid]
                load.event = load_event
                load_gpu += load.copy.gpu
                load_cpu += load.copy.cpu
            self.load_events[load_event] = load_reqs
        return ConnectorMetadata(
            store_event,
            tuple(gpu),
            tuple(cpu),
            load_event,
            tuple(load_gpu),
            tuple(load_cpu),
            {e: tuple(r) for e, r in self.load_events.items()},
        )

    def store_states(
        self,
        offers: Sequence[Offer],
        preempted: Sequence[str],
        gpu: list[int],
        cpu: list[int],
        reqs: list[str],
        meta: list[dict[str, Meta]] | None,
    ) -> None:
        """Store the step's boundary-state hand-offs (Mamba states just cached), each
        counted by outcome; none of a request finished, preempted or not tracked (its blocks
        may be another's now)."""
        key, in_flight, index = self.gpu.key, self.in_flight, self.cpu.index
        outcomes = self.outcomes
        for rid, block in offers:
            tracker = self.trackers.get(rid)
            if tracker is None or tracker.finished or rid in preempted:
                outcome = "dropped_request_gone"
            elif block == NULL:
                outcome = "dropped_null_block"
            elif key[block] is None:
                outcome = "dropped_not_hashed"
            elif block in in_flight:
                outcome = "skipped_in_flight"
            elif key[block] in index:
                outcome = "skipped_already_cached"
            elif not self.cpu.num_free:
                outcome = "dropped_cpu_full"
            else:
                outcome = "stored"
                gpu.append(block)
                cpu += self.reserve([block])
                reqs.append(rid)
                if meta is not None:
                    meta.append({})  # its keys are the block's own: nothing captured
                in_flight.add(block)
                self.gpu.pin([block])
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    def forget_table(self, rid: str) -> None:
        """A preempted request's tracker: no table, cursors at 0."""
        tracker = self.trackers.get(rid)
        if tracker is not None:
            for table in tracker.tables:
                table.clear()
            tracker.cursors[:] = [0] * len(tracker.tables)

    def select_lazy(self) -> list[int]:
        """Lazy mode: the keyed GPU blocks nearest eviction (the free queue from its front,
        ``lazy_target_free`` blocks at most) whose key the CPU does not hold, as many as the
        CPU has free blocks."""
        room, key, index = self.cpu.num_free, self.gpu.key, self.cpu.index
        picked: list[int] = []
        for covered, block in enumerate(self.lazy_queue()):
            if covered >= self.lazy_target or len(picked) >= room:
                break
            self.visited(block)
            k = key[block]
            if k is not None and k not in index:
                picked.append(block)
        return picked

    def lazy_queue(self) -> Iterable[int]:
        """Where the lazy scan walks: the GPU free queue from its front."""
        return iter(self.gpu.free)

    def visited(self, block: int) -> None:
        """A block the lazy scan looked at (kept by nothing here)."""

    def storable(self, window: Sequence[int]) -> list[int]:
        """The skip rules, over a window of a block table: the blocks that are not null,
        are keyed, are not in flight, and whose key is not in the CPU index."""
        key, in_flight, index = self.gpu.key, self.in_flight, self.cpu.index
        # (the null block is block 0: ``b`` is false for it alone; each key read once)
        return [
            b
            for b in window
            if b and (k := key[b]) is not None and k not in index and b not in in_flight
        ]

    def cacheable(self, num_computed: int) -> int:
        """The computed tokens a scan may store the blocks of: whole scheduler blocks, or
        all of them with fine-grained CPU hits (a hit may then end on any hash boundary)."""
        if self.fine:
            return num_computed
        return num_computed // self.align * self.align

    def ready(self, group: int, confirmed: int, table_len: int) -> int:
        """How far the scan of ``group`` may reach: the blocks ``confirmed`` (aligned) tokens
        fill, at most the table."""
        return min(table_len, confirmed // self.sizes[group])

    def select(
        self, tracker: Tracker, tables: tuple[list[int], ...]
    ) -> tuple[list[int], list[int], bool]:
        """Blocks to store from each cursor up to the confirmed tokens; cursor advances;
        whether selection stopped for lack of CPU blocks. A block that is skipped is passed
        (its cursor advances); selection stops at the first storable block with no room."""
        confirmed = self.cacheable(tracker.request.num_computed_tokens)
        room = self.cpu.num_free
        picked: list[int] = []
        advanced = [0] * len(tables)
        for g, table in enumerate(tables):
            if len(picked) >= room:
                return picked, advanced, True
            if self.mamba[g]:
                continue
            start = tracker.cursors[g]
            window = table[start : self.ready(g, confirmed, len(table))]
            if self.local[g]:
                window = self.window_of(tracker.request, g, start, window)
            found = self.storable(window)
            left = room - len(picked)
            if len(found) <= left:
                picked += found
                advanced[g] = len(window)
                continue
            picked += found[:left]
            advanced[g] = window.index(found[left])
            return picked, advanced, True
        return picked, advanced, False

    def meta_of(
        self, tracker: Tracker, tables: tuple[list[int], ...], picked: list[int]
    ) -> list[dict[str, Meta]]:
        """For each picked block, what its position covers in the request, under the
        block's primary and the request's fine-grained keys inside it (vLLM's
        ``BlockStoreMeta``); positions found again from the cursors, as ``select`` saw them."""
        request = tracker.request
        confirmed = self.cacheable(request.num_computed_tokens)
        where: dict[int, tuple[int, int]] = {}
        for g, table in enumerate(tables):
            if self.mamba[g]:
                continue
            start = tracker.cursors[g]
            window = table[start : self.ready(g, confirmed, len(table))]
            if self.local[g]:
                window = self.window_of(request, g, start, window)
            for i, block in enumerate(window):
                where.setdefault(block, (g, start + i))
        return [self.block_meta(request, *where[block], block) for block in picked]

    def block_meta(
        self, request: ImplRequest, group: int, index: int, block: int
    ) -> dict[str, Meta]:
        size, hbs = self.sizes[group], self.hbs
        per = size // hbs
        digests, tokens = request.digests, request.tokens
        start = index * size
        primary = self.gpu.key[block]
        assert primary is not None, f"selected gpu block {block} has no key"
        parent = None if index == 0 else digests[index * per - 1]
        # The primary's size is 0, as vLLM's BlockStoreMeta names none (model: _store_meta).
        meta = {primary: (parent, tuple(tokens[start : start + size]), 0)}
        for j in range(start // hbs, (start + size) // hbs):
            key = request.fine_key(j, group)
            if key != primary:
                before = None if j == 0 else digests[j - 1]
                meta[key] = (before, tuple(tokens[j * hbs : (j + 1) * hbs]), hbs)
        return meta

    def window_of(
        self, request: ImplRequest, group: int, start: int, window: list[int]
    ) -> list[int]:
        """What the scan of a sliding-window group considers from its cursor: the table's
        blocks, except where a block left the window (the null block, or a block the window
        freed and another position reused: it holds another key), which are replaced by the
        GPU block cached under the position's key, where there is one (vLLM 0.30.0)."""
        keys = request.block_keys()[group]
        held = self.gpu.key
        out: list[int] = []
        for i, block in enumerate(window):
            key = keys[start + i] if start + i < len(keys) else None
            if block != NULL and not self.reused(held[block], key):
                out.append(block)
            else:
                out.append(NULL if key is None else self.recover(key))
        return out

    def reused(self, held: str | None, key: str | None) -> bool:
        """Whether a window block holding ``held`` was reused by another position."""
        return held is not None and held != key

    def recover(self, key: str) -> int:
        """The GPU block cached under ``key``, or the null block."""
        return self.gpu.find(key) or NULL

    def reserve(self, picked: list[int]) -> list[int]:
        """CPU destinations for ``picked``: fresh, unkeyed, unreachable until completion."""
        return self.cpu.allocate(len(picked))

    def queue_final_flush(self, request: ImplRequest, tables: tuple[list[int], ...]) -> Copy | None:
        """PR #53532: at finish, queue the confirmed blocks no scan has reached."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            return None
        picked, _, _ = self.select(tracker, tables)
        tail = self.prompt_tail(request, tables)
        tail_taken = (
            tail is not None
            and self.tail_unpicked(tail, picked)
            and len(picked) < self.cpu.num_free
        )
        if tail_taken:
            assert tail is not None
            picked.append(tail)
        if not picked:
            return None
        meta = None
        if self.cpu.events is not None:
            scanned = picked[:-1] if tail_taken else picked
            meta = self.meta_of(tracker, tables, scanned) + ([{}] if tail_taken else [])
        flush = Copy(picked, self.reserve(picked), meta)
        self.flushes.append(flush)
        self.in_flight.update(picked)
        self.gpu.pin(picked)
        return flush

    def tail_unpicked(self, tail: int, picked: list[int]) -> bool:
        """Whether the final flush's scan left the prompt tail's block out: one CPU block
        per GPU block (a decode that filled the tail's block made it the scan's)."""
        return tail not in picked

    def tail_boundary(self, request: ImplRequest) -> int:
        """The last hash boundary of the prompt a resend can hit (its last token is
        recomputed), at most the request's hashed tokens (a fault moves it)."""
        return request.tail_boundary()

    def prompt_tail(self, request: ImplRequest, tables: tuple[list[int], ...]) -> int | None:
        """With fine-grained CPU hits, the GPU block of the first full-attention group that
        holds the prompt's tail key inside it (the last hash boundary a resend can hit),
        when the CPU pool lacks that key and no store of the block is in flight (vLLM
        0.34.0's ``_find_fa_partial_tail_source``)."""
        if not self.fine:
            return None
        g, hbs = self.tail_group, self.hbs
        size = self.sizes[g]
        boundary = self.tail_boundary(request)
        if not 0 < boundary <= request.num_computed_tokens or boundary % size == 0:
            return None
        table = tables[g]
        if boundary // size >= len(table):
            return None
        block = table[boundary // size]
        if block == NULL or block in self.in_flight:
            return None
        key = request.fine_key(boundary // hbs - 1, g)
        if self.gpu.key[block] != key and not self.gpu.has(key, block):
            return None
        return None if self.cpu.find(key) is not None else block

    # -- completions ----------------------------------------------------------------------

    def report(
        self,
        finished_loads: set[str],
        stores: dict[int, int],
        failed: frozenset[int] = frozenset(),
    ) -> None:
        for rid in sorted(finished_loads):
            self.loaded_since_drain += self.drop_load(rid)
        self.failed |= failed
        for event, count in stores.items():
            self.count_store(event, count)

    def count_store(self, event: int, count: int) -> None:
        total = self.partial.pop(event, 0) + count
        if total < self.workers:
            self.partial[event] = total
        else:
            self.store_done(event)

    def store_done(self, event: int) -> None:
        failed = event in self.failed
        self.failed.discard(event)
        copy = self.stores.pop(event, None)
        if copy is None:
            abandoned = self.abandoned_stores.pop(event, None)
            if abandoned is not None:
                self.forget(abandoned)
            return
        self.in_flight.difference_update(copy.gpu)
        if failed:
            self.forget(copy)  # a worker's copy failed: nothing of it becomes reachable
        else:
            self.publish(copy)
            self.cpu.release(copy.cpu)
            # A lazy store's blocks came from the GPU's eviction end: back there, now that
            # the CPU holds them (vLLM 0.34.0).
            self.return_gpu_blocks(copy.gpu)
        for rid in self.store_reqs.pop(event, []):
            tracker = self.trackers.get(rid)
            if tracker is not None:
                tracker.events.discard(event)
                if tracker.finished and not tracker.events:
                    self.untrack(rid)

    def return_gpu_blocks(self, blocks: list[int]) -> None:
        self.gpu.release(blocks, evict_first=self.lazy)

    def publish(self, copy: Copy) -> None:
        """Register every key of each source on its copy: the primary first, with its token
        count, so that it stays the primary; then the secondary keys. With kv-cache events,
        a ``stored`` event for each, with what the selection captured for that key."""
        gpu, cpu = self.gpu, self.cpu
        extra, keys, tokens = gpu.extra_keys, gpu.key, gpu.key_tokens
        events = cpu.events
        if events is None and not extra:  # primaries only, nothing published: in a batch
            cpu.register_all([keys[b] for b in copy.gpu], copy.cpu, [tokens[b] for b in copy.gpu])
            return
        for i, (gpu_block, cpu_block) in enumerate(zip(copy.gpu, copy.cpu, strict=True)):
            key = keys[gpu_block]
            assert key is not None, f"stored gpu block {gpu_block} lost its key"
            cpu.register(key, cpu_block, tokens[gpu_block])
            secondaries = extra.get(gpu_block, ()) if extra else ()
            for secondary in secondaries:
                cpu.register(secondary, cpu_block, None)
            if events is not None:
                captured = copy.meta[i] if copy.meta is not None else {}
                primary = block_key(key)
                size = self.sizes[primary.group]
                parent, token_ids, _ = captured.get(key, (None, (), size))
                if len(token_ids) != size:  # captured at another size: nothing
                    parent, token_ids = None, ()
                events.append(KVEvent(STORED, primary, parent, token_ids, size))
                for x in secondaries:
                    parent, token_ids, covered = captured.get(x, (None, (), 0))
                    if len(token_ids) != covered:  # captured as a primary: nothing
                        parent, token_ids = None, ()
                    events.append(KVEvent(STORED, block_key(x), parent, token_ids, covered))

    def take_events(self) -> list[KVEvent]:
        """The kv-cache events since the last call (vLLM's ``take_events``)."""
        events = self.cpu.events
        if events is None:
            return []
        self.cpu.events = []
        return events

    def forget(self, copy: Copy) -> None:
        """Drop a transfer's pins; its data never becomes reachable."""
        self.cpu.release(copy.cpu)
        self.gpu.release(copy.gpu)

    def pending(self) -> bool:
        return bool(self.flushes or self.stores or self.abandoned_stores)

    # -- finish ---------------------------------------------------------------------------

    def finished(self, request: ImplRequest, tables: tuple[list[int], ...]) -> Copy | None:
        flush = self.queue_final_flush(request, tables)
        rid = request.request_id
        hit = self.hits.pop(rid, None)
        if hit is not None:
            self.unpin_hit(hit)
        load = self.loads.get(rid)
        if load is not None:
            if load.event is None:
                self.drop_load(rid)
            else:
                load.finished = True
        tracker = self.trackers.get(rid)
        if tracker is not None:
            if tracker.events:
                tracker.finished = True
            else:
                self.untrack(rid)
        return flush

    def drop_load(self, rid: str) -> int:
        """Release a request's load; the GPU blocks it copied if it was sent, else 0."""
        load = self.loads.pop(rid, None) or self.abandoned_loads.pop(rid, None)
        if load is None:
            return 0
        if load.event is not None:
            reqs = self.load_events.get(load.event)
            if reqs is not None:
                if rid in reqs:
                    reqs.remove(rid)
                if not reqs:
                    del self.load_events[load.event]
        self.cpu.release(load.copy.cpu)
        self.gpu.release(load.copy.gpu)
        return 0 if load.event is None else len(load.copy.gpu)

    def stats(self) -> OffloadStats:
        """Drain the stats (vLLM's ``get_stats``): the load count starts over."""
        copies = itertools.chain(self.stores.values(), self.flushes, self.abandoned_stores.values())
        report = OffloadStats(
            load_blocks=self.loaded_since_drain,
            used_blocks=self.cpu.num_blocks - self.cpu.num_free,
            pending_store_blocks=sum(len(c.cpu) for c in copies),
            capacity_blocks=self.cpu.num_blocks,
            lazy=self.lazy,
            save_outcomes=tuple(sorted(self.outcomes.items())),
        )
        self.loaded_since_drain = 0
        self.outcomes = {}
        return report

    def untrack(self, rid: str) -> None:
        tracker = self.trackers.pop(rid, None)
        if tracker is None:
            return
        for event in tracker.events:
            reqs = self.store_reqs.get(event)
            if reqs is not None:
                if rid in reqs:
                    reqs.remove(rid)
                if not reqs:
                    del self.store_reqs[event]
        tracker.events.clear()

    # -- reset ----------------------------------------------------------------------------

    def reset(self) -> bool:
        self.abandoned_stores.update(self.stores)
        self.release_flushes()
        self.stores = {}
        self.in_flight = set()
        for rid in list(self.loads):
            if self.loads[rid].event is None:
                self.drop_load(rid)
            else:
                self.abandoned_loads[rid] = self.loads.pop(rid)
        self.trackers = {}
        self.store_reqs = {}
        self.partial = {e: n for e, n in self.partial.items() if e in self.abandoned_stores}
        if self.abandoned_stores or self.abandoned_loads:
            return False
        return self.cpu.clear_cache()

    def serves_nothing(self) -> bool:
        """Whether the CPU tier holds no key (a prefix-cache reset that leaves the connector
        alone reports success only then: vLLM issue #57727)."""
        return not self.cpu.index

    def release_flushes(self) -> None:
        """PR #53532: flushes that were never sent are released at reset."""
        for flush in self.flushes:
            self.forget(flush)
        self.flushes = []
