"""The named invariants of the model, and ``check(state)`` that checks them all.

Each invariant has an ID, one line here and one row in ``docs/spec.md``. ``violations``
returns every violation found; ``check`` raises the first as an
:class:`~kvoffload.model.errors.InvariantViolation` naming its ID. State invariants hold
between any two driver calls; transition invariants (POOL-FRESH, SKIP, CAPACITY,
REGISTERED, RESET) are checked on the ghost records of the last driver call.

- POOL-QUEUE: a non-null block is queued iff its ref count is 0; no duplicates, never
  the null block, no negative ref count.
- POOL-MAP: every (key, block) in a map is that block's primary or secondary key; every
  secondary key is mapped, its block has a primary, and it is not that primary.
- POOL-PRIMARY: the primary key of a free hashed block is mapped to that block.
- POOL-NULL: the null block holds no key.
- POOL-FRESH: a newly allocated block has ref count 1 and no key at all.
- REF-GPU: a GPU block's ref count equals its holders: request block tables, store
  transfers (queued, in flight, abandoned) and loads (pending, in flight, abandoned).
- REF-CPU: a CPU block's ref count equals its holders: lookup pins, loads, and the store
  (queued, in flight, abandoned) it is the destination of.
- KEYS: each cached full GPU block of a request carries that request's key for its position
  (a sliding-window block where no hit can end carries none).
- SKIP: a selected GPU block is not null, is hashed, was not in flight, its key was not in
  the CPU map, and its position lies within the request's confirmed tokens (whole scheduler
  blocks of its computed tokens when the scan ran).
- CAPACITY: a selection takes at most as many blocks as the CPU pool had free.
- UNREACHABLE: the CPU destination of a store that has not completed holds no mapped key,
  nor does that of a store dropped because a worker's copy failed.
- REGISTERED: a completed store maps the GPU block's primary (with its token count) and
  every secondary key to the CPU block, which is free.
- PENDING: has_pending_stores() iff a flush is queued or a store is in flight or abandoned.
- IN-FLIGHT: the in-flight set equals the GPU blocks of queued flushes and in-flight events
  (eager mode); lazy mode keeps none (a lazy store's pin keeps its block out of the queue).
- RESET: after reset no flush is queued; it returned True iff nothing was abandoned and the
  CPU pool was idle, and then the CPU pool holds no key.
- EVENTS: events are issued in order without reuse, every known event is below its
  counter, each store event is processed once, partial counts stay below world_size.
- FLUSH-COMPLETE: a tracked request's finish leaves every confirmed block with a
  disposition: stored, present, in flight, null, unhashed or dropped for capacity.
- LOAD-PINNED: CPU blocks pinned by a lookup or a load are in use and mapped by their primary.
- INTEGRITY: a damaged block (an injected fault) is a CPU block that still holds its key and
  is not in use: no lookup pinned it and no load reads it.
- NO-READ: a request that skips reading the prefix cache holds no CPU hit and has no load.
- LAZY-SCAN: a lazy selection takes, in queue order, every cached block of the first
  ``lazy_target_free`` of the GPU free queue whose key the CPU pool does not hold, until as
  many as the CPU pool had free are taken; it takes nothing else.
- LAZY-EVICT-FIRST: the GPU blocks of a completed lazy store that become free are the first
  blocks of the GPU free queue, in their store's order.
- WINDOW: in a sliding-window group's table the null block is a prefix no longer than the
  blocks wholly before the window of the request's computed tokens; a full-attention table
  holds no null.
- MAMBA: a Mamba group's table holds at most two blocks that are not null (the running
  state's, at its end, and the one it is copied from until the next allocation).
- BOUNDARY: a boundary-state hand-off is stored only for a live tracked request (not
  finished, not preempted in the step), its block not null, keyed, not in flight, its key
  not in the CPU map; it is dropped as its request's being gone only when it is.
- TAIL: with fine-grained CPU hits, a final flush takes the block holding the request's
  prompt tail (the first full-attention group's, inside a block) exactly when the block holds
  the tail's key, is not in flight, was not selected by the scan, the CPU map lacks the key
  and the CPU pool has a block free past the scan's.
- RECOVER: a store scan passes over a null position as null only when the GPU pool caches no
  block under its key; otherwise it takes the cached block in its place.
- POSITION: a block a store scan takes for a position of a request holds that position's key
  (a sliding window's block, freed and reused by another position, is not that position's).
- TABLE: the store state of a running tracked request names its blocks: as many per group as
  its block table, the same block wherever the table holds one (a sliding window's nulls
  stand where the state still names the block that left); a preempted one names none (until
  a load brings its blocks back: then it waits for its next schedule, as a waiting one).
- LOAD-TARGET: a load writes no GPU null block, and each block it writes is the one the
  loading request's table holds in the group and at the position of the key of the CPU block
  it reads (a chunked local hit after a prefix that ends inside a chunk, S24, writes into
  the null block the table holds for a chunk already left).
- EVENT-STORED: a ``stored`` kv-cache event names a key the CPU map holds when it is
  published; the tokens it carries (if any) are ``block_size`` many and, chained from its
  parent digest in hash blocks, give that key's digest.
- STATS: a drain of the stats reports the GPU blocks of the sent loads completed since the
  previous drain, the CPU blocks in use, the CPU blocks of the stores not completed, and per
  outcome the boundary-state hand-offs decided since the previous drain.
- QUEUES: the waiting and running queues partition the live requests; a request queued as
  holding blocks (its load started) is waiting and holds blocks; a load's reservation is of
  a waiting request, a prefill's of a running one (:class:`~kvoffload.model.engine.Scheduling`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from kvoffload.model.block_pool import BlockPool
from kvoffload.model.engine import Engine, RequestStatus
from kvoffload.model.errors import InvariantViolation
from kvoffload.model.keys import ROOT_DIGEST, block_keys, chain_digest
from kvoffload.model.offload import Outcome, Transfer


def _stores(state: Engine) -> list[Transfer]:
    c = state.connector
    return [
        *c.pending_finished_stores,
        *c.store_event_to_blocks.values(),
        *c.abandoned_store_event_to_blocks.values(),
    ]


def _loads(state: Engine) -> list[Transfer]:
    c = state.connector
    return [s.transfer for s in [*c.reqs_to_load.values(), *c.abandoned_reqs_to_load.values()]]


def _pools(state: Engine) -> list[BlockPool]:
    return [state.gpu_pool, state.connector.cpu_pool]


def pool_queue(state: Engine) -> Iterator[str]:
    for pool in _pools(state):
        queued = set(pool.free_queue)
        if len(queued) < len(pool.free_queue):  # (counted only then: a check per call)
            for block_id, n in Counter(pool.free_queue).items():
                if n > 1:
                    yield f"{pool.name} block {block_id} is queued {n} times"
        for b in pool.blocks:
            if b.ref_cnt < 0:
                yield f"{pool.name} block {b.block_id} has ref count {b.ref_cnt}"
            if b.is_null and b.block_id in queued:
                yield f"{pool.name} null block is queued"
            elif not b.is_null and (b.block_id in queued) != (b.ref_cnt == 0):
                yield (
                    f"{pool.name} block {b.block_id} has ref count {b.ref_cnt} "
                    f"and is {'' if b.block_id in queued else 'not '}queued"
                )


def pool_map(state: Engine) -> Iterator[str]:
    for pool in _pools(state):
        for key, ids in pool.cached.items():
            if not ids:
                yield f"{pool.name} key {key} maps to no block"
            for block_id in ids:
                b = pool.blocks[block_id]
                if b.block_hash != key and key not in pool.secondary.get(block_id, set()):
                    yield f"{pool.name} key {key} maps to block {block_id}, which does not hold it"
        for block_id, keys in pool.secondary.items():
            b = pool.blocks[block_id]
            for key in keys:
                if not pool.contain(key, block_id):
                    yield f"{pool.name} secondary {key} of block {block_id} is not mapped"
                if b.block_hash is None:
                    yield f"{pool.name} block {block_id} has secondary {key} but no primary"
                if key == b.block_hash:
                    yield f"{pool.name} block {block_id} has {key} as primary and secondary"


def pool_primary(state: Engine) -> Iterator[str]:
    for pool in _pools(state):
        for b in pool.blocks:
            key = b.block_hash
            if key is not None and b.ref_cnt == 0 and not pool.contain(key, b.block_id):
                yield (
                    f"{pool.name} block {b.block_id} is free with primary {b.block_hash}, "
                    "which does not map to it: the block is unreachable"
                )


def pool_null(state: Engine) -> Iterator[str]:
    for pool in _pools(state):
        null = pool.null_block
        if null.block_hash is not None or pool.secondary.get(0) or pool.keys_of(0):
            yield f"{pool.name} null block holds a key"


def pool_fresh(state: Engine) -> Iterator[str]:
    for pool in _pools(state):
        for r in pool.allocation_log:
            if r.ref_cnt != 1 or r.block_hash is not None or r.secondary or r.mapped_keys:
                yield f"{pool.name} block {r.block_id} was allocated unfresh: {r}"


def ref_gpu(state: Engine) -> Iterator[str]:
    holders: Counter[int] = Counter()
    for groups in state.req_to_blocks.values():
        for ids in groups:
            holders.update(i for i in ids if i != state.gpu_pool.null_block.block_id)
    for t in [*_stores(state), *_loads(state)]:
        holders.update(t.gpu_block_ids)
    for b in state.gpu_pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            yield f"gpu block {b.block_id} has ref count {b.ref_cnt}, holders {holders[b.block_id]}"


def ref_cpu(state: Engine) -> Iterator[str]:
    holders: Counter[int] = Counter()
    for hit in state.connector.pending_cpu_hits.values():
        holders.update(b.block_id for g in hit.blocks for b in g if not b.is_null)
    for t in [*_stores(state), *_loads(state)]:
        holders.update(t.cpu_block_ids)
    for b in state.connector.cpu_pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            yield f"cpu block {b.block_id} has ref count {b.ref_cnt}, holders {holders[b.block_id]}"


def keys(state: Engine) -> Iterator[str]:
    cfg = state.config
    for req_id, groups in state.req_to_blocks.items():
        req = state.requests[req_id]
        for g, ids in enumerate(groups):
            expected = block_keys(req.digests, g, cfg.group_block_sizes[g], cfg.hash_block_size)
            keyed = {
                i for start, end in state.reachable_runs(g, 0, len(ids)) for i in range(start, end)
            }
            for i in range(state.num_cached_blocks[req_id][g]):
                b = state.gpu_pool.blocks[ids[i]]
                want = expected[i] if i in keyed else None
                if not b.is_null and b.block_hash != want:
                    yield (
                        f"gpu block {b.block_id} at {req_id} group {g} index {i} has key "
                        f"{b.block_hash}, expected {expected[i]}"
                    )


def skip(state: Engine) -> Iterator[str]:
    sizes = state.config.group_block_sizes
    for sel in state.connector.selection_log:
        for p in sel.picks:
            if p.is_null or p.key is None or p.was_in_flight or p.was_in_cpu_map:
                yield f"{sel.request_id} selected gpu block {p.gpu_block_id} against the rules: {p}"
            key = p.position_key or p.key
            if sel.confirmed is not None and key is not None:
                end = (p.index + 1) * sizes[key.group]
                if end > sel.confirmed:
                    yield (
                        f"{sel.request_id} selected gpu block {p.gpu_block_id} for tokens up to "
                        f"{end}, past its {sel.confirmed} confirmed tokens"
                    )


def capacity(state: Engine) -> Iterator[str]:
    for sel in state.connector.selection_log:
        if len(sel.picks) > sel.num_free:
            yield (
                f"{sel.request_id} selected {len(sel.picks)} blocks with "
                f"{sel.num_free} CPU blocks free"
            )


def unreachable(state: Engine) -> Iterator[str]:
    cpu = state.connector.cpu_pool
    for t in _stores(state):
        for block_id in t.cpu_block_ids:
            mapped = cpu.keys_of(block_id)
            if mapped:
                yield f"cpu block {block_id} is mapped by {mapped} before its store completed"
    for t in state.connector.dropped_log:
        for block_id in t.cpu_block_ids:
            mapped = cpu.keys_of(block_id)
            if mapped:
                yield f"cpu block {block_id} of a failed store is mapped by {mapped}"


def registered(state: Engine) -> Iterator[str]:
    cpu = state.connector.cpu_pool
    for r in state.connector.completion_log:
        c = cpu.blocks[r.cpu_block_id]
        where = f"store event {r.event}: gpu block {r.gpu_block_id} -> cpu block {c.block_id}"
        if r.primary is None or not cpu.contain(r.primary, c.block_id):
            yield f"{where}: primary {r.primary} is not mapped to the cpu block"
        if c.block_hash != r.primary or c.block_hash_num_tokens != r.num_tokens:
            yield (
                f"{where}: cpu block holds primary {c.block_hash} ({c.block_hash_num_tokens} "
                f"tokens), expected {r.primary} ({r.num_tokens} tokens)"
            )
        for key in sorted(r.secondary - set(cpu.keys_of(c.block_id))):
            yield f"{where}: secondary {key} is not mapped to the cpu block"
        if c.ref_cnt != 0:
            yield f"{where}: cpu block has ref count {c.ref_cnt} after completion"


def pending(state: Engine) -> Iterator[str]:
    c = state.connector
    expected = bool(
        c.pending_finished_stores or c.store_event_to_blocks or c.abandoned_store_event_to_blocks
    )
    if c.has_pending_stores() != expected:
        yield f"has_pending_stores() is {c.has_pending_stores()}, expected {expected}"


def in_flight(state: Engine) -> Iterator[str]:
    c = state.connector
    expected = {
        i
        for t in [*c.pending_finished_stores, *c.store_event_to_blocks.values()]
        for i in t.gpu_block_ids
        if not state.config.lazy
    }
    if c.in_flight_store_gpu_blocks != expected:
        yield (
            f"in-flight set {sorted(c.in_flight_store_gpu_blocks)}, queued and in-flight "
            f"stores hold {sorted(expected)}"
        )


def reset(state: Engine) -> Iterator[str]:
    c = state.connector
    for r in c.reset_log:
        if c.pending_finished_stores:
            yield "a final flush is still queued after reset()"
        if r.returned != (not r.abandoned and r.cpu_idle):
            yield f"reset() returned {r.returned} with abandoned={r.abandoned}, idle={r.cpu_idle}"
        if r.returned and (c.cpu_pool.cached or any(b.block_hash for b in c.cpu_pool.blocks)):
            yield "reset() returned True but the CPU pool still holds keys"
    for returned in c.prefix_reset_log:
        if returned and (state.gpu_pool.cached or c.cpu_pool.cached):
            tier = "GPU" if state.gpu_pool.cached else "CPU"
            yield f"reset_prefix_cache() returned True but the {tier} map still holds keys"


def stats(state: Engine) -> Iterator[str]:
    c = state.connector
    queued = set(c.cpu_pool.free_queue)
    in_use = sum(1 for b in c.cpu_pool.blocks if b.block_id not in queued)
    storing = {i for t in _stores(state) for i in t.cpu_block_ids}
    for r in c.stats_log:
        report = r.report
        if report.load_blocks != sum(r.loads):
            yield f"stats report {report.load_blocks} loaded blocks; the loads completed: {r.loads}"
        if report.used_blocks != in_use:
            yield f"stats report {report.used_blocks} CPU blocks used; {in_use} are not free"
        if report.pending_store_blocks != len(storing):
            yield (
                f"stats report {report.pending_store_blocks} pending store blocks, the stores "
                f"not completed hold {len(storing)}"
            )
        if report.pending_store_blocks > max(0, report.used_blocks - 1):
            yield "stats report more pending store blocks than CPU blocks in use"
        decided = sorted(Counter(str(o) for o in r.outcomes).items())
        if list(report.save_outcomes) != decided:
            yield (
                f"stats report hand-off outcomes {list(report.save_outcomes)}; those decided "
                f"since the previous drain: {decided}"
            )


def events(state: Engine) -> Iterator[str]:
    c = state.connector
    for name, issued, counter in [
        ("store", c.issued_store_events, c.store_event_counter),
        ("load", c.issued_load_events, c.load_event_counter),
    ]:
        if issued != list(range(counter)):
            yield f"{name} events issued {issued} with counter {counter}"
    known = [
        *c.store_event_to_blocks,
        *c.abandoned_store_event_to_blocks,
        *c.store_event_pending_counts,
        *c.store_event_to_reqs,
        *c.processed_store_events,
    ]
    for e in known:
        if not 0 <= e < c.store_event_counter:
            yield f"store event {e} was never issued"
    loads = [*c.load_event_to_reqs]
    loads += [
        s.load_event
        for s in [*c.reqs_to_load.values(), *c.abandoned_reqs_to_load.values()]
        if s.load_event is not None
    ]
    for e in loads:
        if not 0 <= e < c.load_event_counter:
            yield f"load event {e} was never issued"
    done = Counter(c.processed_store_events)
    for e, n in done.items():
        if n > 1:
            yield f"store event {e} was processed {n} times"
        if e in c.store_event_to_blocks or e in c.abandoned_store_event_to_blocks:
            yield f"store event {e} was processed but is still outstanding"
    for e, n in c.store_event_pending_counts.items():
        if not 0 < n < c.expected_worker_count:
            yield f"store event {e} has partial count {n} of {c.expected_worker_count}"
    outstanding = c.store_event_to_blocks.keys() | c.abandoned_store_event_to_blocks.keys()
    for e in sorted(c.failed_store_events - outstanding):
        yield f"store event {e} is marked failed but is not outstanding"


def flush_complete(state: Engine) -> Iterator[str]:
    for r in state.finish_records:
        for g, n in enumerate(r.confirmed_blocks):
            marks = r.dispositions[g] if g < len(r.dispositions) else {}
            lost = [i for i in range(n) if i not in marks]
            if lost:
                yield (
                    f"{r.request_id} finished with confirmed group {g} blocks {lost} "
                    "never stored, skipped or dropped for capacity"
                )


def load_pinned(state: Engine) -> Iterator[str]:
    c = state.connector
    pinned = [b for hit in c.pending_cpu_hits.values() for g in hit.blocks for b in g]
    pinned += [c.cpu_pool.blocks[i] for t in _loads(state) for i in t.cpu_block_ids]
    for b in pinned:
        if b.is_null:
            continue
        if b.ref_cnt < 1:
            yield f"cpu block {b.block_id} is pinned for a load but has ref count {b.ref_cnt}"
        if b.block_hash is None or not c.cpu_pool.contain(b.block_hash, b.block_id):
            yield f"cpu block {b.block_id} is pinned for a load but not mapped by its primary"


def integrity(state: Engine) -> Iterator[str]:
    if state.gpu_pool.damaged:
        yield f"gpu blocks {sorted(state.gpu_pool.damaged)} are damaged: only cpu blocks can be"
    cpu = state.connector.cpu_pool
    for block_id in sorted(cpu.damaged):
        b = cpu.blocks[block_id]
        if b.block_hash is None:
            yield f"damaged cpu block {block_id} holds no key, yet is still marked damaged"
        if b.ref_cnt:
            yield f"damaged cpu block {block_id} is in use (ref count {b.ref_cnt})"


def no_read(state: Engine) -> Iterator[str]:
    c = state.connector
    for req_id, req in state.requests.items():
        if not req.skip_reading_prefix_cache:
            continue
        if req_id in c.pending_cpu_hits:
            yield f"request {req_id!r} skips reading the prefix cache, yet holds a CPU hit"
        if req_id in c.reqs_to_load or req_id in c.abandoned_reqs_to_load:
            yield f"request {req_id!r} skips reading the prefix cache, yet loads from the CPU"


def lazy_scan(state: Engine) -> Iterator[str]:
    for scan in state.connector.lazy_scan_log:
        expected: list[int] = []
        for covered, (block_id, key, on_cpu) in enumerate(scan.queue):
            if covered >= scan.target_free or len(expected) >= scan.num_free:
                break
            if key is not None and not on_cpu:
                expected.append(block_id)
        if list(scan.picks) != expected:
            yield (
                f"the lazy scan took GPU blocks {list(scan.picks)}; the cached blocks nearest "
                f"eviction without a CPU copy were {expected}"
            )


def lazy_evict_first(state: Engine) -> Iterator[str]:
    for ret in state.connector.lazy_return_log:
        head = ret.queue_after[: len(ret.freed)]
        if head != ret.freed:
            yield (
                f"lazily stored GPU blocks {list(ret.freed)} came back free, but the free "
                f"queue starts {list(head)}"
            )


def window(state: Engine) -> Iterator[str]:
    null = state.gpu_pool.null_block.block_id
    for req_id, groups in state.req_to_blocks.items():
        computed = state.requests[req_id].num_computed_tokens
        for g, ids in enumerate(groups):
            if g in state.mamba_groups:
                continue  # MAMBA
            nulls = next((i for i, block_id in enumerate(ids) if block_id != null), len(ids))
            if null in ids[nulls:]:
                yield f"{req_id} group {g} holds a null block after a real one: {ids}"
            limit = state.skipped_blocks(g, computed)
            if nulls > limit:
                yield (
                    f"{req_id} group {g} has {nulls} null blocks, but only {limit} are wholly "
                    f"before the window of its {computed} computed tokens"
                )


def mamba(state: Engine) -> Iterator[str]:
    null = state.gpu_pool.null_block.block_id
    for req_id, groups in state.req_to_blocks.items():
        for g in sorted(state.mamba_groups):
            ids = groups[g]
            held = [i for i, block_id in enumerate(ids) if block_id != null]
            if len(held) > 2 or (ids and ids[-1] == null):
                yield (
                    f"{req_id}'s Mamba group {g} table {ids} holds more than its running state "
                    "and the state it is copied from"
                )


def boundary(state: Engine) -> Iterator[str]:
    for r in state.connector.boundary_log:
        storable = r.live and not (
            r.is_null or r.key is None or r.was_in_flight or r.was_in_cpu_map
        )
        if r.outcome is Outcome.STORED and not storable:
            yield f"a hand-off of {r.request_id} was stored against the rules: {r}"
        if r.outcome is Outcome.DROPPED_REQUEST_GONE and r.live:
            yield f"a hand-off of {r.request_id} (gpu block {r.gpu_block_id}) was dropped, live"


def tail(state: Engine) -> Iterator[str]:
    for r in state.connector.tail_log:
        due = r.holds_key and not (r.was_in_flight or r.was_in_cpu_map or r.selected)
        if r.taken and not (due and r.room):
            yield f"the final flush of {r.request_id} took its prompt tail against the rules: {r}"
        if due and r.room and not r.taken:
            yield f"the final flush of {r.request_id} left its prompt tail behind: {r}"


def recover(state: Engine) -> Iterator[str]:
    for r in state.connector.null_log:
        if r.gpu_cached and r.recovered is None:
            yield (
                f"the store scan of {r.request_id} passed over group {r.group} position "
                f"{r.index} as null while the GPU pool caches its key {r.key}"
            )


def position(state: Engine) -> Iterator[str]:
    for sel in state.connector.selection_log:
        for p in sel.picks:
            if p.key != p.position_key:
                yield (
                    f"the store scan of {sel.request_id} took GPU block {p.gpu_block_id} for "
                    f"position {p.index}, whose key is {p.position_key}; the block holds {p.key}"
                )


def _table_named(state: Engine, req_id: str) -> bool:
    """Whether TABLE holds of ``req_id``'s store state: running, or preempted with no blocks
    and the connector told. A preempted request whose load finished holds its loaded blocks,
    still preempted (as vLLM marks it), and its store state learns them when it is scheduled,
    as a waiting one's. A request a prefix-cache reset preempted is told to the connector by
    the next step's output (vLLM's ``preempted_req_ids``), which empties its store state's
    table and cursors: until then that state names the blocks the reset freed."""
    status = state.requests[req_id].status
    if status is RequestStatus.PREEMPTED:
        return req_id not in state.req_to_blocks and req_id not in state.reset_preempted
    return status is RequestStatus.RUNNING


def table(state: Engine) -> Iterator[str]:
    null = state.gpu_pool.null_block.block_id
    for req_id, store in state.connector.reqs_to_store.items():
        status = state.requests[req_id].status
        if store.finished or not _table_named(state, req_id):
            continue
        for g, (named, ids) in enumerate(
            zip(store.block_ids, state.blocks_of(req_id), strict=True)
        ):
            if len(named) != len(ids) or any(
                a != b for a, b in zip(named, ids, strict=True) if b != null
            ):
                yield (
                    f"the store state of {status} request {req_id} names group {g} blocks "
                    f"{named}; its table holds {ids}"
                )


def load_target(state: Engine) -> Iterator[str]:
    c = state.connector
    null = state.gpu_pool.null_block.block_id
    sizes = state.config.group_block_sizes
    for req_id, load in c.reqs_to_load.items():
        table = state.req_to_blocks.get(req_id)
        t = load.transfer
        for gpu_id, cpu_id in zip(t.gpu_block_ids, t.cpu_block_ids, strict=True):
            key = c.cpu_pool.blocks[cpu_id].block_hash
            if gpu_id == null:
                yield f"the load of {req_id} writes cpu block {cpu_id} ({key}) into the null block"
                continue
            if table is None or key is None:
                continue
            ids, index = table[key.group], key.num_tokens // sizes[key.group] - 1
            if index >= len(ids) or ids[index] != gpu_id:
                yield (
                    f"the load of {req_id} writes cpu block {cpu_id} ({key}) into gpu block "
                    f"{gpu_id}, not the block its table holds at that position"
                )


def event_stored(state: Engine) -> Iterator[str]:
    hbs = state.config.hash_block_size
    for r in state.connector.stored_log:
        event = r.event
        if not r.reachable:
            yield f"a stored event for {event.key}, which the CPU map does not hold"
        if not event.token_ids or event.key is None:
            continue
        digest = event.parent or ROOT_DIGEST
        for j in range(0, len(event.token_ids), hbs):
            digest = chain_digest(digest, event.token_ids[j : j + hbs])
        if len(event.token_ids) != event.block_size or digest != event.key.digest:
            yield (
                f"the stored event for {event.key} carries {len(event.token_ids)} tokens "
                f"{list(event.token_ids)} after parent {event.parent}, which are not that key's"
            )


def queues(state: Engine) -> Iterator[str]:
    live = {r for r, req in state.requests.items() if req.status is not RequestStatus.FINISHED}
    waiting, running = set(state.waiting), set(state.running)
    if waiting & running or waiting | running != live or len(waiting) != len(state.waiting):
        yield (
            f"the waiting queue {state.waiting} and the running queue {state.running} do not "
            f"partition the live requests {sorted(live)}"
        )
    for r in state.holders:
        if r not in waiting or r not in state.req_to_blocks:
            yield f"{r} is queued as holding blocks, but is not a waiting request holding any"
    for r in state.parked:
        if r not in waiting:
            yield f"{r} has blocks reserved for its parked load, but is not waiting"
    for r in state.inflight_prefills:
        if r not in running:
            yield f"{r} has blocks reserved as prefilling, but is not running"


CHECKS: dict[str, Callable[[Engine], Iterator[str]]] = {
    "POOL-QUEUE": pool_queue,
    "POOL-MAP": pool_map,
    "POOL-PRIMARY": pool_primary,
    "POOL-NULL": pool_null,
    "POOL-FRESH": pool_fresh,
    "REF-GPU": ref_gpu,
    "REF-CPU": ref_cpu,
    "KEYS": keys,
    "SKIP": skip,
    "CAPACITY": capacity,
    "UNREACHABLE": unreachable,
    "REGISTERED": registered,
    "PENDING": pending,
    "IN-FLIGHT": in_flight,
    "RESET": reset,
    "EVENTS": events,
    "FLUSH-COMPLETE": flush_complete,
    "LOAD-PINNED": load_pinned,
    "INTEGRITY": integrity,
    "NO-READ": no_read,
    "LAZY-SCAN": lazy_scan,
    "LAZY-EVICT-FIRST": lazy_evict_first,
    "WINDOW": window,
    "MAMBA": mamba,
    "BOUNDARY": boundary,
    "TAIL": tail,
    "RECOVER": recover,
    "POSITION": position,
    "TABLE": table,
    "LOAD-TARGET": load_target,
    "EVENT-STORED": event_stored,
    "STATS": stats,
    "QUEUES": queues,
}


def violations(state: Engine) -> list[InvariantViolation]:
    """Every violated invariant, in the order of ``CHECKS``."""
    return [
        InvariantViolation(invariant, detail)
        for invariant, fn in CHECKS.items()
        for detail in fn(state)
    ]


def check(state: Engine) -> None:
    """Raise the first violation, naming its invariant ID; return None if all hold."""
    found = violations(state)
    if found:
        raise found[0]


def exercised(state: Engine) -> set[str]:
    """The invariants whose subject is present in this state, so that checking them here
    could have failed (for the campaign's coverage report)."""
    c = state.connector
    gpu, cpu = state.gpu_pool, c.cpu_pool
    # (run once per driver call by every campaign: each subject looked for in one pass)
    gpu_held, cpu_held = (
        any(b.ref_cnt for b in gpu.blocks[1:]),
        any(b.ref_cnt for b in cpu.blocks[1:]),
    )
    picked = any(s.picks for s in c.selection_log)
    subjects = {
        "POOL-QUEUE": gpu_held or cpu_held,
        "POOL-MAP": bool(gpu.cached or cpu.cached),
        "POOL-PRIMARY": any(
            b.ref_cnt == 0 and b.block_hash is not None
            for pool in (gpu, cpu)
            for b in pool.blocks[1:]
        ),
        "POOL-NULL": True,
        "POOL-FRESH": bool(gpu.allocation_log or cpu.allocation_log),
        "REF-GPU": gpu_held,
        "REF-CPU": cpu_held,
        "KEYS": any(any(n) for n in state.num_cached_blocks.values()),
        "SKIP": picked,
        "CAPACITY": bool(c.selection_log),
        "UNREACHABLE": bool(_stores(state) or c.dropped_log),
        "REGISTERED": bool(c.completion_log),
        "PENDING": c.has_pending_stores(),
        "IN-FLIGHT": bool(c.in_flight_store_gpu_blocks),
        "RESET": bool(c.reset_log or c.prefix_reset_log),
        "EVENTS": bool(c.store_event_counter or c.load_event_counter),
        "FLUSH-COMPLETE": any(any(r.confirmed_blocks) for r in state.finish_records),
        "LOAD-PINNED": bool(c.pending_cpu_hits or _loads(state)),
        "INTEGRITY": bool(cpu.damaged),
        "LAZY-SCAN": any(s.picks for s in c.lazy_scan_log),
        "LAZY-EVICT-FIRST": any(r.freed for r in c.lazy_return_log),
        "WINDOW": any(
            gpu.null_block.block_id in ids
            for groups in state.req_to_blocks.values()
            for ids in groups
        ),
        "MAMBA": any(
            groups[g] for groups in state.req_to_blocks.values() for g in state.mamba_groups
        ),
        "BOUNDARY": bool(c.boundary_log),
        "TAIL": bool(c.tail_log),
        "RECOVER": bool(c.null_log),
        "POSITION": picked,
        "TABLE": any(
            _table_named(state, r) for r, store in c.reqs_to_store.items() if not store.finished
        ),
        "LOAD-TARGET": bool(c.reqs_to_load),
        "EVENT-STORED": bool(c.stored_log),
        "STATS": bool(c.stats_log),
        "QUEUES": bool(state.waiting or state.running),
        "NO-READ": any(
            r.skip_reading_prefix_cache and r.status is not RequestStatus.FINISHED
            for r in state.requests.values()
        ),
    }
    return {name for name, present in subjects.items() if present}
