"""The implementation's engine: requests, GPU block tables, GPU prefix hits, the step.

Same semantics as the model's engine (``docs/spec.md``), with incremental per-request key
lists instead of recomputation, block ids and key strings (:mod:`kvoffload.impl.pool`)
instead of objects, and KV writes delegated to the workers.

A prefix-cache reset that preempts the running requests (``reset_prefix_cache`` with
``reset_running``) preempts them from the last, as a step's preemption does, and the next
step tells the connector of them with the step's own preempted requests (vLLM's
``preempted_req_ids``); until then their trackers name the blocks the reset freed. A reset
whose preemption could not free every block in use (a load's, a transfer's) is refused by
the driver before it reaches here (``blocks_kept_from_reset``).

Invariants kept: REF-GPU, REF-CPU, KEYS, MAMBA.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

from kvoffload.impl.connector import Connector, Copy, Scheduled
from kvoffload.impl.pool import NULL, Pool, make_key
from kvoffload.model.arith import mamba_chunk, reachable
from kvoffload.model.keys import chain_digest

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig

DECODE_ALPHABET = 4


class Status(StrEnum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class ImplRequest:
    """A request with its tokens, chained digests and per-group block keys."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        config: OffloadConfig,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.skip_reading_prefix_cache = skip_reading_prefix_cache  # reads no cache hit
        self.tokens = list(prompt)
        self.token_sum = sum(self.tokens)  # the decoded token is a function of it
        self.num_prompt = len(self.tokens)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.junction = 0  # a prefix some group caches past the common hit, or 0
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.hbs = config.hash_block_size
        self.sizes = config.group_block_sizes
        self.digests: list[str] = []
        self._keys: list[list[str]] = [[] for _ in self.sizes]
        self._hash_new_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.token_sum += token
        self._hash_new_blocks()

    def next_token(self) -> int:
        """The token decoded after the tokens so far (the model's ``greedy_token``)."""
        return self.token_sum % DECODE_ALPHABET

    def _hash_new_blocks(self) -> None:
        hbs = self.hbs
        while (len(self.digests) + 1) * hbs <= len(self.tokens):
            j = len(self.digests)
            parent = self.digests[-1] if self.digests else "0" * 16
            self.digests.append(chain_digest(parent, self.tokens[j * hbs : (j + 1) * hbs]))
            for g, size in enumerate(self.sizes):
                if ((j + 1) * hbs) % size == 0:
                    self._keys[g].append(make_key(g, (j + 1) * hbs, self.digests[j]))

    def block_keys(self) -> list[list[str]]:
        """Per group, the key of every full block so far."""
        return self._keys

    def fine_key(self, j: int, group: int) -> str:
        """The key of the prefix of hash blocks ``0..j`` in ``group``."""
        return make_key(group, (j + 1) * self.hbs, self.digests[j])

    def tail_boundary(self) -> int:
        """With fine-grained CPU hits (vLLM 0.33.0 on), the last hash boundary of the prompt
        a resend can hit: its last token is recomputed, and the boundary is at most the
        tokens hashed so far."""
        return min((self.num_prompt - 1) // self.hbs, len(self.digests)) * self.hbs


class ImplEngine:
    def __init__(self, config: OffloadConfig, connector_cls: type[Connector] = Connector) -> None:
        self.config = config
        self.sizes = config.group_block_sizes
        self.gpu = Pool(config.gpu_blocks, "gpu")
        self.connector = connector_cls(config, self.gpu)
        self.requests: dict[str, ImplRequest] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.tables: dict[str, list[list[int]]] = {}
        self.cached: dict[str, list[int]] = {}
        self.loaded: set[str] = set()
        self.free_after_load: set[str] = set()
        self.mamba = [config.is_mamba(g) for g in range(len(self.sizes))]
        self.mamba_groups = [g for g, m in enumerate(self.mamba) if m]
        # Mamba: the step's boundary-state hand-offs (request, block), and the keys of the
        # states cached in this step (a hit on one waits for the next step).
        self.offers: list[tuple[str, int]] = []
        self.cached_this_step: set[str] = set()
        # The requests a prefix-cache reset preempted, for the next step's connector input.
        self.reset_preempted: list[str] = []

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.requests[request_id] = ImplRequest(
            request_id, prompt, max_tokens, self.config, skip_reading_prefix_cache
        )
        self.waiting.append(request_id)

    def table(self, rid: str) -> list[list[int]]:
        return self.tables.get(rid) or [[] for _ in self.sizes]

    def step(
        self, budget: int
    ) -> tuple[dict[str, tuple[int, int]], list[str], list[Scheduled], list[str]]:
        """Schedule one step: (token ranges, requests now loading, connector input,
        requests preempted)."""
        ranges: dict[str, tuple[int, int]] = {}
        new: list[Scheduled] = []
        cached: list[Scheduled] = []
        loading: list[str] = []
        preempted: list[str] = []
        if self.mamba_groups:
            self.cached_this_step.clear()
        index = 0
        while index < len(self.running) and budget > 0:
            rid = self.running[index]
            req = self.requests[rid]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.mamba_groups and not (n := self.chunk(req, n, 0)):
                index += 1  # no block-aligned chunk fits: passed over
                continue
            sizes_before = [len(ids) for ids in self.table(rid)]
            ok = self.allocate(req, n)
            while not ok:  # FCFS preemption: the last running request makes room
                victim = self.running.pop()
                self.preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
                ok = self.allocate(req, n)
            if not ok:
                break
            added = tuple(ids[k:] for ids, k in zip(self.tables[rid], sizes_before, strict=True))
            cached.append((rid, added, n))
            ranges[rid] = (req.num_computed_tokens, req.num_computed_tokens + n)
            budget -= n
            index += 1
        for rid in [] if preempted else list(self.waiting):
            if budget <= 0:
                break
            req = self.requests[rid]
            if req.status is Status.WAITING_FOR_REMOTE_KVS:
                if rid not in self.loaded:
                    continue
                self.cache(req, req.num_computed_tokens)
                if req.num_computed_tokens == req.num_tokens:
                    req.num_computed_tokens -= 1
                self.loaded.discard(rid)
                req.status = Status.PREEMPTED if req.num_preemptions else Status.WAITING
            hits: list[list[int]] | None = None
            local = external = 0
            load = False
            if req.num_computed_tokens == 0:
                req.junction = 0
                if not req.skip_reading_prefix_cache:
                    hits, local = self.connector.longest_hit(
                        self.gpu, req.block_keys(), 0, req.num_tokens - 1
                    )
                    if self.connector.longest > local:
                        req.junction = self.connector.longest
                external, load = self.connector.match(req, local)
            start = req.num_computed_tokens + local + external
            n = 0
            if not load:
                n = min(req.num_tokens - start, budget)
                if self.mamba_groups and not (n := self.chunk(req, n, local + external)):
                    break  # no block-aligned chunk fits
            if not self.allocate(req, n, hits, local, external, load):
                break
            self.connector.after_alloc(req, tuple(list(ids) for ids in self.tables[rid]), external)
            if load:
                req.status = Status.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = start
                loading.append(rid)
                continue
            req.num_computed_tokens = start
            self.waiting.remove(rid)
            self.running.append(rid)
            req.status = Status.RUNNING
            new.append((rid, tuple(list(ids) for ids in self.tables[rid]), n))
            ranges[rid] = (start, start + n)
            budget -= n
        return ranges, loading, new + cached, preempted

    def chunk(self, req: ImplRequest, n: int, hit: int) -> int:
        """A Mamba model's prefill chunk, split where states are cached."""
        return mamba_chunk(
            req.num_computed_tokens + hit,
            n,
            max(req.num_prompt, req.num_tokens - 1),
            req.num_tokens,
            self.config.scheduler_block_size,
            req.junction,
        )

    def take_reset_preempted(self) -> list[str]:
        """Drain the requests prefix-cache resets preempted since the last step."""
        taken, self.reset_preempted = self.reset_preempted, []
        return taken

    def reset_prefix_cache(self, reset_connector: bool, reset_running: bool = False) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache``: with ``reset_running`` every running
        request preempted first (from the last, so that they wait in their order); the GPU
        prefix cache cleared if no block is in use, then the connector's reset if asked (even
        when the GPU's was refused). True only if neither tier serves a hit afterwards (vLLM
        issue #57727: without the connector's reset, a CPU tier that holds keys makes it
        False)."""
        while reset_running and self.running:
            victim = self.running.pop()
            self.preempt(victim)
            self.reset_preempted.append(victim)
        gpu = self.gpu.clear_cache()
        if reset_connector:
            return self.connector.reset() and gpu
        return gpu and self.connector.serves_nothing()

    def blocks_kept_from_reset(self) -> list[int]:
        """The GPU blocks in use, in id order, that preempting every running request would
        not free: held by a waiting request's load, a transfer, a request being finished (a
        block's references beyond those of the running requests' tables)."""
        held: dict[int, int] = {}
        for rid in self.running:
            for ids in self.tables.get(rid, []):
                for block in ids:
                    if block != NULL:
                        held[block] = held.get(block, 0) + 1
        ref = self.gpu.ref
        return [b for b in range(NULL + 1, self.gpu.num_blocks) if ref[b] > held.get(b, 0)]

    def preempt(self, rid: str) -> None:
        """Out of the running queue already: blocks freed, back to the waiting queue's front
        with no computed token."""
        req = self.requests[rid]
        self.free_table(rid)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        req.num_computed_tokens = 0
        self.waiting.insert(0, rid)

    def allocate(
        self,
        req: ImplRequest,
        n: int,
        hits: list[list[int]] | None = None,
        local: int = 0,
        external: int = 0,
        delay_cache: bool = False,
    ) -> bool:
        rid = req.request_id
        first = rid not in self.tables
        computed = req.num_computed_tokens + local + external
        if not first:
            self.drop_skipped(rid, computed)
        table = self.table(rid)
        hits = hits or [[] for _ in self.sizes]
        skips = [0 if not first else self.skipped(g, computed) for g in range(len(self.sizes))]
        end = computed + n
        wanted = [-(-end // size) for size in self.sizes]
        need = sum(
            max(0, w - max(k, len(ids) + len(h)))
            for w, ids, h, k in zip(wanted, table, hits, skips, strict=True)
        )
        ref = self.gpu.ref
        need += sum(
            1 for h, k in zip(hits, skips, strict=True) for b in h[k:] if ref[b] == 0 and b != NULL
        )
        for g in self.mamba_groups:
            w, ids, h, k = wanted[g], table[g], hits[g], skips[g]
            if h and req.block_keys()[g][len(h) - 1] in self.cached_this_step:
                return False  # its state is computed by this step's forward
            # One block at most (the running state's), and the hit's state counted even
            # where the external range passes it.
            need += min(1, max(0, w - len(ids) - len(h))) - max(0, w - max(k, len(ids) + len(h)))
            need += sum(1 for b in h[:k] if ref[b] == 0 and b != NULL)
        if need > self.gpu.num_free:
            return False
        if first:
            self.tables[rid] = table
            for ids, h, k in zip(table, hits, skips, strict=True):
                self.gpu.pin(h[k:])
                ids.extend([NULL] * k)
                ids.extend(h[k:])
            self.cached[rid] = [len(ids) for ids in table]
            if external:
                reach = local + external
                for g, (ids, size) in enumerate(zip(table, self.sizes, strict=True)):
                    if reach <= self.config.skipped_tokens(g, reach):
                        continue  # the whole external range left the window or the chunk
                    ids.extend(self.gpu.allocate(max(0, -(-reach // size) - len(ids))))
        for ids, w, m in zip(table, wanted, self.mamba, strict=True):
            if m and w > len(ids):
                ids.extend([NULL] * (w - len(ids) - 1))  # up to the running state's block
            ids.extend(self.gpu.allocate(max(0, w - len(ids))))
        if not delay_cache:
            self.cache(req, min(end, req.num_tokens))
        return True

    def skipped(self, group: int, computed: int) -> int:
        """Leading blocks of ``group`` outside the window (or before the chunk) of
        ``computed`` tokens."""
        return self.config.skipped_tokens(group, computed) // self.sizes[group]

    def drop_skipped(self, rid: str, computed: int) -> None:
        """Free the blocks that left the window or the chunk, nulls in their place."""
        for g, ids in enumerate(self.tables[rid]):
            freed: list[int] = []
            gaps = self.mamba[g]  # a Mamba table has null gaps between its states
            for i in range(min(self.skipped(g, computed), len(ids)) - 1, -1, -1):
                if ids[i] == NULL:
                    if gaps:
                        continue
                    break
                freed.append(ids[i])
                ids[i] = NULL
            if freed:
                self.gpu.release(freed)

    def cache(self, req: ImplRequest, num_tokens: int) -> None:
        hbs = self.config.hash_block_size
        rid = req.request_id
        # with fine-grained hits (vLLM 0.33.0 on), the last boundary a resend can hit
        boundary = (
            req.tail_boundary() if self.config.fine_grained_hits else req.num_prompt // hbs * hbs
        )
        for g, size in enumerate(self.sizes):
            ids = self.tables[rid][g]
            done = self.cached[rid][g]
            full = num_tokens // size
            window = self.config.window(g)
            if full > done:
                keys = req.block_keys()[g]
                if self.mamba[g]:
                    for i in range(done, full):
                        if ids[i] != NULL:
                            self.gpu.register_full([keys[i]], [ids[i]], (i + 1) * size, size)
                            self.offers.append((rid, ids[i]))
                            self.cached_this_step.add(keys[i])
                elif window is None:
                    self.gpu.register_full(keys[done:full], ids[done:full], (done + 1) * size, size)
                else:
                    align = self.config.scheduler_block_size
                    for i in range(done, full):
                        if reachable(i, window, size, align):
                            self.gpu.register_full([keys[i]], [ids[i]], (i + 1) * size, size)
                self.cached[rid][g] = full
            if not self.config.full_attention(g) or size == hbs or boundary == 0:
                continue
            if boundary > num_tokens or boundary % size == 0:
                continue
            if boundary // size < len(ids):
                key = req.fine_key(boundary // hbs - 1, g)
                self.cache_tail(ids[boundary // size], key, boundary)

    def cache_tail(self, block: int, key: str, tokens: int) -> None:
        """A prompt boundary inside a block, ``key`` covering ``tokens`` tokens: primary
        while the block is partial, secondary once it is full."""
        gpu = self.gpu
        known = gpu.key[block] == key or gpu.has(key, block)
        held = gpu.key_tokens[block]
        if not known and held is not None and held < tokens:
            gpu.drop_keys(block)
        gpu.register(key, block, tokens)

    def sample(self, ranges: dict[str, tuple[int, int]]) -> list[str]:
        """Advance computed tokens, sample a token where the prompt is done; finish at
        ``max_tokens``. Returns the finished requests."""
        done: list[str] = []
        for rid, (_, end) in ranges.items():
            req = self.requests[rid]
            req.num_computed_tokens = end
            if end == req.num_tokens:
                req.append(req.next_token())
                if len(req.output) >= req.max_tokens:
                    self.finish(rid)
                    done.append(rid)
        return done

    def finish(self, rid: str) -> Copy | None:
        req = self.requests[rid]
        was_loading = req.status is Status.WAITING_FOR_REMOTE_KVS
        if rid in self.tables and not was_loading:
            self.drop_skipped(rid, req.num_computed_tokens)
        tables = tuple(
            ids[: -(-req.num_computed_tokens // size)]
            for ids, size in zip(self.table(rid), self.sizes, strict=True)
        )
        flush = self.connector.finished(req, tables)
        for queue in (self.running, self.waiting):
            if rid in queue:
                queue.remove(rid)
        req.status = Status.FINISHED
        if was_loading and rid not in self.loaded:
            self.free_after_load.add(rid)
        else:
            self.loaded.discard(rid)
            self.free_table(rid)
        return flush

    def take_offers(self) -> list[tuple[str, int]]:
        """Drain the step's boundary-state hand-offs, grouped by request in the order of
        each one's first."""
        if not self.offers:
            return []
        offers, self.offers = self.offers, []
        order = {rid: i for i, (rid, _) in reversed(list(enumerate(offers)))}
        return sorted(offers, key=lambda offer: order[offer[0]])

    def free_table(self, rid: str) -> None:
        if self.offers:  # its hand-offs not yet offered go: its blocks may be another's
            self.offers = [offer for offer in self.offers if offer[0] != rid]
        for ids in self.tables.pop(rid, []):
            self.gpu.release([b for b in reversed(ids) if b != NULL])
        self.cached.pop(rid, None)

    def loads_done(self, rids: set[str]) -> None:
        self.worker_output(rids, {})

    def worker_output(self, rids: set[str], stores: dict[int, int]) -> None:
        """One output of the workers: the connector's reports (the loads of ``rids``
        finished on every worker, then the stores' counts), then the requests whose loads
        finished."""
        self.connector.report(rids, stores)
        for rid in sorted(rids):
            if self.requests[rid].status is Status.WAITING_FOR_REMOTE_KVS:
                self.loaded.add(rid)
            elif rid in self.free_after_load:
                self.free_after_load.discard(rid)
                self.free_table(rid)
