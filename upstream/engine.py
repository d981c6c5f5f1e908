"""The model's engine (:mod:`kvoffload.model.engine`) around vLLM's own objects.

Scheduling is the model's, step for step: the same admission order, budgets, chunked
prefill, GPU prefix hits, load waits and finish order, so that a difference between the two
runs can only come from what vLLM computes. What vLLM computes is everything the issue puts
under test: the GPU ``BlockPool`` (allocation, ref counts, the free queue, key registration
with ``cache_full_blocks`` and ``cache_partial_block``), and the whole scheduler side of
``SimpleCPUOffloadScheduler`` (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta`` over a real ``SchedulerOutput``, ``update_connector_output``,
``request_finished_all_groups``, ``reset``).

Runs only where vLLM imports (a release environment of :mod:`kvoffload.upstream.install`).

Invariants kept: REF-GPU (each GPU block's ref count is its holders: block tables, stores,
loads), KEYS (a request's computed full blocks carry its keys), as in the model's engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import RequestStatus, greedy_token
from kvoffload.model.keys import BlockKey, prefix_digests
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.types import ConnectorMetadata, StepResult
from kvoffload.upstream.vllm_world import World, keywords, queued_final_flushes


class KeyMap:
    """vLLM's block hashes and the model's keys, both ways.

    vLLM hash ``j`` of a token sequence and the model's digest ``j`` name the same prefix
    (``(j + 1) * hash_block_size`` tokens), so every sequence hashed by both sides adds
    pairs. A key with a group is vLLM's ``hash + group.to_bytes(4, "big")``.
    """

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self._to_model: dict[bytes, tuple[str, int]] = {}
        self._to_vllm: dict[str, bytes] = {}

    def learn(self, tokens: Sequence[int], hashes: Sequence[bytes]) -> None:
        digests = prefix_digests(tokens, self.hash_block_size)
        for j, block_hash in enumerate(hashes):
            if block_hash not in self._to_model:
                self._to_model[bytes(block_hash)] = (digests[j], (j + 1) * self.hash_block_size)
                self._to_vllm[digests[j]] = bytes(block_hash)

    def key(self, vllm_key: bytes) -> BlockKey:
        """The model's key for a vLLM key (hash and group)."""
        digest, num_tokens = self._to_model[bytes(vllm_key[:-4])]
        return BlockKey(int.from_bytes(vllm_key[-4:], "big"), num_tokens, digest)

    def model_key(self, vllm_key: bytes | None) -> BlockKey | None:
        return None if vllm_key is None else self.key(vllm_key)

    def vllm_key(self, key: BlockKey) -> bytes:
        return self._to_vllm[key.digest] + key.group.to_bytes(4, "big")


class _KeyedPool:
    """vLLM's pool seen through model keys, for the model's longest-hit scan."""

    def __init__(self, pool: Any, keys: KeyMap) -> None:
        self.pool = pool
        self.keys = keys

    def get_one_block(self, key: BlockKey) -> Any:
        return self.pool.cached_block_hash_to_block.get_one_block(self.keys.vllm_key(key))


class VllmEngine:
    """The reduced engine core of the model, with vLLM's pool and offload manager."""

    def __init__(self, config: OffloadConfig, world: World) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import Request
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        self._vllm = {
            "SamplingParams": SamplingParams,
            "KVCacheBlocks": KVCacheBlocks,
            "CachedRequestData": CachedRequestData,
            "NewRequestData": NewRequestData,
            "SchedulerOutput": SchedulerOutput,
            "KVConnectorOutput": KVConnectorOutput,
            "Request": Request,
            "WorkerMetadata": SimpleCPUOffloadWorkerMetadata,
        }
        self.config = config
        self.world = world
        self.gpu_pool = world.gpu_pool
        self.connector = world.scheduler
        self.keys = KeyMap(config.hash_block_size)
        self.requests: dict[str, Any] = {}
        self.status: dict[str, RequestStatus] = {}
        self.max_tokens: dict[str, int] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.req_to_blocks: dict[str, list[list[int]]] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.finished_recving: set[str] = set()
        self.delayed_free: set[str] = set()
        self.finished_since_step: set[str] = set()

    # -- requests ---------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Any:
        """A vLLM request hashed by vLLM's block hasher; its hashes join the key map."""
        Request = self._vllm["Request"]
        request = Request(
            **keywords(
                Request,
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling_params=self._vllm["SamplingParams"](max_tokens=max_tokens),
                pooling_params=None,
                block_hasher=self.world.block_hasher,
            )
        )
        self.keys.learn(prompt, request.block_hashes)
        return request

    def add_request(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        self.requests[request_id] = self.make_request(request_id, prompt, max_tokens)
        self.status[request_id] = RequestStatus.WAITING
        self.max_tokens[request_id] = max_tokens
        self.waiting.append(request_id)

    def blocks_of(self, request_id: str) -> list[list[int]]:
        return self.req_to_blocks.get(request_id, [[] for _ in self.config.group_block_sizes])

    def digests_of(self, req: Any) -> list[str]:
        return prefix_digests(req.all_token_ids, self.config.hash_block_size)

    # -- one step (the model's Engine.step over vLLM's objects) -----------------------------

    def step(self, token_budget: int) -> StepResult:
        budget = token_budget
        scheduled: dict[str, tuple[int, int]] = {}
        new_reqs: list[tuple[str, tuple[list[int], ...]]] = []
        cached_reqs: list[tuple[str, tuple[list[int], ...]]] = []
        loading: list[str] = []
        running_blocked = False

        for req_id in self.running:
            if budget <= 0:
                break
            req = self.requests[req_id]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            before = [len(ids) for ids in self.blocks_of(req_id)]
            if not self._allocate_slots(req, num_new):
                running_blocked = True
                break
            after = self.blocks_of(req_id)
            cached_reqs.append(
                (req_id, tuple(list(ids[n:]) for ids, n in zip(after, before, strict=True)))
            )
            scheduled[req_id] = (req.num_computed_tokens, req.num_computed_tokens + num_new)
            budget -= num_new

        for req_id in [] if running_blocked else list(self.waiting):
            if budget <= 0:
                break
            req = self.requests[req_id]
            if self.status[req_id] is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req_id not in self.finished_recving:
                    continue
                self._update_waiting_for_remote_kv(req)
            hit_blocks: tuple[list[Any], ...] | None = None
            local = external = 0
            load_async = False
            if req.num_computed_tokens == 0:
                hit_blocks, local = find_longest_cache_hit(
                    _KeyedPool(self.gpu_pool, self.keys),  # type: ignore[arg-type]
                    self.digests_of(req),
                    0,
                    req.num_tokens - 1,
                    self.config,
                )
                matched, load_async = self.connector.get_num_new_matched_tokens(req, local)
                external = matched or 0
            num_new = (
                0
                if load_async
                else min(req.num_tokens - req.num_computed_tokens - local - external, budget)
            )
            if not self._allocate_slots(req, num_new, hit_blocks, local, external, load_async):
                break
            self.connector.update_state_after_alloc(req, self._kv_cache_blocks(req_id), external)
            if load_async:
                self.status[req_id] = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = local + external
                loading.append(req_id)
                continue
            req.num_computed_tokens += local + external
            self.waiting.remove(req_id)
            self.running.append(req_id)
            self.status[req_id] = RequestStatus.RUNNING
            new_reqs.append((req_id, tuple(list(ids) for ids in self.blocks_of(req_id))))
            scheduled[req_id] = (req.num_computed_tokens, req.num_computed_tokens + num_new)
            budget -= num_new

        output = self._scheduler_output(new_reqs, cached_reqs, scheduled)
        metadata = self.connector.build_connector_meta(output)
        self.finished_since_step = set()
        finished: list[str] = []
        for req_id, (_, end) in scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens = end
            if end == req.num_tokens:
                req.append_output_token_ids(greedy_token(req.all_token_ids))
                self.keys.learn(req.all_token_ids, req.block_hashes)
                if req.num_output_tokens >= self.max_tokens[req_id]:
                    self.finish_request(req_id)
                    finished.append(req_id)
        return StepResult(scheduled, tuple(loading), tuple(finished), _metadata(metadata))

    def _kv_cache_blocks(self, req_id: str) -> Any:
        blocks = self.gpu_pool.blocks
        return self._vllm["KVCacheBlocks"](
            tuple([blocks[i] for i in ids] for ids in self.blocks_of(req_id))
        )

    def _scheduler_output(
        self,
        new_reqs: list[tuple[str, tuple[list[int], ...]]],
        cached_reqs: list[tuple[str, tuple[list[int], ...]]],
        scheduled: dict[str, tuple[int, int]],
    ) -> Any:
        """vLLM's ``SchedulerOutput`` for the step, built from the fields each release has."""
        NewRequestData = self._vllm["NewRequestData"]
        CachedRequestData = self._vllm["CachedRequestData"]
        SchedulerOutput = self._vllm["SchedulerOutput"]
        new_data = []
        for req_id, block_ids in new_reqs:
            req = self.requests[req_id]
            new_data.append(
                NewRequestData(
                    **keywords(
                        NewRequestData,
                        req_id=req_id,
                        prompt_token_ids=req.prompt_token_ids,
                        mm_features=[],
                        sampling_params=req.sampling_params,
                        pooling_params=None,
                        block_ids=block_ids,
                        num_computed_tokens=req.num_computed_tokens,
                        lora_request=None,
                        prefill_token_ids=list(req.all_token_ids),
                    )
                )
            )
        cached_ids = [req_id for req_id, _ in cached_reqs]
        cached_data = CachedRequestData(
            **keywords(
                CachedRequestData,
                req_ids=cached_ids,
                resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached_ids],
                all_token_ids={},
                new_block_ids=[block_ids for _, block_ids in cached_reqs],
                num_computed_tokens=[self.requests[r].num_computed_tokens for r in cached_ids],
                num_output_tokens=[self.requests[r].num_output_tokens for r in cached_ids],
            )
        )
        num_scheduled = {req_id: end - start for req_id, (start, end) in scheduled.items()}
        return SchedulerOutput(
            **keywords(
                SchedulerOutput,
                scheduled_new_reqs=new_data,
                scheduled_cached_reqs=cached_data,
                num_scheduled_tokens=num_scheduled,
                total_num_scheduled_tokens=sum(num_scheduled.values()),
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                num_common_prefix_blocks=[0] * len(self.config.group_block_sizes),
                finished_req_ids=set(self.finished_since_step),
                free_encoder_mm_hashes=[],
                preempted_req_ids=set(),
                kv_connector_block_state=None,
            )
        )

    def _allocate_slots(
        self,
        req: Any,
        num_new: int,
        hit_blocks: tuple[list[Any], ...] | None = None,
        num_local: int = 0,
        num_external: int = 0,
        delay_cache: bool = False,
    ) -> bool:
        """Give ``req`` slots for ``num_new`` more tokens; False when the pool is too small."""
        req_id = req.request_id
        sizes = self.config.group_block_sizes
        pool = self.gpu_pool
        current = self.blocks_of(req_id)
        hits = hit_blocks if hit_blocks is not None else tuple([] for _ in sizes)
        computed = req.num_computed_tokens + num_local + num_external
        need = [
            max(0, math.ceil((computed + num_new) / size) - len(ids) - len(hit))
            for size, ids, hit in zip(sizes, current, hits, strict=True)
        ]
        evictable = sum(1 for hit in hits for b in hit if b.ref_cnt == 0 and not b.is_null)
        if sum(need) + evictable > pool.get_num_free_blocks():
            return False
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = [[b.block_id for b in hit] for hit in hits]
            self.num_cached_blocks[req_id] = [len(hit) for hit in hits]
            for hit in hits:
                pool.touch(hit)
            if num_external:
                for g, size in enumerate(sizes):
                    ids = self.req_to_blocks[req_id][g]
                    n = max(0, math.ceil((num_local + num_external) / size) - len(ids))
                    ids.extend(b.block_id for b in pool.get_new_blocks(n))
        for g, size in enumerate(sizes):
            ids = self.req_to_blocks[req_id][g]
            n = max(0, math.ceil((computed + num_new) / size) - len(ids))
            ids.extend(b.block_id for b in pool.get_new_blocks(n))
        if not delay_cache:
            self.cache_blocks(req, min(computed + num_new, req.num_tokens))
        return True

    def cache_blocks(self, req: Any, num_tokens: int) -> None:
        """vLLM's ``cache_full_blocks`` per group, then ``cache_partial_block`` for the
        prompt's last hash boundary when it falls inside a block (as vLLM's
        ``FullAttentionManager._cache_partial_tail_block`` does)."""
        hbs = self.config.hash_block_size
        pool = self.gpu_pool
        for g, size in enumerate(self.config.group_block_sizes):
            blocks = [pool.blocks[i] for i in self.req_to_blocks[req.request_id][g]]
            cached = self.num_cached_blocks[req.request_id]
            num_full = num_tokens // size
            if num_full > cached[g]:
                pool.cache_full_blocks(req, blocks, cached[g], num_full, size, g)
                cached[g] = num_full
            if size == hbs:
                continue
            boundary = req.num_prompt_tokens // hbs * hbs
            if boundary == 0 or boundary > num_tokens or boundary % size == 0:
                continue
            index = boundary // size
            if index < len(blocks):
                pool.cache_partial_block(req, blocks[index], boundary, g, size)

    def _update_waiting_for_remote_kv(self, req: Any) -> None:
        self.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
        self.finished_recving.discard(req.request_id)
        self.status[req.request_id] = RequestStatus.WAITING

    # -- finish -----------------------------------------------------------------------------

    def finish_request(self, request_id: str) -> tuple[list[int], list[int]] | None:
        """Finish a request: the connector first, then its GPU blocks. Returns the final
        flush it queued (GPU and CPU block ids), read from the manager's queue."""
        req = self.requests[request_id]
        sizes = self.config.group_block_sizes
        block_ids = tuple(
            ids[: math.ceil(req.num_computed_tokens / size)]
            for ids, size in zip(self.blocks_of(request_id), sizes, strict=True)
        )
        queued_before = len(queued_final_flushes(self.connector))
        self.connector.request_finished_all_groups(req, block_ids)
        queue = queued_final_flushes(self.connector)
        flushed = None
        if len(queue) > queued_before:
            flushed = (list(queue[-1].gpu_block_ids), list(queue[-1].cpu_block_ids))
        loading = self.status[request_id] is RequestStatus.WAITING_FOR_REMOTE_KVS
        if request_id in self.running:
            self.running.remove(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        self.status[request_id] = RequestStatus.FINISHED
        self.finished_since_step.add(request_id)
        if loading and request_id not in self.finished_recving:
            self.delayed_free.add(request_id)
        else:
            self.finished_recving.discard(request_id)
            self._free_blocks(request_id)
        return flushed

    def _free_blocks(self, request_id: str) -> None:
        pool = self.gpu_pool
        for ids in self.req_to_blocks.pop(request_id, []):
            pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
        self.num_cached_blocks.pop(request_id, None)

    # -- completions ------------------------------------------------------------------------

    def _connector_output(self, finished_recving: set[str], stores: dict[int, int]) -> None:
        KVConnectorOutput = self._vllm["KVConnectorOutput"]
        self.connector.update_connector_output(
            KVConnectorOutput(
                # vLLM releases the CPU blocks of finished loads in the iteration order of
                # this set, which follows string hashing and so changes from process to
                # process: two loads finished together free shared blocks in either order
                # (docs/upstream.md). A sorted list gives the model's order on every run.
                finished_recving=sorted(finished_recving),
                kv_connector_worker_meta=self._vllm["WorkerMetadata"](
                    completed_store_events=stores
                ),
            )
        )

    def loads_finished(self, request_ids: set[str]) -> None:
        self._connector_output(request_ids, {})
        for req_id in sorted(request_ids):
            if self.status[req_id] is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(req_id)
            elif req_id in self.delayed_free:
                self.delayed_free.discard(req_id)
                self._free_blocks(req_id)

    def store_completed(self, event: int, count: int) -> None:
        self._connector_output(set(), {event: count})


def _metadata(meta: Any) -> ConnectorMetadata:
    return ConnectorMetadata(
        store_event=meta.store_event,
        store_gpu_blocks=tuple(meta.store_gpu_blocks),
        store_cpu_blocks=tuple(meta.store_cpu_blocks),
        load_event=meta.load_event,
        load_gpu_blocks=tuple(meta.load_gpu_blocks),
        load_cpu_blocks=tuple(meta.load_cpu_blocks),
        load_event_to_reqs={e: tuple(r) for e, r in meta.load_event_to_reqs.items()},
    )
