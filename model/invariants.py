"""The named invariants of the model, each registered where it is defined, and
``check(state)`` that checks them all.

Each invariant is a check function under the :func:`invariant` decorator, which gives its ID,
its kind, its subject and when it is exercised; the function's docstring is its statement, the
one line of its row in ``docs/spec.md`` (tests/test_invariants.py holds the table to the
registry: the same IDs in the same order, kinds, statements and functions). :data:`REGISTRY`
keeps them in the order they are defined here, which is the order ``check`` runs them in.
``violations`` returns every violation found; ``check`` raises the first as an
:class:`~kvoffload.model.errors.InvariantViolation` naming its ID. State invariants hold
between any two driver calls; transition invariants are checked on the ghost records of the
last driver call (what was allocated, selected, completed, reset).

The subject says what part of the state an invariant speaks of (pools, ref counts, stores,
tables, ...); ``present`` says whether that subject is in a state at all, so that the check
could have failed there (:func:`exercised`, the campaigns' coverage of the invariants).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from kvoffload.model.block_pool import BlockPool
from kvoffload.model.engine import Engine, RequestStatus
from kvoffload.model.errors import InvariantViolation
from kvoffload.model.keys import ROOT_DIGEST, BlockKey, block_keys, chain_digest
from kvoffload.model.offload import Outcome, Transfer
from kvoffload.model.types import KVEvent, announced

Kind = Literal["state", "transition"]
Check = Callable[[Engine], Iterator[str]]


@dataclass(frozen=True)
class Invariant:
    id: str
    kind: Kind
    subject: str  # the part of the state it speaks of
    statement: str  # its one line, as docs/spec.md's table has it
    check: Check  # yields a description of each violation
    present: Callable[[Engine], bool]  # whether the subject is there to be checked


REGISTRY: dict[str, Invariant] = {}
# kvoffload's own contracts (docs/spec.md), which no check function of the model states:
# they are judged on a target alone (the byte check of every block after every call, the
# driver's input checks), never on the model's state.
CONTRACTS: dict[str, str] = {
    "KV-BYTES": "every block that holds a key holds that key's KV bytes, in every layer of "
    "every worker, after every call (a block damaged on purpose excepted, until a lookup "
    "finds it out), and every forward reads its context's KV",
    "INPUT": "bad input raises the error `model/validate.py` names, before anything changes",
}


def statement_of(id: str) -> str:
    """The one-line statement of an invariant of :data:`REGISTRY` or a contract."""
    return REGISTRY[id].statement if id in REGISTRY else CONTRACTS[id]


def invariant(
    id: str, kind: Kind, subject: str, *, present: Callable[[Engine], bool]
) -> Callable[[Check], Check]:
    """Register the check function below under ``id``; its docstring is the statement."""

    def register(fn: Check) -> Check:
        if id in REGISTRY:
            raise ValueError(f"invariant {id} is registered twice")
        if kind not in ("state", "transition") or not fn.__doc__:
            raise ValueError(f"invariant {id} needs a kind and a statement (its docstring)")
        statement = " ".join(fn.__doc__.split())
        REGISTRY[id] = Invariant(id, kind, subject, statement, fn, present)
        return fn

    return register


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


# When a subject is present (for ``present``); run once per driver call by every campaign.
def _held(pool: BlockPool) -> bool:
    return any(b.ref_cnt for b in pool.blocks[1:])


def _held_any(state: Engine) -> bool:
    return _held(state.gpu_pool) or _held(state.connector.cpu_pool)


def _free_hashed(state: Engine) -> bool:
    return any(
        b.ref_cnt == 0 and b.block_hash is not None
        for pool in _pools(state)
        for b in pool.blocks[1:]
    )


def _picked(state: Engine) -> bool:
    return any(s.picks for s in state.connector.selection_log)


def _skips_reading(state: Engine) -> bool:
    return any(
        r.skip_reading_prefix_cache and r.status is not RequestStatus.FINISHED
        for r in state.requests.values()
    )


def _table_has_null(state: Engine) -> bool:
    null = state.gpu_pool.null_block.block_id
    return any(null in ids for groups in state.req_to_blocks.values() for ids in groups)


def _mamba_held(state: Engine) -> bool:
    return any(groups[g] for groups in state.req_to_blocks.values() for g in state.mamba_groups)


def _tables_named(state: Engine) -> bool:
    c = state.connector
    return any(_table_named(state, r) for r, store in c.reqs_to_store.items() if not store.finished)


@invariant("POOL-QUEUE", "state", "pools", present=_held_any)
def pool_queue(state: Engine) -> Iterator[str]:
    """a non-null block is in the free queue iff its ref count is 0; no duplicates, never the
    null block, no negative ref count"""
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


@invariant(
    "POOL-MAP",
    "state",
    "pools",
    present=lambda s: bool(s.gpu_pool.cached or s.connector.cpu_pool.cached),
)
def pool_map(state: Engine) -> Iterator[str]:
    """every (key, block) in a map is the block's primary or secondary key; every secondary is
    mapped, its block has a primary, it is not the primary"""
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


@invariant("POOL-PRIMARY", "state", "pools", present=_free_hashed)
def pool_primary(state: Engine) -> Iterator[str]:
    """the primary key of a free hashed block maps to that block"""
    for pool in _pools(state):
        for b in pool.blocks:
            key = b.block_hash
            if key is not None and b.ref_cnt == 0 and not pool.contain(key, b.block_id):
                yield (
                    f"{pool.name} block {b.block_id} is free with primary {b.block_hash}, "
                    "which does not map to it: the block is unreachable"
                )


@invariant("POOL-NULL", "state", "pools", present=lambda s: True)
def pool_null(state: Engine) -> Iterator[str]:
    """the null block holds no key"""
    for pool in _pools(state):
        null = pool.null_block
        if null.block_hash is not None or pool.secondary.get(0) or pool.keys_of(0):
            yield f"{pool.name} null block holds a key"


@invariant(
    "POOL-FRESH",
    "transition",
    "pools",
    present=lambda s: bool(s.gpu_pool.allocation_log or s.connector.cpu_pool.allocation_log),
)
def pool_fresh(state: Engine) -> Iterator[str]:
    """a block returned by `get_new_blocks` has ref 1, no primary, no secondary, no mapped key"""
    for pool in _pools(state):
        for r in pool.allocation_log:
            if r.ref_cnt != 1 or r.block_hash is not None or r.secondary or r.mapped_keys:
                yield f"{pool.name} block {r.block_id} was allocated unfresh: {r}"


@invariant("REF-GPU", "state", "ref counts", present=lambda s: _held(s.gpu_pool))
def ref_gpu(state: Engine) -> Iterator[str]:
    """a GPU block's ref count equals its holders: request block tables + store transfers
    (queued, in flight, abandoned) + loads (pending, in flight, abandoned)"""
    holders: Counter[int] = Counter()
    for groups in state.req_to_blocks.values():
        for ids in groups:
            holders.update(i for i in ids if i != state.gpu_pool.null_block.block_id)
    for t in [*_stores(state), *_loads(state)]:
        holders.update(t.gpu_block_ids)
    for b in state.gpu_pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            yield f"gpu block {b.block_id} has ref count {b.ref_cnt}, holders {holders[b.block_id]}"


@invariant("REF-CPU", "state", "ref counts", present=lambda s: _held(s.connector.cpu_pool))
def ref_cpu(state: Engine) -> Iterator[str]:
    """a CPU block's ref count equals its holders: lookup pins + loads + the store it is the
    destination of"""
    holders: Counter[int] = Counter()
    for hit in state.connector.pending_cpu_hits.values():
        holders.update(b.block_id for g in hit.blocks for b in g if not b.is_null)
    for t in [*_stores(state), *_loads(state)]:
        holders.update(t.cpu_block_ids)
    for b in state.connector.cpu_pool.blocks[1:]:
        if b.ref_cnt != holders[b.block_id]:
            yield f"cpu block {b.block_id} has ref count {b.ref_cnt}, holders {holders[b.block_id]}"


@invariant(
    "KEYS",
    "state",
    "keys",
    present=lambda s: any(any(n) for n in s.num_cached_blocks.values()),
)
def keys(state: Engine) -> Iterator[str]:
    """each cached full GPU block of a request carries that request's key for its position (a
    sliding-window block where no hit can end carries none)"""
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


@invariant("SKIP", "transition", "selection", present=_picked)
def skip(state: Engine) -> Iterator[str]:
    """a selected GPU block is not null, is hashed, was not in flight, its key was not in the
    CPU map, and its position lies within the request's confirmed tokens (whole scheduler
    blocks of its computed tokens when the scan ran; S6's per-rank count reaches past them)"""
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


@invariant("CAPACITY", "transition", "selection", present=lambda s: bool(s.connector.selection_log))
def capacity(state: Engine) -> Iterator[str]:
    """one selection takes at most as many blocks as the CPU pool had free at its start"""
    for sel in state.connector.selection_log:
        if len(sel.picks) > sel.num_free:
            yield (
                f"{sel.request_id} selected {len(sel.picks)} blocks with "
                f"{sel.num_free} CPU blocks free"
            )


@invariant(
    "UNREACHABLE",
    "state",
    "stores",
    present=lambda s: bool(_stores(s) or s.connector.dropped_log),
)
def unreachable(state: Engine) -> Iterator[str]:
    """the CPU destination of a store that has not completed holds no mapped key, nor does that
    of a store dropped because a worker's copy failed"""
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


@invariant("REGISTERED", "transition", "stores", present=lambda s: bool(s.connector.completion_log))
def registered(state: Engine) -> Iterator[str]:
    """a completed store maps the GPU block's primary (with its token count) and every secondary
    to the CPU block, which is free"""
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


# (either side of the iff: a store the answer leaves out is what the check is for)
@invariant(
    "PENDING",
    "state",
    "stores",
    present=lambda s: s.connector.has_pending_stores() or bool(_stores(s)),
)
def pending(state: Engine) -> Iterator[str]:
    """`has_pending_stores()` iff a flush is queued or a store is in flight or abandoned"""
    c = state.connector
    expected = bool(
        c.pending_finished_stores or c.store_event_to_blocks or c.abandoned_store_event_to_blocks
    )
    if c.has_pending_stores() != expected:
        yield f"has_pending_stores() is {c.has_pending_stores()}, expected {expected}"


@invariant(
    "IN-FLIGHT",
    "state",
    "in-flight set",
    present=lambda s: bool(s.connector.in_flight_store_gpu_blocks),
)
def in_flight(state: Engine) -> Iterator[str]:
    """the in-flight set equals the GPU blocks of queued flushes and in-flight store events
    (eager mode); lazy mode keeps none"""
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


@invariant(
    "RESET",
    "transition",
    "resets",
    present=lambda s: bool(s.connector.reset_log or s.connector.prefix_reset_log),
)
def reset(state: Engine) -> Iterator[str]:
    """after `reset()` no flush is queued; it returned True iff nothing was abandoned and the
    CPU pool was idle, and then the CPU pool holds no key; a `reset_prefix_cache` that
    returned True leaves neither the GPU's map nor the CPU's holding a key"""
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


@invariant(
    "EVENTS",
    "state",
    "events",
    present=lambda s: bool(s.connector.store_event_counter or s.connector.load_event_counter),
)
def events(state: Engine) -> Iterator[str]:
    """events are issued in order and never reused; every known event is below its counter; a
    store event is processed once; partial counts stay below `world_size`; only outstanding
    store events are marked failed"""
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


@invariant(
    "FLUSH-COMPLETE",
    "state",
    "final flush",
    present=lambda s: any(any(r.confirmed_blocks) for r in s.finish_records),
)
def flush_complete(state: Engine) -> Iterator[str]:
    """when a tracked request finishes, every confirmed full block has a disposition: stored,
    already present, in flight, null, unhashed, or dropped for capacity"""
    for r in state.finish_records:
        for g, n in enumerate(r.confirmed_blocks):
            marks = r.dispositions[g] if g < len(r.dispositions) else {}
            lost = [i for i in range(n) if i not in marks]
            if lost:
                yield (
                    f"{r.request_id} finished with confirmed group {g} blocks {lost} "
                    "never stored, skipped or dropped for capacity"
                )


@invariant(
    "LOAD-PINNED",
    "state",
    "loads",
    present=lambda s: bool(s.connector.pending_cpu_hits or _loads(s)),
)
def load_pinned(state: Engine) -> Iterator[str]:
    """CPU blocks pinned by a lookup or a load are in use and mapped by their primary"""
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


@invariant("INTEGRITY", "state", "bytes", present=lambda s: bool(s.connector.cpu_pool.damaged))
def integrity(state: Engine) -> Iterator[str]:
    """a damaged block is a CPU block that still holds its key and is not in use: no lookup
    pinned it, no load reads it"""
    if state.gpu_pool.damaged:
        yield f"gpu blocks {sorted(state.gpu_pool.damaged)} are damaged: only cpu blocks can be"
    cpu = state.connector.cpu_pool
    for block_id in sorted(cpu.damaged):
        b = cpu.blocks[block_id]
        if b.block_hash is None:
            yield f"damaged cpu block {block_id} holds no key, yet is still marked damaged"
        if b.ref_cnt:
            yield f"damaged cpu block {block_id} is in use (ref count {b.ref_cnt})"


@invariant("NO-READ", "state", "hits", present=_skips_reading)
def no_read(state: Engine) -> Iterator[str]:
    """a request that skips reading the prefix cache holds no CPU hit and has no load"""
    c = state.connector
    for req_id, req in state.requests.items():
        if not req.skip_reading_prefix_cache:
            continue
        if req_id in c.pending_cpu_hits:
            yield f"request {req_id!r} skips reading the prefix cache, yet holds a CPU hit"
        if req_id in c.reqs_to_load or req_id in c.abandoned_reqs_to_load:
            yield f"request {req_id!r} skips reading the prefix cache, yet loads from the CPU"


@invariant(
    "LAZY-SCAN",
    "transition",
    "selection",
    # (a scan that took nothing it should have taken is what the check is for)
    present=lambda s: bool(s.connector.lazy_scan_log),
)
def lazy_scan(state: Engine) -> Iterator[str]:
    """a lazy selection takes, in queue order, every keyed block of the first `lazy_target_free`
    of the GPU free queue whose key the CPU pool lacks, until as many as the CPU pool had
    free; nothing else"""
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


@invariant(
    "LAZY-EVICT-FIRST",
    "transition",
    "free queue",
    present=lambda s: any(r.freed for r in s.connector.lazy_return_log),
)
def lazy_evict_first(state: Engine) -> Iterator[str]:
    """the GPU blocks of a completed lazy store that become free are the first of the GPU free
    queue, in store order"""
    for ret in state.connector.lazy_return_log:
        head = ret.queue_after[: len(ret.freed)]
        if head != ret.freed:
            yield (
                f"lazily stored GPU blocks {list(ret.freed)} came back free, but the free "
                f"queue starts {list(head)}"
            )


@invariant("WINDOW", "state", "tables", present=_table_has_null)
def window(state: Engine) -> Iterator[str]:
    """in a sliding-window group's table the null block is a prefix no longer than the blocks
    wholly before the window of the request's computed tokens; a full-attention table holds
    no null"""
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


@invariant("MAMBA", "state", "tables", present=_mamba_held)
def mamba(state: Engine) -> Iterator[str]:
    """a Mamba group's table holds at most two blocks that are not null, one of them at its end
    (the running state's, and the one it is copied from until the next allocation)"""
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


@invariant("BOUNDARY", "transition", "stores", present=lambda s: bool(s.connector.boundary_log))
def boundary(state: Engine) -> Iterator[str]:
    """a boundary-state hand-off is stored only for a live tracked request (not finished, not
    preempted in the step), its block not null, keyed, not in flight, its key not in the CPU
    map; it is dropped as its request's being gone only when it is"""
    for r in state.connector.boundary_log:
        storable = r.live and not (
            r.is_null or r.key is None or r.was_in_flight or r.was_in_cpu_map
        )
        if r.outcome is Outcome.STORED and not storable:
            yield f"a hand-off of {r.request_id} was stored against the rules: {r}"
        if r.outcome is Outcome.DROPPED_REQUEST_GONE and r.live:
            yield f"a hand-off of {r.request_id} (gpu block {r.gpu_block_id}) was dropped, live"


@invariant("TAIL", "transition", "final flush", present=lambda s: bool(s.connector.tail_log))
def tail(state: Engine) -> Iterator[str]:
    """with fine-grained CPU hits, a final flush stores the block holding its request's prompt
    tail exactly when the block holds the tail's key, is neither in flight nor selected by
    the scan, the CPU map lacks the key and the CPU pool has room"""
    for r in state.connector.tail_log:
        due = r.holds_key and not (r.was_in_flight or r.was_in_cpu_map or r.selected)
        if r.taken and not (due and r.room):
            yield f"the final flush of {r.request_id} took its prompt tail against the rules: {r}"
        if due and r.room and not r.taken:
            yield f"the final flush of {r.request_id} left its prompt tail behind: {r}"


@invariant("RECOVER", "transition", "selection", present=lambda s: bool(s.connector.null_log))
def recover(state: Engine) -> Iterator[str]:
    """a store scan passes over a null position as null only when the GPU pool caches no block
    under its key; otherwise it takes the cached block in its place"""
    for r in state.connector.null_log:
        if r.gpu_cached and r.recovered is None:
            yield (
                f"the store scan of {r.request_id} passed over group {r.group} position "
                f"{r.index} as null while the GPU pool caches its key {r.key}"
            )


@invariant("POSITION", "transition", "selection", present=_picked)
def position(state: Engine) -> Iterator[str]:
    """a block a store scan takes for a position of a request holds that position's key"""
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


@invariant("TABLE", "state", "store state", present=_tables_named)
def table(state: Engine) -> Iterator[str]:
    """the store state of a running tracked request names as many blocks per group as its block
    table, the same one wherever the table holds a block (a window's nulls stand where the
    state names the block that left); that of a preempted request names none, unless a load
    has brought its blocks back"""
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


@invariant("LOAD-TARGET", "state", "loads", present=lambda s: bool(s.connector.reqs_to_load))
def load_target(state: Engine) -> Iterator[str]:
    """a load writes no GPU null block, and each block it writes is the one the loading
    request's table holds in the group and at the position of the key of the CPU block it
    reads"""
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


@invariant(
    "EVENT-STORED",
    "transition",
    "kv events",
    present=lambda s: bool(s.connector.stored_log),
)
def event_stored(state: Engine) -> Iterator[str]:
    """a `stored` kv-cache event names a key the CPU map holds when it is published; its tokens,
    if any, are `block_size` many and, chained from its parent in hash blocks, give the key's
    digest"""
    for r in state.connector.stored_log:
        if not r.reachable:
            yield f"a stored event for {r.event.key}, which the CPU map does not hold"
        yield from foreign_tokens(r.event, state.config.hash_block_size)


def foreign_tokens(event: KVEvent, hash_block_size: int) -> Iterator[str]:
    """What is wrong with a ``stored`` event's tokens: not ``block_size`` many, or not
    chaining from its parent to its key's digest (nothing, for an event without tokens)."""
    if not event.token_ids or event.key is None:
        return
    digest = event.parent or ROOT_DIGEST
    for j in range(0, len(event.token_ids), hash_block_size):
        digest = chain_digest(digest, event.token_ids[j : j + hash_block_size])
    if len(event.token_ids) != event.block_size or digest != event.key.digest:
        yield (
            f"the stored event for {event.key} carries {len(event.token_ids)} tokens "
            f"{list(event.token_ids)} after parent {event.parent}, which are not that key's"
        )


def _announcing(state: Engine) -> bool:
    pool = state.connector.cpu_pool
    return pool.events is not None and bool(pool.cached or pool.events)


@invariant("EVENT-STREAM", "state", "kv events", present=_announcing)
def event_stream(state: Engine) -> Iterator[str]:
    """read in order (`stored` adds a holder of its key, `removed` takes one away, `cleared`
    empties the tier), the kv-cache events published so far give, for every key, the number
    of CPU blocks the CPU map holds it in: a router indexing the tier from them finds what it
    holds and nothing it dropped"""
    pool = state.connector.cpu_pool
    if pool.events is None:
        return
    said = announced(state.connector.announced, pool.events)
    held = {key: len(ids) for key, ids in pool.cached.items()}
    yield from stream_mismatches(said, held)


def stream_mismatches(said: dict[BlockKey, int], held: dict[BlockKey, int]) -> Iterator[str]:
    """How the holders an event stream announces differ from those a map holds."""
    for key in sorted(said.keys() | held.keys()):
        if said.get(key, 0) != held.get(key, 0):
            yield (
                f"the kv events announce {said.get(key, 0)} CPU blocks holding {key}, the CPU "
                f"map holds it in {held.get(key, 0)}"
            )


@invariant("STATS", "transition", "stats", present=lambda s: bool(s.connector.stats_log))
def stats(state: Engine) -> Iterator[str]:
    """a drain of the stats reports the GPU blocks of the sent loads completed since the
    previous drain, the CPU blocks outside the free queue and the CPU blocks of the stores
    not completed (in flight, queued, abandoned), no more of those than are in use, and per
    outcome the boundary-state hand-offs decided since the previous drain"""
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


@invariant("QUEUES", "state", "queues", present=lambda s: bool(s.waiting or s.running))
def queues(state: Engine) -> Iterator[str]:
    """the waiting and running queues partition the live requests; a request queued as holding
    blocks is waiting and holds blocks; a parked load's reservation is of a waiting request,
    a prefill's of a running one"""
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


# The check order: the order of definition above.
CHECKS: dict[str, Check] = {i.id: i.check for i in REGISTRY.values()}


def violations(state: Engine) -> list[InvariantViolation]:
    """Every violated invariant, in the order of :data:`REGISTRY`."""
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
    return {i.id for i in REGISTRY.values() if i.present(state)}
