"""vLLM's own ``Scheduler`` with the SimpleCPUOffload connector its factory builds: issue
12's second vLLM target.

Where :class:`kvoffload.vllm_target.offload.VllmOffload` runs the model's engine over vLLM's
offload scheduler, :class:`VllmScheduler` runs vLLM's whole scheduling loop: its
``schedule()`` decides which requests run and how many tokens each computes (FCFS, the token
budget, chunked prefill, admission, preemption, prefix-cache hits, the connector's lookups
and loads), builds the connector's metadata, and ``update_from_output()`` takes the step's
sampled tokens and the workers' reports. The adapter plays the model runner: a request that
reaches the end of its tokens samples the model engine's greedy token, and the stores and
loads sent are reported complete, by every worker in the step's own output, or held back to
later steps' outputs, each reporting some of them (``report``, ``picks``). Requests are
aborted from outside the step (``finish_requests``), and the prefix cache is reset as vLLM's
engine resets it (nothing preempted, the connector's reset asked or not).

Its calls, and the model's for each (:func:`model_call`):

- ``("add", id, prompt, max_tokens[, skip_reading_prefix_cache])``: ``add_request``;
- ``("step", budget, report[, picks])``: one ``schedule()`` with ``budget`` tokens and its
  output; what it scheduled and sent (:data:`StepView`); ``report``: every store and load
  sent so far reported complete by every worker in this output (the model: ``step`` then
  every completion owed); else the reports ``picks`` chooses (:func:`picked`: some workers
  of a store event, a later event before an earlier one; the model: ``step`` then those);
- ``("abort", id)``: ``finish_requests(id, FINISHED_ABORTED)`` (the model: ``finish``);
- ``("reset_prefix_cache", reset_connector[, reset_running_requests])``:
  ``reset_prefix_cache``, its answer (preempting every running request first: the RLHF
  weight update in the middle of generation).

After every call the two are compared on the call's result and on the snapshot
(:func:`kvoffload.vllm_target.offload.manager_snapshot`: both pools, the offload manager's
state, and each live request's status, tokens and block table as vLLM's scheduler holds
them). Invariant: a call refused here is refused before vLLM sees it.

Runs only where vLLM imports, on releases whose scheduler has the interface of 0.34.0.
With kv-cache events, the connector's are compared at each step (vLLM's scheduler collects
them once a step, in ``update_from_output``, for its publisher).

With ``workers`` (the worker machine, issue 33), vLLM's own worker runs on every rank
beside it (:class:`kvoffload.vllm_target.worker.VllmWorkers`): the step's reports are the
workers' own, the device completing what ``report`` or ``picks`` plans, and
:meth:`VllmScheduler.data_mismatches` reads every KV byte.

Not yet driven: sliding-window, chunked local and Mamba groups (vLLM's admission caps their
block counts by window and chunk, not modelled), decode context parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import greedy_token
from kvoffload.model.errors import InvalidArgumentError
from kvoffload.model.keys import prefix_digests
from kvoffload.model.snapshot import RequestView, Snapshot
from kvoffload.model.types import KVEvent
from kvoffload.vllm_target.keymap import KeyMap
from kvoffload.vllm_target.offload import manager_snapshot, model_event
from kvoffload.vllm_target.worker import Plan, VllmWorkers, WorkerLayout, completes_at_once
from kvoffload.vllm_target.world import build, keywords

# What one step shows: tokens scheduled per request, then the store event with its GPU and
# CPU blocks, then the load event with its GPU and CPU blocks.
StepView = tuple[
    dict[str, int], int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], tuple[int, ...]
]
CALLS = ("add", "step", "abort", "reset_prefix_cache")


def picked(
    loads: Sequence[int],
    stores: Sequence[tuple[int, int]],
    picks: Sequence[int],
    in_order: bool = False,
) -> tuple[list[int], list[tuple[int, int]]]:
    """The reports a step's output makes of those owed: the load events ``loads`` (each
    whole) then the (event, worker) store reports ``stores``, in that order, and ``picks``
    their indexes (one past them picks nothing, duplicates count once), so that any subset
    of the reports, in any interleaving of events and workers, is some list of picks; both
    sides of the scheduler machine choose the same from the same reports owed.

    ``in_order``: each worker's transfers complete in the order they were issued, as vLLM's
    worker's streams run them, so a report picked brings every earlier one of its kind and
    worker (every earlier load event, for loads)."""
    owed: list[tuple[int, int]] = [(e, -1) for e in loads] + list(stores)
    chosen = {owed[i] for i in picks if 0 <= i < len(owed)}
    if in_order:
        last: dict[int, int] = {}  # worker (-1 for loads) -> the latest event picked
        for event, worker in chosen:
            last[worker] = max(event, last.get(worker, event))
        chosen = {(e, w) for e, w in owed if e <= last.get(w, -1)}
    return (
        [e for e, w in owed[: len(loads)] if (e, w) in chosen],
        [r for r in owed[len(loads) :] if r in chosen],
    )


def unsupported(config: OffloadConfig) -> str | None:
    """Why the scheduler target cannot drive ``config``, or None."""
    if not all(config.full_attention(g) for g in range(config.num_groups)):
        # vLLM's admission caps the counts of sliding-window, chunked local and Mamba groups
        # by their windows and chunks: not modelled (docs/upstream.md).
        return "the scheduler target drives full-attention groups only so far"
    if config.num_groups == 1 and config.hash_block_size != config.group_block_sizes[0]:
        return "vLLM's one-group coordinator hashes whole blocks only"
    if config.dcp_world_size != 1:
        return "the scheduler target does not drive decode context parallelism yet"
    return None


class VllmScheduler:
    """vLLM's ``Scheduler`` and ``SimpleCPUOffloadConnector``, built from the adapter's world
    for ``config``. ``whole_sequence_admission``: vLLM's ``scheduler_reserve_full_isl`` (its
    default, True: a waiting request is admitted only if its whole sequence fits the free
    blocks)."""

    def __init__(
        self,
        config: OffloadConfig,
        whole_sequence_admission: bool = True,
        workers: WorkerLayout | None = None,
    ) -> None:
        why = unsupported(config)
        if why is not None:
            raise InvalidArgumentError(why)
        from vllm.config import KVTransferConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = config
        self.world = build(config)
        vllm_config = self.world.scheduler.vllm_config
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "num_cpu_blocks": config.cpu_blocks,
                "lazy_offload": config.lazy,
            },
        )
        vllm_config.cache_config.num_gpu_blocks = config.gpu_blocks
        vllm_config.scheduler_config.scheduler_reserve_full_isl = whole_sequence_admission
        self.scheduler: Any = Scheduler(
            vllm_config,
            self.world.kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
        )
        # Building a connector reconfigures vLLM's loggers at INFO: a refused reset (a
        # warning) or a connector built (info) per program is noise here.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        self.manager: Any = self.scheduler.connector.scheduler_manager
        # The manager counts store reports up to the world size of the parallel config; a
        # world of several workers needs no devices on the scheduler side.
        self.manager._expected_worker_count = config.world_size
        self.keys = KeyMap(config.hash_block_size)
        self.requests: dict[str, Any] = {}  # every request added, finished ones too
        # the reports owed: per store event the workers that have not reported it, per
        # load event its requests (vLLM's executor passes a load up once every worker
        # finished it, so a load is reported whole)
        self._unreported_stores: dict[int, set[int]] = {}
        self._unreported_loads: dict[int, list[str]] = {}
        # The connector's kv-cache events as vLLM's scheduler collects them for its
        # publisher (with the GPU pool's, which the model does not publish).
        self._events: list[Any] = []
        # vLLM's own worker on every rank (issue 33), or reports made up as the model runner's
        self.workers = None if workers is None else VllmWorkers(config, vllm_config, workers)
        self.tokens_of: dict[str, list[int]] = {}  # a model key's digest -> its tokens
        if config.kv_events:
            connector = self.scheduler.connector
            collect = connector.take_events

            def take_events() -> Any:
                events = list(collect())
                self._events += events
                return events

            connector.take_events = take_events

    # -- calls ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            **keywords(
                Request,
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    skip_reading_prefix_cache=skip_reading_prefix_cache,
                ),
                pooling_params=None,
                block_hasher=self.world.block_hasher,
                eos_token_id=None,
            )
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        self._learn()

    def step(self, token_budget: int, report: bool = True, picks: Sequence[int] = ()) -> StepView:
        """One ``schedule()`` with ``token_budget`` tokens, the model runner's output for it,
        and ``update_from_output()``; what the step scheduled and sent. ``report``: the
        output reports every store and load sent so far (this step's included) complete;
        else the reports ``picks`` chooses among those owed (:func:`picked`)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        scheduler.max_num_scheduled_tokens = token_budget
        report = report or completes_at_once(None if self.workers is None else self.workers.layout)
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
        # (the reports owed from earlier steps: a preempting step's flush completes them)
        earlier_loads = sorted(self._unreported_loads)
        earlier_stores = [(e, w) for e, ws in self._unreported_stores.items() for w in ws]
        if meta.store_event >= 0:
            self._unreported_stores[meta.store_event] = set(range(self.config.world_size))
        if meta.load_event >= 0:
            reqs = meta.load_event_to_reqs.get(meta.load_event, ())
            self._unreported_loads[meta.load_event] = sorted(reqs)
        owed = [(e, w) for e, workers in sorted(self._unreported_stores.items()) for w in workers]
        load_events, reports = (
            (sorted(self._unreported_loads), owed)
            if report
            else picked(
                sorted(self._unreported_loads), owed, picks, in_order=self.workers is not None
            )
        )
        # (what the device completes: the flush of a preempting step is the worker's own)
        plan = Plan(
            report,
            frozenset(load_events),
            {w: frozenset(e for e, r in reports if r == w) for w in range(self.config.world_size)},
        )
        if self.workers is not None and meta.need_flush and not report:
            # vLLM's worker synchronizes every transfer it launched before a preempting step
            load_events = sorted(set(load_events) | set(earlier_loads))
            reports = sorted(set(reports) | set(earlier_stores))
        loads = sorted(r for e in load_events for r in self._unreported_loads.pop(e))
        stores: dict[int, int] = {}
        for event, worker in sorted(reports):
            stores[event] = stores.get(event, 0) + 1
            self._unreported_stores[event].discard(worker)
            if not self._unreported_stores[event]:
                del self._unreported_stores[event]
        if self.workers is not None:
            # vLLM's own workers make the reports, the device completing what was planned
            tables = {rid: manager.get_block_ids(rid) for rid in req_ids}
            connector_output = self.workers.step(output, scheduler.requests, tables, plan)
            if connector_output is not None:
                # In the order the model takes them (docs/upstream.md): the aggregator's set of
                # loaded requests iterates in string-hash order, and a worker reports the
                # store events it found complete in its pending set's order (ints by their
                # hash modulo the table: 8 before 7), an order of no meaning.
                if connector_output.finished_recving:
                    connector_output.finished_recving = sorted(connector_output.finished_recving)
                reported = connector_output.kv_connector_worker_meta
                if reported is not None:
                    events = reported.completed_store_events
                    reported.completed_store_events = dict(sorted(events.items()))
        else:
            connector_output = KVConnectorOutput(
                # A sorted list where vLLM's executor passes a set: the manager releases
                # the loads' CPU blocks in its iteration order, which for a set follows
                # string hashing (docs/upstream.md); the model's is sorted.
                finished_recving=loads,
                # None when no store completed, as vLLM's workers report it.
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                    completed_store_events=stores
                )
                if stores
                else None,
            )
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                **keywords(
                    ModelRunnerOutput,
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                ),
                kv_connector_output=connector_output,
            ),
        )
        self._learn()
        if self.workers is not None:
            self.workers.end_step()
        return (
            dict(output.num_scheduled_tokens),
            meta.store_event,
            tuple(meta.store_gpu_blocks),
            tuple(meta.store_cpu_blocks),
            meta.load_event,
            tuple(meta.load_gpu_blocks),
            tuple(meta.load_cpu_blocks),
        )

    def close(self) -> None:
        """Let the workers' threads, devices and files go (nothing without workers)."""
        if self.workers is not None:
            self.workers.close()

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus as VllmStatus

        self.scheduler.finish_requests(request_id, VllmStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self, reset_connector: bool, reset_running: bool = False) -> bool:
        """vLLM's engine's reset, the connector's reset asked for or not, every running
        request preempted first or none."""
        return bool(
            self.scheduler.reset_prefix_cache(
                reset_running_requests=reset_running, reset_connector=reset_connector
            )
        )

    def take_events(self) -> list[KVEvent]:
        """The connector's kv-cache events vLLM's scheduler published since the last call
        (it collects them in ``update_from_output``), as the model's."""
        events, self._events = self._events, []
        return [model_event(e, self.keys) for e in events]

    def live_requests(self) -> list[str]:
        return [r for r, req in self.scheduler.requests.items() if not req.is_finished()]

    # -- state ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Both pools, the offload manager's state, and each live request as vLLM's scheduler
        holds it (statuses by their names, lower case, as the model's)."""
        manager = self.scheduler.kv_cache_manager
        requests = tuple(
            RequestView(
                req_id,
                "finished" if req.is_finished() else req.status.name.lower(),
                req.num_tokens,
                req.num_computed_tokens,
                tuple(req.output_token_ids),
                table,
            )
            for req_id, req in sorted(self.scheduler.requests.items())
            # A finished request whose blocks vLLM keeps (a load still owed: the connector
            # delays their free) is still in the scheduler's requests, and holds them.
            if (table := _table(manager.get_block_ids(req_id))) or not req.is_finished()
        )
        return manager_snapshot(self.manager, manager.block_pool, self.keys, requests)

    def _learn(self) -> None:
        """Pair vLLM's hashes of every request with the model's digests of its tokens (and,
        with workers, each digest with its tokens)."""
        size = self.config.hash_block_size
        for request in self.requests.values():
            hashes = request.block_hashes
            tokens = list(request.all_token_ids)
            digests = prefix_digests(tokens, size)
            n = min(len(hashes), len(digests))
            self.keys.learn(digests[:n], hashes[:n])
            if self.workers is not None:
                for i, digest in enumerate(digests):
                    if digest not in self.tokens_of:  # (a prefix's tokens never change)
                        self.tokens_of[digest] = tokens[: (i + 1) * size]

    def data_mismatches(self, snap: Snapshot | None = None) -> list[str]:
        """With vLLM's workers: the wrong KV their forwards read since the last call, then
        every cached block of both pools whose bytes on some rank are not its key's KV (the
        pools as ``snap`` shows them, the snapshot just taken, or a new one)."""
        if self.workers is None:
            return []
        snap = snap if snap is not None else self.snapshot()
        sides = []
        for pool in (snap.gpu, snap.cpu):
            sides.append(
                [
                    (block, key.group, self.tokens_of[key.digest])
                    for key, ids in pool.cached
                    for block in ids
                    if key.digest in self.tokens_of
                    and key.num_tokens % self.config.group_block_sizes[key.group] == 0
                ]
            )
        wrong: list[str] = self.workers.served_wrong() + self.workers.mismatches(*sides)
        return wrong


def _table(block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """A block table as the model's snapshot has it: none while every group's is empty."""
    table = tuple(tuple(ids) for ids in block_ids)
    return table if any(table) else ()
