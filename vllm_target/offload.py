"""``VllmOffload``: vLLM's own offload code behind the driver API and the snapshot, so that
the conformance machine drives it like any implementation (adapter ``vllm``).

Runs only where vLLM imports. Calls are validated as the model validates them (the same
exceptions, raised before anything changes). vLLM's scheduler side holds no KV bytes, so
this target has no data check: it is compared on results and snapshots.

The snapshot reads vLLM's state (its pools and the manager's fields, which carry the
model's names with a leading underscore) and names keys as the model does (:class:`KeyMap`).
Where releases differ in how they hold it, :mod:`kvoffload.vllm_target.world` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import RequestStatus
from kvoffload.model.errors import (
    InvalidArgumentError,
)
from kvoffload.model.keys import BlockKey
from kvoffload.model.snapshot import (
    BlockView,
    LoadView,
    PoolView,
    RequestView,
    Snapshot,
    StoreTrackView,
    TransferView,
)
from kvoffload.model.types import (
    CLEARED,
    REMOVED,
    STORED,
    FinishResult,
    KVEvent,
    OffloadStats,
    StepResult,
)
from kvoffload.model.validate import (
    owed_completions,
    require_completion,
    require_flag,
    require_int,
    require_live_request,
    require_new_request,
    require_request_id,
    require_token_budget,
    require_tokens,
)
from kvoffload.vllm_target.engine import VllmEngine
from kvoffload.vllm_target.keymap import KeyMap
from kvoffload.vllm_target.world import build, cached_entries, queued_final_flushes, state


class VllmOffload:
    """vLLM's ``BlockPool`` and ``SimpleCPUOffloadScheduler`` driven call by call."""

    name_in_words = "vLLM"  # how a difference in words names it (testing/words.py)

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.world = build(config)
        self.engine = VllmEngine(config, self.world)
        self._store_reports: dict[int, set[int]] = {}
        self._load_reports: dict[int, set[int]] = {}

    @property
    def manager(self) -> Any:
        return self.world.scheduler

    # -- the driver API -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int = 1,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        tokens = require_new_request(
            self.config,
            request_id,
            prompt,
            max_tokens,
            self.engine.requests,
            skip_reading_prefix_cache,
        )
        self.engine.add_request(request_id, tokens, max_tokens, skip_reading_prefix_cache)

    def step(self, token_budget: int) -> StepResult:
        return self.engine.step(require_token_budget(token_budget))

    def finish(self, request_id: str) -> FinishResult:
        req = self.engine.requests.get(require_request_id(request_id))
        require_live_request(request_id, None if req is None else req.status)
        flushed = self.engine.finish_request(request_id)
        if flushed is None:
            return FinishResult(request_id)
        return FinishResult(request_id, tuple(flushed.gpu_block_ids), tuple(flushed.cpu_block_ids))

    def complete_store(self, event: int, worker: int = 0) -> bool:
        reports = self._accept("store", event, worker)
        self.engine.store_completed(event, 1)
        return len(reports) == self.config.world_size

    def complete_load(self, event: int, worker: int = 0) -> tuple[str, ...]:
        reports = self._accept("load", event, worker)
        if len(reports) < self.config.world_size:
            return ()
        finished = tuple(self.manager._load_event_to_reqs.get(event, ()))
        self.engine.loads_finished(set(finished))
        return finished

    def _accept(self, kind: str, event: int, worker: int) -> set[int]:
        table = self._store_reports if kind == "store" else self._load_reports
        # An unhashable or non-int event must get the contract's error, not the dict's.
        reported = table.get(require_int("event", event, 0), set())
        require_completion(self.config, kind, event, worker, self._counter(kind), reported)
        table[event] = reported | {worker}
        return table[event]

    def _counter(self, kind: str) -> int:
        if kind == "store":
            return int(self.manager._store_event_counter)
        return int(self.manager._load_event_counter)

    def lookup(self, tokens: Sequence[int]) -> int:
        """vLLM's CPU coordinator asked for the prompt's longest hit (pins nothing)."""
        return self.engine.lookup(require_tokens(tokens))

    def reset(self) -> bool:
        return bool(self.manager.reset())

    def reset_prefix_cache(
        self, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool:
        """vLLM's own ``Scheduler.reset_prefix_cache`` (no running request preempted), run on
        what it reads of its scheduler: the KV cache manager resets vLLM's GPU pool, the
        connector (``SimpleCPUOffloadConnector.reset_cache``) the offload scheduler.

        ``reset_running_requests`` is taken as the model takes it, but refused: preempting is
        vLLM's ``Scheduler``'s own work, which the machine over vLLM's own scheduler
        (:mod:`kvoffload.testing.scheduler_machine`) runs; this view of it has none."""
        from vllm.v1.core.sched.scheduler import Scheduler

        flag = require_flag("reset_connector", reset_connector)
        if require_flag("reset_running_requests", reset_running_requests):
            raise InvalidArgumentError(
                "reset_running_requests=True preempts running requests, which vLLM's own "
                "Scheduler does: this connector-level target has none (the machine over "
                "vLLM's scheduler runs it)"
            )
        return bool(Scheduler.reset_prefix_cache(_SchedulerView(self), False, flag))

    def has_pending_stores(self) -> bool:
        return bool(self.manager.has_pending_stores())

    def stats(self) -> OffloadStats:
        """vLLM's ``get_stats()`` (0.31.0 on), drained, as the model's report."""
        from vllm.v1.simple_kv_offload.metrics import MetricName

        data = self.manager.get_stats().data["data"]
        outcomes = {labels: n for labels, n in data.get(MetricName.SAVE_OUTCOMES, {}).items() if n}
        (info,) = data[MetricName.INFO]
        backend, page_cache, lazy, capacity = info
        if (backend, page_cache) != ("cpu", "false"):
            raise AssertionError(f"vLLM reported a {backend} backend, page cache {page_cache}")
        return OffloadStats(
            load_blocks=int(data.get(MetricName.LOAD_BLOCKS, {}).get((), 0)),
            used_blocks=int(data[MetricName.USED_BLOCKS][()]),
            pending_store_blocks=int(data[MetricName.PENDING_STORE_BLOCKS][()]),
            capacity_blocks=int(capacity),
            lazy=lazy == "true",
            save_outcomes=tuple(sorted((label, int(n)) for (label,), n in outcomes.items())),
        )

    def live_requests(self) -> list[str]:
        return [
            r for r, req in self.engine.requests.items() if req.status is not RequestStatus.FINISHED
        ]

    def outstanding(self, kind: str) -> list[tuple[int, int]]:
        if kind not in ("store", "load"):
            raise InvalidArgumentError(f"kind must be 'store' or 'load', got {kind!r}")
        table = self._store_reports if kind == "store" else self._load_reports
        return owed_completions(self.config, self._counter(kind), table)

    def snapshot(self) -> Snapshot:
        return take_snapshot(self.engine)

    def take_events(self) -> list[KVEvent]:
        """vLLM's ``take_events()``, as the model's events: a ``BlockStored`` of one hash
        each (what the offload scheduler publishes), ``BlockRemoved``, ``AllBlocksCleared``."""
        if not self.config.kv_events:
            return []
        return [self._event(e) for e in self.manager.take_events()]

    def _event(self, event: Any) -> KVEvent:
        return model_event(event, self.engine.keys)


def model_event(event: Any, keys: KeyMap) -> KVEvent:
    """A kv-cache event of vLLM's offload manager as the model's: a ``BlockStored`` of one
    hash each (what the offload scheduler publishes), ``BlockRemoved``, ``AllBlocksCleared``."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(event, AllBlocksCleared):
        return KVEvent(CLEARED)
    assert isinstance(event, BlockStored | BlockRemoved), f"unknown event {event!r}"
    assert len(event.block_hashes) == 1, f"an event of several blocks: {event!r}"
    key = keys.external_key(event.block_hashes[0], event.group_idx)
    if isinstance(event, BlockRemoved):
        return KVEvent(REMOVED, key, medium=event.medium)
    parent = event.parent_block_hash
    return KVEvent(
        STORED,
        key,
        None if parent is None else keys.external_digest(parent),
        tuple(event.token_ids),
        event.block_size,
        event.medium,
    )


class _SchedulerView:
    """The fields and methods of vLLM's ``Scheduler`` its ``reset_prefix_cache`` and
    ``reset_connector_cache`` read, over the adapter's objects: nothing running (the
    model's driver preempts no request for a reset), no stats, no auxiliary connector."""

    def __init__(self, target: VllmOffload) -> None:
        self.running: list[Any] = []
        self.log_stats = False
        self.aux_output_connector = None
        self.connector_prefix_cache_stats = None
        self.kv_cache_manager = SimpleNamespace(
            reset_prefix_cache=target.world.gpu_pool.reset_prefix_cache
        )
        # SimpleCPUOffloadConnector.reset_cache on the scheduler side: the manager's reset.
        self.connector = SimpleNamespace(reset_cache=target.manager.reset)

    def reset_connector_cache(self) -> bool:
        from vllm.v1.core.sched.scheduler import Scheduler

        return bool(Scheduler.reset_connector_cache(self))


# -- vLLM's state as a snapshot ---------------------------------------------------------------


def pool_view(pool: Any, keys: KeyMap, stamped_without_count: bool) -> PoolView:
    """A pool as the model's snapshot has it. ``stamped_without_count``: the pool's keys
    are set without their token count when the release keeps none (the CPU pool before
    PR #53532)."""
    # Secondary keys (partial and fine-grained) came with 0.24.0; none before.
    secondary = state(pool, "cached_block_hashes_by_block", {})
    blocks = tuple(
        BlockView(
            b.block_id,
            b.ref_cnt,
            key,
            _token_count(b, key, stamped_without_count),
            tuple(sorted(keys.key(k) for k in secondary.get(b.block_id, ()))),
        )
        for b in pool.blocks
        for key in [keys.model_key(b.block_hash)]
    )
    cached = [(keys.key(vllm_key), ids) for vllm_key, ids in cached_entries(pool)]
    return PoolView(
        blocks=blocks,
        free_queue=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
        cached=tuple(sorted(cached)),
    )


def _token_count(block: Any, key: BlockKey | None, stamped_without_count: bool) -> int | None:
    """The tokens a block's primary key covers. Releases before the count was kept
    (``block_hash_num_tokens``, before 0.24.0) imply it: the key's own count where vLLM
    sets the key with ``set_block_hash`` (the GPU pool), none where it stamps the key
    directly (the CPU pool of those releases)."""
    if hasattr(block, "block_hash_num_tokens"):
        count: int | None = block.block_hash_num_tokens
        return count
    return None if key is None or stamped_without_count else key.num_tokens


def _transfer(event: int | None, transfer: Any) -> TransferView:
    return TransferView(event, tuple(transfer.gpu_block_ids), tuple(transfer.cpu_block_ids))


def _load(state: Any) -> LoadView:
    return LoadView(
        state.request.request_id, _transfer(state.load_event, state.transfer_meta), state.finished
    )


def take_snapshot(engine: VllmEngine) -> Snapshot:
    requests = tuple(
        RequestView(
            req_id,
            req.status.value,
            req.vllm.num_tokens,
            req.vllm.num_computed_tokens,
            tuple(req.vllm.output_token_ids),
            tuple(tuple(ids) for ids in engine.req_to_blocks.get(req_id, [])),
        )
        for req_id, req in sorted(engine.vllm_requests().items())
    )
    return manager_snapshot(engine.world.scheduler, engine.world.gpu_pool, engine.keys, requests)


def manager_snapshot(
    m: Any, gpu_pool: Any, keys: KeyMap, requests: tuple[RequestView, ...]
) -> Snapshot:
    """The snapshot of vLLM's offload manager ``m`` over ``gpu_pool``, with the request
    views of whoever schedules (the model's engine, or vLLM's own scheduler)."""
    return Snapshot(
        gpu=pool_view(gpu_pool, keys, stamped_without_count=False),
        cpu=pool_view(m.cpu_block_pool, keys, stamped_without_count=True),
        requests=requests,
        tracked=tuple(
            StoreTrackView(
                req_id,
                tuple(s.num_stored_blocks),
                tuple(tuple(ids) for ids in s.block_ids),
                tuple(sorted(s.store_events)),
                s.finished,
            )
            for req_id, s in sorted(m._reqs_to_store.items())
        ),
        pending_flushes=tuple(_transfer(None, t) for t in queued_final_flushes(m)),
        store_events=tuple(_transfer(e, t) for e, t in sorted(m._store_event_to_blocks.items())),
        abandoned_store_events=tuple(
            _transfer(e, t)
            for e, t in sorted(state(m, "_abandoned_store_event_to_blocks", {}).items())
        ),
        store_event_pending_counts=tuple(sorted(m._store_event_pending_counts.items())),
        store_event_requests=tuple(
            (e, tuple(reqs)) for e, reqs in sorted(m._store_event_to_reqs.items())
        ),
        # Before PR #41289 (0.22.0) deduplication lived for one step: nothing in between.
        in_flight_gpu_blocks=tuple(sorted(state(m, "_in_flight_store_gpu_blocks", ()))),
        loads=tuple(_load(s) for _, s in sorted(m._reqs_to_load.items())),
        abandoned_loads=tuple(
            _load(s) for _, s in sorted(state(m, "_abandoned_reqs_to_load", {}).items())
        ),
        pending_hits=tuple(
            (req_id, tuple(b.block_id for g in hit[0] for b in g), hit[1])
            for req_id, hit in sorted(state(m, "_pending_cpu_hits", {}).items())
        ),
        load_event_to_reqs=tuple(
            (e, tuple(reqs)) for e, reqs in sorted(m._load_event_to_reqs.items())
        ),
        store_event_counter=m._store_event_counter,
        load_event_counter=m._load_event_counter,
        has_pending_stores=m.has_pending_stores(),
    )
