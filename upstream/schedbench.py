"""The scheduler trace of ``kvoffload bench`` run through vLLM's own objects, for a side by
side with the implementation's scheduler (:func:`kvoffload.impl.bench.scheduler_cost`): the
same prompt, step budget, pool sizes and phases, imported from there.

One prompt through vLLM's GPU ``BlockPool`` and its ``SimpleCPUOffloadScheduler``, called as
vLLM's scheduler and KV cache manager call them: allocation and ``cache_full_blocks`` of the
prompt's blocks chunk by chunk, ``build_connector_meta`` over a real ``SchedulerOutput`` (eager
store selection), ``update_connector_output`` (store completions),
``request_finished_all_groups`` and the freeing of the request's blocks (finish, final flush),
then, after a GPU prefix-cache reset, the same prompt again: the CPU lookup, the lookup with
its pin (``get_num_new_matched_tokens``), the allocation and ``update_state_after_alloc``, the
load's metadata and its completion. Phases and their names are the implementation's, so that
each can be put beside the other. Requests are built (and hashed) outside the timed calls, as
on the implementation's side.

``python -m kvoffload.upstream.schedbench POOLS BLOCK_SIZES TOKENS REPEATS`` prints, as JSON,
the seconds of each phase (best of ``REPEATS``) for every pool size and block size. It imports
vLLM: run it in a release's environment (``kvoffload.upstream.install.Cache.environment``).
:func:`vllm_scheduler_cost` does that from this project's interpreter, when the release is
installed, and says why not when it is not.
"""

from __future__ import annotations

import functools
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.impl.bench import PHASES, STEP_TOKENS, pools_for, trace_prompt
from kvoffload.model.config import OffloadConfig

RELEASE = "0.34.0"


class _Trace:
    """One run of the trace on a fresh vLLM world of ``pool`` blocks per pool."""

    def __init__(self, pool: int, block_size: int) -> None:
        # vLLM's log level first (kvoffload.vllm_target), then vLLM
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import Request
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        from kvoffload.vllm_target import world as vllm_world

        # vLLM's world is sized for the conformance machine's short prompts; a long prompt
        # needs a longer model length (VLLM_ALLOW_LONG_MAX_MODEL_LEN lets it pass the
        # hand-written model config's 2048 positions).
        vllm_world.MAX_MODEL_LEN = 1 << 17
        self.world = vllm_world.build(OffloadConfig(pool, pool, (block_size,), block_size))
        self.manager = self.world.scheduler
        self.gpu = self.world.gpu_pool
        self.block_size = block_size
        self.keywords = vllm_world.keywords
        self.Request, self.SamplingParams = Request, SamplingParams
        self.KVCacheBlocks, self.KVConnectorOutput = KVCacheBlocks, KVConnectorOutput
        self.NewRequestData, self.CachedRequestData = NewRequestData, CachedRequestData
        self.SchedulerOutput = SchedulerOutput
        self.WorkerMetadata = SimpleCPUOffloadWorkerMetadata
        self.timings: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        self.timings[name] += time.perf_counter() - start
        return out

    def request(self, request_id: str, prompt: list[int]) -> Any:
        return self.Request(
            **self.keywords(
                self.Request,
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=self.SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=self.world.block_hasher,
            )
        )

    def output(
        self, new: list[tuple[Any, list[int]]], cached: list[tuple[Any, list[int]]], tokens: int
    ) -> Any:
        """vLLM's ``SchedulerOutput`` of one step."""
        kw = self.keywords
        new_data = [
            self.NewRequestData(
                **kw(
                    self.NewRequestData,
                    req_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    mm_features=[],
                    sampling_params=req.sampling_params,
                    pooling_params=None,
                    block_ids=(ids,),
                    num_computed_tokens=req.num_computed_tokens,
                    lora_request=None,
                    prefill_token_ids=req.prompt_token_ids,
                )
            )
            for req, ids in new
        ]
        cached_data = self.CachedRequestData(
            **kw(
                self.CachedRequestData,
                req_ids=[req.request_id for req, _ in cached],
                resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached],
                all_token_ids={},
                new_block_ids=[(ids,) for _, ids in cached],
                num_computed_tokens=[req.num_computed_tokens for req, _ in cached],
                num_output_tokens=[req.num_output_tokens for req, _ in cached],
            )
        )
        scheduled = {req.request_id: tokens for req, _ in new + cached} if tokens else {}
        return self.SchedulerOutput(
            **kw(
                self.SchedulerOutput,
                scheduled_new_reqs=new_data,
                scheduled_cached_reqs=cached_data,
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()),
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                num_common_prefix_blocks=[0],
                finished_req_ids=set(),
                free_encoder_mm_hashes=[],
                preempted_req_ids=set(),
                kv_connector_block_state=None,
            )
        )

    def gpu_hit(self, req: Any) -> int:
        """The GPU prefix hit, as vLLM's KV cache manager looks it up."""
        manager = self.manager.cpu_coordinator.single_type_managers[0]
        _, hit = manager.find_longest_cache_hit(
            block_hashes=req.block_hashes,
            max_length=req.num_tokens - 1,
            kv_cache_group_ids=[0],
            block_pool=self.gpu,
            kv_cache_spec=self.world.kv_cache_config.kv_cache_groups[0].kv_cache_spec,
            drop_eagle_block=False,
            alignment_tokens=self.block_size,
        )
        return int(hit)

    def complete_stores(self, event: int) -> None:
        if event >= 0:
            meta = self.WorkerMetadata(completed_store_events={event: 1})
            self.manager.update_connector_output(
                self.KVConnectorOutput(kv_connector_worker_meta=meta)
            )

    def run(self, prompt: list[int]) -> dict[str, float]:
        first, completion, flush_phase, cpu_lookup, load, load_completion = PHASES
        req = self.request("a", prompt)
        table: list[Any] = []
        n = len(prompt)
        while req.num_computed_tokens < n:
            last = req.num_computed_tokens + STEP_TOKENS >= n
            event = self.timed(first, lambda: self.compute_step(req, table, n))
            if last:
                req.append_output_token_ids(0)  # the sampled token: vLLM hashes as it grows
                self.timed(first, lambda: self.finish(req, table))
            self.timed(completion, functools.partial(self.complete_stores, event))
        flush = self.timed(
            flush_phase, lambda: self.manager.build_connector_meta(self.output([], [], 0))
        )
        self.timed(completion, lambda: self.complete_stores(flush.store_event))
        self.gpu.reset_prefix_cache()  # the repeat must load from the CPU
        again = self.request("b", prompt)
        coordinator = self.manager.cpu_coordinator
        self.timed(
            cpu_lookup, lambda: coordinator.find_longest_cache_hit(again.block_hashes, n - 1)
        )
        meta = self.timed(load, lambda: self.load_step(again))
        assert meta.load_event >= 0, "the repeated prompt did not load from the CPU"
        self.timed(
            load_completion,
            lambda: self.manager.update_connector_output(
                self.KVConnectorOutput(finished_recving=["b"])
            ),
        )
        return self.timings

    def compute_step(self, req: Any, table: list[Any], n: int) -> int:
        """One chunk: admission (a new request), allocation and caching, store selection."""
        first = req.num_computed_tokens == 0
        if first:
            self.gpu_hit(req)
            self.manager.get_num_new_matched_tokens(req, 0)
        tokens = min(STEP_TOKENS, n - req.num_computed_tokens)
        end = req.num_computed_tokens + tokens
        wanted = -(-end // self.block_size)
        new = self.gpu.get_new_blocks(wanted - len(table))
        cached = len(table)
        table.extend(new)
        self.gpu.cache_full_blocks(req, table, cached, end // self.block_size, self.block_size, 0)
        ids = [b.block_id for b in new]
        if first:
            self.manager.update_state_after_alloc(req, self.KVCacheBlocks((new,)), 0)
            output = self.output([(req, ids)], [], tokens)
        else:
            output = self.output([], [(req, ids)], tokens)
        meta = self.manager.build_connector_meta(output)
        req.num_computed_tokens = end
        return int(meta.store_event)

    def finish(self, req: Any, table: list[Any]) -> None:
        """The request finishes: final flush, its blocks freed last to first."""
        self.manager.request_finished_all_groups(req, ([b.block_id for b in table],))
        self.gpu.free_blocks(reversed(table))

    def load_step(self, req: Any) -> Any:
        """The repeat's admission: GPU miss, CPU hit pinned, blocks allocated, load sent."""
        self.gpu_hit(req)
        hit, _ = self.manager.get_num_new_matched_tokens(req, 0)
        blocks = self.gpu.get_new_blocks(-(-hit // self.block_size))
        self.manager.update_state_after_alloc(req, self.KVCacheBlocks((blocks,)), hit)
        req.num_computed_tokens = hit
        return self.manager.build_connector_meta(self.output([], [], 0))


def measure(
    pools: Sequence[int], block_sizes: Sequence[int], prompt_tokens: int, repeats: int
) -> dict[str, Any]:
    """Best seconds of each phase, per block size and pool size (run inside vLLM's env)."""
    import vllm

    prompt = trace_prompt(prompt_tokens)
    results: list[dict[str, Any]] = []
    for block_size in block_sizes:
        _Trace(prompt_tokens // block_size + 2, block_size).run(prompt)  # warm-up
        for pool in pools_for(pools, prompt_tokens, block_size):
            best: dict[str, float] = {}
            for _ in range(repeats):
                trace = _Trace(pool, block_size)
                gc.collect()
                gc.disable()
                try:
                    timings = trace.run(prompt)
                finally:
                    gc.enable()
                del trace
                best = {k: min(v, best.get(k, v)) for k, v in timings.items()}
            results.append({"block_size": block_size, "pool_blocks": pool, "seconds": best})
    return {"version": str(vllm.__version__), "prompt_tokens": prompt_tokens, "runs": results}


def vllm_scheduler_cost(
    pools: Sequence[int], block_sizes: Sequence[int], prompt_tokens: int, repeats: int
) -> tuple[dict[str, Any] | None, str]:
    """The trace through vLLM :data:`RELEASE` in the cache's interpreter: (results, a line
    saying what ran), or (None, why it did not)."""
    from kvoffload.upstream.install import Cache, default_cache

    cache = Cache(default_cache())
    if not cache.installed(RELEASE):
        return None, (
            f"vLLM {RELEASE} is not installed (`kvoffload install vllm=={RELEASE}`): the "
            "side by side with vLLM's scheduler was not run"
        )
    command = [str(cache.python), "-m", "kvoffload.upstream.schedbench"]
    command += [",".join(map(str, pools)), ",".join(map(str, block_sizes))]
    command += [str(prompt_tokens), str(repeats)]
    env = cache.environment(RELEASE) | {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"vLLM {RELEASE}'s run of the trace failed (exit {run.returncode}): {tail}"
    results: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return results, f"vLLM {results['version']}, run in the cache's interpreter by this bench"


def main(argv: Sequence[str]) -> int:
    pools, sizes, tokens, repeats = argv
    result = measure(
        [int(p) for p in pools.split(",")],
        [int(s) for s in sizes.split(",")],
        int(tokens),
        int(repeats),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
