"""The model's engine (:class:`kvoffload.model.engine.Engine`) run over vLLM's own objects.

:class:`VllmEngine` *is* the model's engine: the same step, allocation, load waits and
finish, inherited, not rewritten, so that a difference between the two runs can only come
from what vLLM computes. Underneath it, three facades give vLLM's objects the interfaces the
model's engine calls:

- :class:`VllmRequest`: a model request that keeps a vLLM ``Request`` (hashed by vLLM's block
  hasher) in step: computed tokens, outputs;
- :class:`VllmGpuPool`: vLLM's GPU ``BlockPool`` (allocation, ref counts, the free queue,
  ``cache_full_blocks``, ``cache_partial_block``), looked up by model keys;
- :class:`VllmConnector`: vLLM's ``SimpleCPUOffloadScheduler``, called as vLLM's scheduler
  calls it (``get_num_new_matched_tokens``, ``update_state_after_alloc`` with
  ``KVCacheBlocks``, ``build_connector_meta`` over a real ``SchedulerOutput``,
  ``update_connector_output`` with a ``KVConnectorOutput``, ``request_finished_all_groups``).

Runs only where vLLM imports (a release environment of :mod:`kvoffload.upstream.install`).
The model's ghost records of finishes stay empty of dispositions: vLLM keeps none.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any, cast

from kvoffload.model.block_pool import BlockPool
from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import Engine, Request, SchedulerOutput
from kvoffload.model.keys import BlockKey
from kvoffload.model.offload import Disposition, OffloadScheduler, Transfer
from kvoffload.model.types import ConnectorMetadata
from kvoffload.vllm_target.keymap import KeyMap
from kvoffload.vllm_target.world import World, keywords, preemption_drawn, queued_final_flushes


class VllmRequest(Request):
    """A model request with its vLLM twin: what the engine changes, it changes in both."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        engine: VllmEngine,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as Vllm

        self.keys = engine.keys
        self.vllm: Any = Vllm(
            **keywords(
                Vllm,
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(
                    max_tokens=max_tokens, skip_reading_prefix_cache=skip_reading_prefix_cache
                ),
                pooling_params=None,
                block_hasher=engine.world.block_hasher,
            )
        )
        super().__init__(
            request_id,
            tuple(prompt),
            max_tokens,
            engine.config.hash_block_size,
            skip_reading_prefix_cache,
        )
        self.keys.learn(self.digests, self.vllm.block_hashes)

    # The manager reads the vLLM request's count: the model's engine writes it there.
    @property
    def num_computed_tokens(self) -> int:
        return int(self.vllm.num_computed_tokens)

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.vllm.num_computed_tokens = value

    def append_output(self, token: int) -> None:
        super().append_output(token)
        self.vllm.append_output_token_ids(token)
        self.keys.learn(self.digests, self.vllm.block_hashes)


def _vllm(request: Request) -> Any:
    """The vLLM twin of a request of the engine (every one is a :class:`VllmRequest`)."""
    return cast(VllmRequest, request).vllm


class VllmGpuPool:
    """vLLM's GPU ``BlockPool`` with the methods of the model's pool the engine calls."""

    def __init__(self, pool: Any, keys: KeyMap) -> None:
        self.pool = pool
        self.keys = keys
        self.blocks = pool.blocks
        self.null_block = pool.null_block

    @property
    def num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_one_block(self, key: BlockKey, skip: Container[int] = ()) -> Any:
        # Only the model's CPU pool passes over damaged blocks; this is vLLM's GPU pool.
        assert not skip, "vLLM's GPU pool has no damaged blocks to pass over"
        return self.pool.cached_block_hash_to_block.get_one_block(self.keys.vllm_key(key))

    def touch(self, blocks: Sequence[Any]) -> None:
        self.pool.touch(list(blocks))

    def get_new_blocks(self, n: int) -> list[Any]:
        return list(self.pool.get_new_blocks(n))

    def free_blocks(self, ordered: Iterable[Any]) -> None:
        self.pool.free_blocks(list(ordered))


class VllmConnector:
    """vLLM's ``SimpleCPUOffloadScheduler`` with the methods of the model's connector the
    engine calls, each translated into the call vLLM's scheduler makes."""

    def __init__(self, world: World, requests: dict[str, Request]) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
        from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        self.KVCacheBlocks = KVCacheBlocks
        self.NewRequestData = NewRequestData
        self.CachedRequestData = CachedRequestData
        self.SchedulerOutput = VllmSchedulerOutput
        self.KVConnectorOutput = KVConnectorOutput
        self.WorkerMetadata = SimpleCPUOffloadWorkerMetadata
        self.manager = world.scheduler
        self.gpu_blocks = world.gpu_pool.blocks
        self.requests = requests
        self.num_groups = len(world.kv_cache_config.kv_cache_groups)
        self.finished_since_step: set[str] = set()
        # The model's ghost record of dispositions: vLLM keeps none.
        self.dispositions: dict[str, list[dict[int, Disposition]]] = {}

    @property
    def reqs_to_store(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.manager._reqs_to_store)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        matched, load_async = self.manager.get_num_new_matched_tokens(
            _vllm(request), num_computed_tokens
        )
        return matched or 0, bool(load_async)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        blocks = self.KVCacheBlocks(tuple([self.gpu_blocks[i] for i in ids] for ids in block_ids))
        self.manager.update_state_after_alloc(_vllm(request), blocks, num_external_tokens)

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        meta = self.manager.build_connector_meta(self._scheduler_output(output))
        self.finished_since_step = set()
        return ConnectorMetadata(
            store_event=meta.store_event,
            store_gpu_blocks=tuple(meta.store_gpu_blocks),
            store_cpu_blocks=tuple(meta.store_cpu_blocks),
            load_event=meta.load_event,
            load_gpu_blocks=tuple(meta.load_gpu_blocks),
            load_cpu_blocks=tuple(meta.load_cpu_blocks),
            load_event_to_reqs={e: tuple(r) for e, r in meta.load_event_to_reqs.items()},
        )

    def _scheduler_output(self, output: SchedulerOutput) -> Any:
        """vLLM's ``SchedulerOutput`` for the step, from the fields each release has."""
        new_data = []
        for req_id, block_ids in output.new_reqs:
            req = _vllm(self.requests[req_id])
            new_data.append(
                self.NewRequestData(
                    **keywords(
                        self.NewRequestData,
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
        cached = [_vllm(self.requests[req_id]) for req_id, _ in output.cached_reqs]
        cached_data = self.CachedRequestData(
            **keywords(
                self.CachedRequestData,
                req_ids=[r.request_id for r in cached],
                resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached],
                all_token_ids={},
                new_block_ids=[block_ids for _, block_ids in output.cached_reqs],
                num_computed_tokens=[r.num_computed_tokens for r in cached],
                num_output_tokens=[r.num_output_tokens for r in cached],
            )
        )
        scheduled = output.num_scheduled_tokens
        return self.SchedulerOutput(
            **keywords(
                self.SchedulerOutput,
                scheduled_new_reqs=new_data,
                scheduled_cached_reqs=cached_data,
                num_scheduled_tokens=dict(scheduled),
                total_num_scheduled_tokens=sum(scheduled.values()),
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                num_common_prefix_blocks=[0] * self.num_groups,
                finished_req_ids=set(self.finished_since_step),
                free_encoder_mm_hashes=[],
                preempted_req_ids=set(output.preempted_req_ids),
                kv_connector_block_state=self._block_state(output),
            )
        )

    def _block_state(self, output: SchedulerOutput) -> Any:
        """vLLM's ``KVConnectorBlockState`` of the step (0.30.0 on): the requests scheduled
        or with a hand-off, and the boundary-state hand-offs; None where there is none to
        give (as vLLM's scheduler gives none without a connector)."""
        if not output.boundary_offloads:
            return None
        from vllm.v1.core.sched.output import KVConnectorBlockState

        offers = {req_id: list(entries) for req_id, entries in output.boundary_offloads}
        return KVConnectorBlockState(
            **keywords(
                KVConnectorBlockState,
                req_ids={*output.num_scheduled_tokens, *offers},
                resolve_block_ids=self._block_ids,
                boundary_state_offloads=offers,
            )
        )

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        raise AssertionError(f"the offload scheduler resolved the block table of {req_id!r}")

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        """vLLM's finish hook; the final flush it queued, read from the manager's queue."""
        queued_before = len(queued_final_flushes(self.manager))
        self.manager.request_finished_all_groups(_vllm(request), block_ids)
        self.finished_since_step.add(request.request_id)
        queue = queued_final_flushes(self.manager)
        if len(queue) == queued_before:
            return None
        return Transfer(list(queue[-1].gpu_block_ids), list(queue[-1].cpu_block_ids))

    def update_connector_output(
        self,
        finished_recving: set[str],
        completed_store_events: dict[int, int],
        failed_store_events: frozenset[int] = frozenset(),
    ) -> None:
        # vLLM's workers report no failed store (kvoffload's integrity contract has them):
        # the machine never injects one into this target.
        assert not failed_store_events, "vLLM takes no failed store reports"
        self.manager.update_connector_output(
            self.KVConnectorOutput(
                # vLLM releases the CPU blocks of finished loads in the iteration order of
                # this set, which follows string hashing and so changes from process to
                # process: two loads finished together free shared blocks in either order
                # (docs/upstream.md). A sorted list gives the model's order on every run.
                finished_recving=sorted(finished_recving),
                # vLLM's workers send no metadata when no store completed
                # (build_connector_worker_meta returns None), so neither does the adapter.
                kv_connector_worker_meta=self.WorkerMetadata(
                    completed_store_events=completed_store_events
                )
                if completed_store_events
                else None,
            )
        )


class VllmEngine(Engine):
    """The model's engine with vLLM's pool, manager and requests underneath."""

    def __init__(self, config: OffloadConfig, world: World) -> None:
        super().__init__(config)  # the model's empty tables; its pool and connector go next
        self.world = world
        self.keys = KeyMap(config.hash_block_size)
        self.vllm_pool = VllmGpuPool(world.gpu_pool, self.keys)
        # Duck-typed: the facades have the methods of the model's classes the engine calls.
        self.gpu_pool = cast(BlockPool, self.vllm_pool)
        self.connector = cast(OffloadScheduler, VllmConnector(world, self.requests))
        self.preemption = preemption_drawn()

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.requests[request_id] = VllmRequest(
            request_id, prompt, max_tokens, self, skip_reading_prefix_cache
        )
        self.waiting.append(request_id)

    def vllm_requests(self) -> dict[str, VllmRequest]:
        return cast(dict[str, VllmRequest], self.requests)

    # The model's cache_blocks decides what to register; vLLM's pool registers it. Its calls
    # take the request (vLLM hashes it), not the model's keys.
    def cache_full_blocks(
        self, req: Request, group: int, blocks: list[Any], start: int, end: int
    ) -> None:
        size = self.config.group_block_sizes[group]
        self.world.gpu_pool.cache_full_blocks(_vllm(req), blocks, start, end, size, group)

    def cache_prompt_tail(self, req: Request, group: int, block: Any, boundary: int) -> None:
        size = self.config.group_block_sizes[group]
        self.world.gpu_pool.cache_partial_block(_vllm(req), block, boundary, group, size)

    def lookup(self, tokens: Sequence[int]) -> int:
        """vLLM's CPU coordinator asked for the prompt's longest hit (pins nothing)."""
        probe = VllmRequest("", tokens, 1, self)
        manager = self.world.scheduler
        _, hit, *_ = manager.cpu_coordinator.find_longest_cache_hit(
            probe.vllm.block_hashes, len(tokens) - 1
        )
        return int(hit)
