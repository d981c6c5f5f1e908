"""vLLM's own ``Scheduler`` with the SimpleCPUOffload connector its factory builds: the first
slice of issue 12's second vLLM target.

Where :class:`kvoffload.upstream.target.VllmOffload` runs the model's engine over vLLM's
offload scheduler, :class:`VllmScheduler` runs vLLM's whole scheduling loop: its
``schedule()`` decides which requests run and how many tokens each computes (FCFS, the token
budget, chunked prefill, prefix-cache hits, the connector's lookups and loads), builds the
connector's metadata, and ``update_from_output()`` takes the step's sampled tokens and the
workers' reports. The adapter plays the model runner: a request that reaches the end of its
tokens samples the model engine's greedy token, and every store and load the step's metadata
sends is reported complete by every worker in the same output (the lockstep of the model's
``drain``). :func:`first_step_difference` runs a program of ``add`` and ``step`` calls on this
and on the model and names the first step whose scheduled tokens or connector metadata
differ.

Not yet: snapshots of vLLM's scheduler state, finishes and aborts from outside the step,
preemption, resets, several groups, and the conformance machine's rules (docs/upstream.md).
Runs only where vLLM imports (0.34.0's scheduler; a release environment of
:mod:`kvoffload.upstream.install`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.model import OffloadModel
from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import greedy_token
from kvoffload.model.errors import InvalidArgumentError
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.adapters import expected_variant
from kvoffload.upstream.vllm_world import build, keywords

# What one step shows: tokens scheduled per request, then the store event with its GPU and
# CPU blocks, then the load event with its GPU and CPU blocks.
StepView = tuple[
    dict[str, int], int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], tuple[int, ...]
]


class VllmScheduler:
    """vLLM's ``Scheduler`` and ``SimpleCPUOffloadConnector``, built from the adapter's world
    for ``config`` (one full-attention group, eager mode). ``whole_sequence_admission``:
    vLLM's ``scheduler_reserve_full_isl`` (its default, True: a waiting request is admitted
    only if its whole sequence fits the free blocks; the model's engine admits one whose first
    chunk fits, as vLLM does with it off)."""

    def __init__(self, config: OffloadConfig, whole_sequence_admission: bool = True) -> None:
        if config.num_groups != 1 or config.lazy:
            raise InvalidArgumentError(
                "the scheduler target drives one full-attention group in eager mode so far"
            )
        from vllm.config import KVTransferConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = config
        self.world = build(config)
        vllm_config = self.world.scheduler.vllm_config
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"num_cpu_blocks": config.cpu_blocks},
        )
        vllm_config.cache_config.num_gpu_blocks = config.gpu_blocks
        vllm_config.scheduler_config.scheduler_reserve_full_isl = whole_sequence_admission
        size = config.scheduler_block_size
        self.scheduler: Any = Scheduler(
            vllm_config,
            self.world.kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=size,
            hash_block_size=config.hash_block_size,
        )

    def add_request(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(
            Request(
                **keywords(
                    Request,
                    request_id=request_id,
                    prompt_token_ids=list(prompt),
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    pooling_params=None,
                    block_hasher=self.world.block_hasher,
                    eos_token_id=None,
                )
            )
        )

    def step(self, token_budget: int) -> StepView:
        """One ``schedule()`` with ``token_budget`` tokens, the model runner's output for it,
        and ``update_from_output()``; what the step scheduled and sent."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        scheduler = self.scheduler
        scheduler.max_num_scheduled_tokens = token_budget
        output = scheduler.schedule()
        meta = output.kv_connector_metadata
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            # vLLM advances the computed tokens (prefix hits and the step's) as it schedules:
            # a request whose tokens are all computed now samples one.
            request = scheduler.requests[rid]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([greedy_token(list(request.all_token_ids))] if done else [])
        stores = {meta.store_event: self.config.world_size} if meta.store_event >= 0 else {}
        loads = (
            set(meta.load_event_to_reqs.get(meta.load_event, ())) if meta.load_event >= 0 else set()
        )
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_recving=loads,
                    kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                        completed_store_events=stores
                    ),
                ),
            ),
        )
        return (
            dict(output.num_scheduled_tokens),
            meta.store_event,
            tuple(meta.store_gpu_blocks),
            tuple(meta.store_cpu_blocks),
            meta.load_event,
            tuple(meta.load_gpu_blocks),
            tuple(meta.load_cpu_blocks),
        )


def model_step(model: OffloadModel, token_budget: int) -> StepView:
    """The model's step, its completions reported by every worker right away, seen as
    :meth:`VllmScheduler.step` shows vLLM's."""
    result = model.step(token_budget)
    for event, worker in model.outstanding("store"):
        model.complete_store(event, worker)
    for event, worker in model.outstanding("load"):
        model.complete_load(event, worker)
    meta = result.metadata
    return (
        {rid: end - start for rid, (start, end) in result.scheduled.items()},
        meta.store_event,
        meta.store_gpu_blocks,
        meta.store_cpu_blocks,
        meta.load_event,
        meta.load_gpu_blocks,
        meta.load_cpu_blocks,
    )


def first_step_difference(
    config: OffloadConfig,
    program: Sequence[tuple[Any, ...]],
    variant: str | None = None,
    whole_sequence_admission: bool = True,
) -> str | None:
    """Run ``program`` (``("add", id, prompt, max_tokens)`` and ``("step", budget)`` calls)
    on vLLM's scheduler and on ``variant`` of the model (default: the running release's, as
    the release table names it); the first step whose view differs, or None."""
    for call in program:
        if call[0] not in ("add", "step"):
            raise InvalidArgumentError(f"the scheduler target takes add and step calls, got {call}")
    vllm = VllmScheduler(config, whole_sequence_admission)
    compared_with = variant or expected_variant("vllm")
    model = OffloadModel(config, variant=compared_with, check=keeps_invariants(compared_with))
    for n, call in enumerate(program):
        if call[0] == "add":
            vllm.add_request(*call[1:])
            model.add_request(*call[1:])
            continue
        theirs, ours = vllm.step(call[1]), model_step(model, call[1])
        if theirs != ours:
            return f"call {n} {call}: vLLM's scheduler {theirs}, the model {ours}"
    return None
