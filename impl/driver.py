"""``OffloadImpl``: the implementation behind the same driver API and snapshot as the
model (``kvoffload.model.OffloadModel``), with real KV bytes moved by workers.

``faults`` selects variants from :data:`kvoffload.impl.faults.FAULTS`. ``layout=None``
runs the scheduler alone, without tensors (for scheduler benchmarks). ``device`` is where
the "GPU" blocks live: ``cuda`` when available, else host memory. ``lockstep=True`` makes
every copy of a step complete before the step returns, on the caller's thread (no copy
thread is started), in the copy engine's order: what the conformance machine drives.

Invariants kept: the driver API is the model's, call for call and signature for signature
(``tests/test_driver_parity.py`` holds the two to each other); INPUT (``docs/spec.md``):
every call is checked by :mod:`kvoffload.model.validate`, the model's own checks, before
anything changes, so that the same bad call raises the same error with the same message on
both; a configuration whose KV would pass ``MAX_KV_BYTES`` is refused before any tensor is
allocated or any copy thread started (:func:`kvoffload.impl.worker.require_kv_fits`).
"""

from __future__ import annotations

import weakref
from collections.abc import Container, Sequence

import torch

from kvoffload.impl.connector import Connector
from kvoffload.impl.content import layer_bytes, tensor_bytes, token_seeds
from kvoffload.impl.engine import ImplEngine, ImplRequest, Status
from kvoffload.impl.faults import FAULTS
from kvoffload.impl.pool import Pool, block_key
from kvoffload.impl.snapshot import Views
from kvoffload.impl.validation import Validation
from kvoffload.impl.worker import KVLayout, Worker, require_kv_fits
from kvoffload.model.catalogue import canonical
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, InvalidArgumentError
from kvoffload.model.limits import brief
from kvoffload.model.snapshot import Snapshot
from kvoffload.model.types import NO_EVENT, FinishResult, KVEvent, OffloadStats, StepResult
from kvoffload.model.validate import (
    owed_completions,
    require_damageable,
    require_flag,
    require_int,
    require_live_request,
    require_request_id,
    require_resettable,
    require_token_budget,
    require_tokens,
)

DEFAULT_LAYOUT = KVLayout()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _damaged_in(impl: OffloadImpl | None, cpu_ids: list[int]) -> set[int]:
    return set() if impl is None else impl._damaged(cpu_ids)


def _compose(base: type, chosen: list[type], name: str) -> type:
    if not chosen:
        return base
    return type(name, (*chosen, base), {})


def _fault_names(faults: Sequence[str]) -> tuple[str, ...]:
    """The fault names of the catalogue ``faults`` names, taken in one pass (a sequence that
    changes between two iterations is read once: the names checked are the names used)."""
    if isinstance(faults, (str, bytes)) or not isinstance(faults, Sequence):
        raise ConfigError(f"faults must be a sequence of fault names, got {brief(faults)}")
    given = tuple(faults)
    for name in given:
        if not isinstance(name, str):
            raise ConfigError(f"a fault name must be a str, got {brief(name)}")
    names = tuple(canonical(name) for name in given)  # an old name reads as the bug's id
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise ConfigError(f"unknown faults {brief(unknown)}; known: {sorted(FAULTS)}")
    return names


class OffloadImpl:
    def __init__(
        self,
        config: OffloadConfig,
        faults: Sequence[str] = (),
        layout: KVLayout | None = DEFAULT_LAYOUT,
        device: str | torch.device | None = None,
        lockstep: bool = False,
    ) -> None:
        names = _fault_names(faults)
        if layout is not None:
            require_kv_fits(config, layout)  # before any tensor or thread
        self.config = config
        self.faults = names
        classes = [FAULTS[f].cls for f in names]
        connector = _compose(Connector, [c for c in classes if issubclass(c, Connector)], "C")
        worker = _compose(Worker, [c for c in classes if issubclass(c, Worker)], "W")
        checks = _compose(Validation, [c for c in classes if issubclass(c, Validation)], "V")
        self.validation: Validation = checks(config)
        self.engine = ImplEngine(config, connector)
        self.device = torch.device(device) if device is not None else default_device()
        self.workers: list[Worker] = (
            []
            if layout is None
            else [
                worker(config, layout, rank, self.device, lockstep)
                for rank in range(config.world_size)
            ]
        )
        self._views = Views()
        self._data_clean: tuple[object, ...] | None = None  # the state last found right
        self._store_reports: dict[int, set[int]] = {}
        self._load_reports: dict[int, set[int]] = {}
        if self.workers:
            # A weak reference: the implementation and its connector form no cycle, so that
            # a dropped implementation is freed (and its copy threads stopped) at once, on
            # the dropping thread, never by a collection that runs on a copy thread.
            this = weakref.ref(self)
            self.connector.integrity_check = lambda ids: _damaged_in(this(), ids)
        # The data check's memory: seeds behind each key seen, expected bytes per layer.
        self._fully_indexed: set[str] = set()
        self._key_seeds: dict[str, list[int]] = {}
        self._expected_bytes: dict[str, bytes] = {}

    @property
    def connector(self) -> Connector:
        return self.engine.connector

    def close(self) -> None:
        """Stop every copy thread the workers started (idempotent). Dropping the
        implementation does it too, when it is collected."""
        for w in self.workers:
            w.close()

    def __enter__(self) -> OffloadImpl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the driver API -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int = 1,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        tokens = self.validation.new_request(
            request_id, prompt, max_tokens, self.engine.requests, skip_reading_prefix_cache
        )
        self.engine.add(request_id, tokens, max_tokens, skip_reading_prefix_cache)

    def step(self, token_budget: int) -> StepResult:
        require_token_budget(token_budget)
        for w in self.workers:
            w.begin_step()
        ranges, loading, scheduled, preempted = self.engine.step(token_budget)
        # The connector hears of the requests a prefix-cache reset preempted with the step's.
        told = [*preempted, *self.engine.take_reset_preempted()]
        meta = self.connector.build_meta(scheduled, told, self.engine.take_offers())
        for w in self.workers:
            for rid, (start, end) in ranges.items():
                req = self.engine.requests[rid]
                w.write_tokens(rid, req.tokens, self.engine.tables[rid], start, end)
            if meta.load_event != NO_EVENT:
                w.submit_load(meta.load_event, meta.load_gpu_blocks, meta.load_cpu_blocks)
            if meta.store_event != NO_EVENT:
                w.submit_store(meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks)
            w.end_step()
        finished = self.engine.sample(ranges)
        return StepResult(ranges, tuple(loading), tuple(finished), meta, tuple(preempted))

    def finish(self, request_id: str) -> FinishResult:
        req = self.engine.requests.get(require_request_id(request_id))
        require_live_request(request_id, None if req is None else req.status)
        flush = self.engine.finish(request_id)
        if flush is None:
            return FinishResult(request_id)
        return FinishResult(
            request_id,
            tuple(flush.gpu),
            tuple(flush.cpu),
        )

    def complete_store(self, event: int, worker: int = 0) -> bool:
        """Worker ``worker`` reports store ``event`` (after waiting for its copy); True when
        every worker has."""
        return self._report_store(event, worker, failed=False)

    def fail_store(self, event: int, worker: int = 0) -> bool:
        """Worker ``worker`` reports that its copy of store ``event`` failed (an injected
        fault): once every worker has reported, the store is dropped, never registered."""
        return self._report_store(event, worker, failed=True)

    def _report_store(self, event: int, worker: int, failed: bool) -> bool:
        reported = self._accept("store", event, worker)
        live = self.connector.stores.get(event)
        dropped = failed or event in self.connector.failed
        self.connector.report(set(), {event: 1}, frozenset({event}) if failed else frozenset())
        if live is not None and event not in self.connector.stores and not dropped:
            for w in self.workers:
                w.seal(live.cpu)
        return len(reported) == self.config.world_size

    def corrupt(self, cpu_block: int, worker: int = 0) -> None:
        """Damage the bytes of cached CPU block ``cpu_block`` on worker ``worker`` (an
        injected fault); the lookup that reaches it must find it out (``_damaged``)."""
        cpu = self.connector.cpu

        def state(block_id: int) -> tuple[object | None, int]:
            return cpu.key[block_id], cpu.ref[block_id]

        require_damageable(self.config, cpu_block, worker, state)
        if self.workers:
            self.workers[worker].settle()
            self.workers[worker].corrupt(cpu_block)

    def _damaged(self, cpu_ids: list[int]) -> set[int]:
        """The CPU blocks whose bytes fail their checksum on some worker."""
        found: set[int] = set()
        for w in self.workers:
            w.settle()
            found |= w.damaged(cpu_ids)
        return found

    def complete_load(self, event: int, worker: int = 0) -> tuple[str, ...]:
        """Worker ``worker`` reports load ``event`` (after waiting for its copy); returns the
        requests whose load is complete on every worker (empty until the last reports)."""
        reported = self._accept("load", event, worker)
        if len(reported) < self.config.world_size:
            return ()
        finished = tuple(self.connector.load_events.get(event, ()))
        self.engine.loads_done(set(finished))
        return finished

    def _accept(self, kind: str, event: int, worker: int) -> set[int]:
        """Validate a completion, wait for that worker's copy, record the report."""
        table = self._store_reports if kind == "store" else self._load_reports
        counter = (
            self.connector.next_store_event if kind == "store" else self.connector.next_load_event
        )
        # The event is looked up below: an int first (the first check the validation makes,
        # so the same message), never an unhashable value raising TypeError from the table.
        require_int("event", event, 0)
        reported = table.get(event, set())
        self.validation.completion(kind, event, worker, counter, reported)
        if self.workers:
            w = self.workers[worker]
            (w.wait_store if kind == "store" else w.wait_load)(event)
        table[event] = reported | {worker}
        return table[event]

    def complete_all(self) -> tuple[str, ...]:
        """Every worker reports every store and load still owed, in one output (each copy
        waited for first): the loads' CPU blocks released, then the stores processed, then
        the loaded requests' GPU blocks, as the model's ``complete_all``; returns the
        requests whose loads are now complete."""
        owed_loads, owed_stores = self.outstanding("load"), self.outstanding("store")
        for event, rank in owed_loads:
            if self.workers:
                self.workers[rank].wait_load(event)
        stores: dict[int, int] = {}
        for event, rank in owed_stores:
            if self.workers:
                self.workers[rank].wait_store(event)
            stores[event] = stores.get(event, 0) + 1
        everyone = set(range(self.config.world_size))
        finished: list[str] = []
        for event in sorted({event for event, _ in owed_loads}):
            self._load_reports[event] = set(everyone)
            finished += self.connector.load_events.get(event, ())
        for event in stores:
            self._store_reports[event] = set(everyone)
        # The stores this output completes whole, and not dropped, are sealed after it.
        live = {
            event: copy
            for event in stores
            if (copy := self.connector.stores.get(event)) is not None
            and event not in self.connector.failed
        }
        self.engine.worker_output(set(finished), stores)
        for event, copy in live.items():
            if event not in self.connector.stores:
                for w in self.workers:
                    w.seal(copy.cpu)
        return tuple(sorted(finished))

    def ready(self, kind: str) -> list[tuple[int, int]]:
        """Outstanding (event, worker) completions whose copies have finished: polled, never
        waited for, as a worker reports them each step."""
        pending = self.outstanding(kind)
        if not self.workers:
            return pending
        copies = [w.stores if kind == "store" else w.loads for w in self.workers]
        return [(e, w) for e, w in pending if e not in copies[w] or copies[w][e].done()]

    def lookup(self, tokens: Sequence[int]) -> int:
        prompt = require_tokens(tokens)
        probe = ImplRequest("", prompt, 1, self.config)
        return self.connector.lookup(probe.block_keys(), len(prompt) - 1)

    def reset(self) -> bool:
        return self.connector.reset()

    def reset_prefix_cache(
        self, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache``: with ``reset_running_requests`` every
        running request preempted first; the GPU prefix cache cleared when no block is in
        use, then the connector's reset if asked; True only if neither tier serves a hit
        afterwards (vLLM issue #57727). A reset whose preemption cannot free a block a load or
        a transfer holds is refused before anything changes (vLLM preempts, then raises)."""
        flag = require_flag("reset_connector", reset_connector)
        running = require_flag("reset_running_requests", reset_running_requests)
        require_resettable(self.engine.blocks_kept_from_reset() if running else [])
        return self.engine.reset_prefix_cache(flag, running)

    def has_pending_stores(self) -> bool:
        return self.connector.pending()

    def stats(self) -> OffloadStats:
        return self.connector.stats()

    def live_requests(self) -> list[str]:
        return [r for r, q in self.engine.requests.items() if q.status is not Status.FINISHED]

    def outstanding(self, kind: str) -> list[tuple[int, int]]:
        if kind == "store":
            counter, table = self.connector.next_store_event, self._store_reports
        elif kind == "load":
            counter, table = self.connector.next_load_event, self._load_reports
        else:
            raise InvalidArgumentError(f"kind must be 'store' or 'load', got {brief(kind)}")
        return owed_completions(self.config, counter, table)

    def snapshot(self) -> Snapshot:
        """The state as the model's snapshot shows it; the same object as the last one when
        nothing shown has changed."""
        return self._views.snapshot(self.engine)

    def take_events(self) -> list[KVEvent]:
        """The kv-cache events of the CPU tier since the last call (none unless
        ``OffloadConfig.kv_events``)."""
        return self.engine.connector.take_events()

    # -- data integrity -------------------------------------------------------------------

    def data_mismatches(self, exempt: frozenset[int] = frozenset()) -> list[str]:
        """:meth:`check_data`, skipped when nothing it reads has changed since it last found
        every block right: no tensor written (torch's version counters), no key moved, no
        request grown, the same blocks busy or exempt."""
        if not self.workers:
            return []
        state = self._data_state(exempt)
        if state == self._data_clean:
            return []
        problems = self.check_data(exempt)
        self._data_clean = None if problems else state
        return problems

    def _data_state(self, exempt: frozenset[int]) -> tuple[object, ...]:
        pools = (self.connector.cpu, self.engine.gpu)
        return (
            exempt,
            tuple(b for load in self.connector.loads.values() for b in load.copy.gpu),
            tuple((rid, req.num_tokens) for rid, req in self.engine.requests.items()),
            *(
                (tuple(p.key), tuple(p.index.items()), tuple((k, *v) for k, v in p.dups.items()))
                for p in pools
            ),
            *(
                (frozenset(w.settle()), *(t._version for t in (*w.gpu_blocks, *w.cpu_blocks)))
                for w in self.workers
            ),
        )

    def check_data(self, exempt: frozenset[int] = frozenset()) -> list[str]:
        """Every registered CPU block and every keyed full GPU block whose bytes differ from
        the content function of its key, on every worker. Keys are those of every request
        this driver has seen, finished ones included; a block's expected bytes are computed
        once per key, since they are a function of the key alone. CPU blocks in
        ``exempt`` (damaged on purpose, not yet found out) are not checked, nor GPU blocks a
        load or a worker's queued KV write is still to fill."""
        if not self.workers:
            return []
        self._index_keys()
        loading = {b for load in self.connector.loads.values() for b in load.copy.gpu}
        layers = self.workers[0].layout.num_layers
        # The blocks to check per side and group, with their keys: the same on every worker.
        sides = [
            ("cpu", self._checked_blocks(self.connector.cpu, exempt)),
            ("gpu", self._checked_blocks(self.engine.gpu, loading)),
        ]
        problems: list[str] = []
        for w in self.workers:
            busy = w.settle()
            for side, checked in sides:
                tensors = w.cpu_blocks if side == "cpu" else w.gpu_blocks
                for group, found in checked.items():
                    # The group's blocks from the first checked to the last as bytes, one
                    # copy, each block a slice of it: a comparison of bytes per block costs
                    # less than a tensor operation.
                    first, last = found[0][0], found[-1][0]
                    held = tensor_bytes(tensors[group][first : last + 1])
                    row = len(held) // (last + 1 - first)
                    for block, key in found:
                        at = (block - first) * row
                        have, want = held[at : at + row], self._expected(key)
                        if have == want or (side == "gpu" and block in busy):
                            continue
                        span = row // layers
                        problems += [
                            f"worker {w.rank} {side} block {block} layer {layer} "
                            f"does not hold the KV of {block_key(key)}"
                            for layer in range(layers)
                            if have[layer * span : (layer + 1) * span]
                            != want[layer * span : (layer + 1) * span]
                        ]
        return problems

    def _checked_blocks(self, pool: Pool, skip: Container[int]) -> dict[int, list[tuple[int, str]]]:
        """Per group, the blocks of ``pool`` whose bytes are known, in id order with their
        keys: not in ``skip``, keyed by a full block of a request seen, registered under
        that key."""
        sizes = self.config.group_block_sizes
        checked: dict[int, list[tuple[int, str]]] = {}
        for block in range(1, pool.num_blocks):
            key = pool.key[block]
            if key is None or block in skip or key not in self._key_seeds:
                continue
            shared = block_key(key)
            if pool.has(key, block) and not shared.num_tokens % sizes[shared.group]:
                checked.setdefault(shared.group, []).append((block, key))
        return checked

    def _index_keys(self) -> None:
        """Record the token seeds behind every full-block key of the requests seen so far.
        A live request is looked at on every call (decode adds keys); a finished one's
        tokens no longer change, so it is indexed one last time and then skipped."""
        for rid, req in self.engine.requests.items():
            if rid in self._fully_indexed:
                continue
            seeds: list[int] | None = None
            for keys in req.block_keys():
                for key in keys:
                    if key in self._key_seeds:
                        continue
                    if seeds is None:
                        seeds = token_seeds(req.tokens)
                    shared = block_key(key)
                    size = self.config.group_block_sizes[shared.group]
                    self._key_seeds[key] = seeds[shared.num_tokens - size : shared.num_tokens]
            if req.status is Status.FINISHED:
                self._fully_indexed.add(rid)

    def _expected(self, key: str) -> bytes:
        """The bytes of a full block under ``key``, every layer in turn (a block's row)."""
        found = self._expected_bytes.get(key)
        if found is None:
            layout = self.workers[0].layout
            group = block_key(key).group
            found = tensor_bytes(
                layer_bytes(self._key_seeds[key], group, layout.num_layers, layout.bytes_per_token)
            )
            self._expected_bytes[key] = found
        return found
