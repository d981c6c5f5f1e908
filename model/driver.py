"""The driver API: what a test, the conformance machine or a person calls step by step.

:class:`OffloadModel` validates every call before it changes anything, so that bad input
raises a :class:`~kvoffload.model.errors.KVOffloadError` naming the problem and leaves
the state unchanged. With ``check=True`` every call ends with ``check()`` of all
invariants.

Invariants kept: INPUT (``docs/spec.md``: every call is checked by
:mod:`kvoffload.model.validate` in full before the engine sees it, a sequence taken once and
the taken tuple used, an id a str before it is looked up, every size within
:mod:`kvoffload.model.limits`); the implementation (``kvoffload.impl.OffloadImpl``) takes
the very same calls, with the same signatures (``tests/test_driver_parity.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import REDUCED_SCHEDULING, Engine, RequestStatus, Scheduling
from kvoffload.model.errors import (
    ConfigError,
    InvalidArgumentError,
)
from kvoffload.model.invariants import check
from kvoffload.model.keys import prefix_digests
from kvoffload.model.limits import brief
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.observe import take_snapshot
from kvoffload.model.snapshot import Snapshot
from kvoffload.model.types import FinishResult, KVEvent, OffloadStats, StepResult
from kvoffload.model.validate import (
    owed_completions,
    require_completion,
    require_damageable,
    require_flag,
    require_int,
    require_live_request,
    require_new_request,
    require_request_id,
    require_resettable,
    require_token_budget,
    require_tokens,
)
from kvoffload.model.variants import VARIANTS, is_variant, scheduler_class


class OffloadModel:
    """The model of one engine with eager CPU offloading, driven call by call."""

    def __init__(
        self,
        config: OffloadConfig,
        variant: str = "fixed",
        check: bool = False,
        scheduling: Scheduling = REDUCED_SCHEDULING,
    ) -> None:
        """``scheduling``: where the engine follows vLLM 0.34.0's own scheduler and KV cache
        manager (:class:`~kvoffload.model.engine.Scheduling`: admission gates and order, key
        registration; none by default, all in
        :data:`~kvoffload.model.engine.VLLM_SCHEDULING`)."""
        if not is_variant(variant):
            raise ConfigError(f"unknown variant {brief(variant)}; known: {sorted(VARIANTS)}")
        self.config = config
        self.variant = variant
        self.engine = Engine(config, scheduler_class(variant), scheduling)
        self.checked = check
        self._store_reports: dict[int, set[int]] = {}
        self._load_reports: dict[int, set[int]] = {}

    # -- calls ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int = 1,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        """Queue a request; it decodes ``max_tokens`` tokens after its prompt, then finishes.
        ``skip_reading_prefix_cache`` (vLLM's sampling parameter, set for requests that want
        prompt logprobs): no prefix-cache hit is read for it, on the GPU or the CPU; its
        blocks are cached and stored as any request's."""
        tokens = require_new_request(
            self.config,
            request_id,
            prompt,
            max_tokens,
            self.engine.requests,
            skip_reading_prefix_cache,
        )
        self._begin()
        self.engine.add_request(request_id, tokens, max_tokens, skip_reading_prefix_cache)
        self._end()

    def step(self, token_budget: int) -> StepResult:
        """One engine step with at most ``token_budget`` tokens computed."""
        require_token_budget(token_budget)
        self._begin()
        result = self.engine.step(token_budget)
        self._end()
        return result

    def finish(self, request_id: str) -> FinishResult:
        """Finish (abort) a request now: final flush, connector cleanup, GPU blocks freed."""
        self._known_live_request(request_id)
        self._begin()
        transfer = self.engine.finish_request(request_id)
        self._end()
        if transfer is None:
            return FinishResult(request_id)
        return FinishResult(
            request_id, tuple(transfer.gpu_block_ids), tuple(transfer.cpu_block_ids)
        )

    def complete_store(self, event: int, worker: int = 0) -> bool:
        """Worker ``worker`` reports store ``event`` done; True when all workers have."""
        return self._report_store(event, worker, failed=False)

    def fail_store(self, event: int, worker: int = 0) -> bool:
        """Worker ``worker`` reports that its copy of store ``event`` failed (an injected
        fault). Once every worker has reported, the store is dropped: its CPU blocks go back
        unregistered, as an abandoned store's do. True when all workers have reported."""
        return self._report_store(event, worker, failed=True)

    def _report_store(self, event: int, worker: int, failed: bool) -> bool:
        counter = self.engine.connector.store_event_counter
        reports = self._completion("store", event, worker, counter, self._store_reports)
        self._begin()
        reports.add(worker)
        self.engine.store_completed(event, 1, failed)
        self._end()
        return len(reports) == self.config.world_size

    def corrupt(self, cpu_block: int, worker: int = 0) -> None:
        """Damage the bytes of cached CPU block ``cpu_block`` on worker ``worker`` (an
        injected fault: a stray write, a bad page). The integrity contract: the block is
        never loaded; the first lookup that reaches it evicts it (``docs/spec.md``)."""
        pool = self.engine.connector.cpu_pool

        def state(block_id: int) -> tuple[object | None, int]:
            block = pool.blocks[block_id]
            return block.block_hash, block.ref_cnt

        require_damageable(self.config, cpu_block, worker, state)
        self._begin()
        pool.damaged.add(cpu_block)
        self._end()

    def complete_load(self, event: int, worker: int = 0) -> tuple[str, ...]:
        """Worker ``worker`` reports load ``event`` done; returns the requests whose load is
        now complete on every worker (empty until the last worker reports)."""
        counter = self.engine.connector.load_event_counter
        reports = self._completion("load", event, worker, counter, self._load_reports)
        self._begin()
        reports.add(worker)
        finished: tuple[str, ...] = ()
        if len(reports) == self.config.world_size:
            finished = self.engine.connector.load_event_to_reqs_for(event)
            self.engine.loads_finished(set(finished))
        self._end()
        return finished

    def complete_all(self) -> tuple[str, ...]:
        """Every worker reports every store and load still owed, in one output
        (:meth:`report`); returns the requests whose loads are now complete."""
        loads = sorted({event for event, _ in self.outstanding("load")})
        return self._report(loads, self.outstanding("store"))

    def _report(self, loads: Sequence[int], stores: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """One output of the workers, as vLLM's scheduler takes a step's
        ``KVConnectorOutput``: the load events ``loads`` finished on every worker (vLLM's
        executor passes a request's load up once all its workers report it), and the
        (event, worker) store reports ``stores`` (summed per event, as the workers' metadata
        aggregates); the loads' CPU blocks released, then the stores processed, then the
        loaded requests' GPU blocks. Returns the requests whose loads are now complete. A
        report not owed is refused before anything changes."""
        owed_loads = {event for event, _ in self.outstanding("load")}
        owed_stores = set(self.outstanding("store"))
        for event in loads:
            if event not in owed_loads or list(loads).count(event) > 1:
                raise InvalidArgumentError(f"load event {brief(event)} is not owed once")
        for report in stores:
            if report not in owed_stores or list(stores).count(report) > 1:
                raise InvalidArgumentError(f"store report {brief(report)} is not owed once")
        self._begin()
        finished: list[str] = []
        for event in sorted(loads):
            self._load_reports[event] = set(range(self.config.world_size))
            finished += self.engine.connector.load_event_to_reqs_for(event)
        counts: dict[int, int] = {}
        for event, worker in sorted(stores):
            self._store_reports.setdefault(event, set()).add(worker)
            counts[event] = counts.get(event, 0) + 1
        self.engine.worker_output(set(finished), counts)
        self._end()
        return tuple(sorted(finished))

    def lookup(self, tokens: Sequence[int]) -> int:
        """Tokens of a prompt the CPU pool would serve now (read-only: pins nothing, evicts
        nothing). A damaged block is not served, so the lookup passes over it as the
        scheduler's would after evicting it (``OffloadScheduler._intact_hit``)."""
        prompt = require_tokens(tokens)
        digests = prefix_digests(prompt, self.config.hash_block_size)
        pool = self.engine.connector.cpu_pool
        _, hit = find_longest_cache_hit(
            pool, digests, 0, len(prompt) - 1, self.config, skip=pool.damaged
        )
        return hit

    def reset(self) -> bool:
        """The connector's ``reset()``: True when the CPU cache could be cleared."""
        self._begin()
        result = self.engine.connector.reset()
        self._end()
        return result

    def reset_prefix_cache(
        self, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache``: with ``reset_running_requests`` (a
        trainer's weight update in the middle of generation) every running request is
        preempted first; the GPU prefix cache is cleared if no block is in use, then, with
        ``reset_connector``, the connector's ``reset()``. True only if afterwards neither tier
        serves a hit: without ``reset_connector`` a CPU tier that still holds keys makes it
        False (vLLM issue #57727: vLLM reports the GPU's reset alone). Preempting cannot free
        a block a load or a transfer holds: such a reset is refused before anything changes
        (vLLM preempts, then raises)."""
        flag = require_flag("reset_connector", reset_connector)
        running = require_flag("reset_running_requests", reset_running_requests)
        require_resettable(self.engine.blocks_kept_from_reset() if running else [])
        self._begin()
        result = self.engine.reset_prefix_cache(flag, running)
        self._end()
        return result

    def has_pending_stores(self) -> bool:
        return self.engine.connector.has_pending_stores()

    def stats(self) -> OffloadStats:
        """The connector's stats, drained (vLLM's ``get_stats``, what a metrics logger reads
        once an interval): loads completed since the previous drain, CPU blocks in use and
        held by stores not yet completed."""
        self._begin()
        result = self.engine.connector.stats()
        self._end()
        return result

    def live_requests(self) -> list[str]:
        """Requests added and not finished, in the order they were added."""
        return [
            r for r, req in self.engine.requests.items() if req.status is not RequestStatus.FINISHED
        ]

    def outstanding(self, kind: str) -> list[tuple[int, int]]:
        """The (event, worker) completions of ``kind`` ("store" or "load") still owed."""
        if kind == "store":
            counter, table = self.engine.connector.store_event_counter, self._store_reports
        elif kind == "load":
            counter, table = self.engine.connector.load_event_counter, self._load_reports
        else:
            raise InvalidArgumentError(f"kind must be 'store' or 'load', got {brief(kind)}")
        return owed_completions(self.config, counter, table)

    def snapshot(self) -> Snapshot:
        return take_snapshot(self.engine)

    def take_events(self) -> list[KVEvent]:
        """The kv-cache events of the CPU tier since the last call, in the order they were
        published (none unless ``OffloadConfig.kv_events``)."""
        return self.engine.connector.take_events()

    def check(self) -> None:
        """Check every invariant; raise the first violation, naming its ID."""
        check(self.engine)

    # -- validation -------------------------------------------------------------------------

    def _known_live_request(self, request_id: str) -> None:
        req = self.engine.requests.get(require_request_id(request_id))
        require_live_request(request_id, None if req is None else req.status)

    def _completion(
        self, kind: str, event: int, worker: int, counter: int, table: dict[int, set[int]]
    ) -> set[int]:
        # The event is looked up in the table: an int first (the first check the contract
        # makes, so the same message), never an unhashable value raising TypeError.
        require_int("event", event, 0)
        require_completion(self.config, kind, event, worker, counter, table.get(event, set()))
        reports = table.setdefault(event, set())
        return reports

    def _begin(self) -> None:
        self.engine.connector.clear_logs()

    def _end(self) -> None:
        if self.checked:
            check(self.engine)
