"""The spec's invariants judged on a target's own state (issue 34).

:mod:`kvoffload.model.invariants` checks the model's internals. Each invariant whose subject
a :class:`~kvoffload.model.snapshot.Snapshot` shows has a second form here, registered under
the same ID by :func:`observed`, that reads nothing but what any target gives: its snapshot
after a call, and for a transition its snapshot before the call and the call. So a target's
state is held to the spec itself, not only compared with the model: a target that differs
from the model *and* breaks one of these has a bug (the verdict ``breaks ID``); one that
differs with every form holding made a change to review.

Each form is sound: it holds on the model's own snapshots after every call of every program
(tests/test_observed.py judges every call of a campaign), and a corruption of a snapshot
makes it fail. The forms do not copy the model's algorithm: they state what must hold of
the tier's contents whatever code computes them.

The invariants without a form here need a ghost record the snapshot does not show (what a
selection saw, a finish's dispositions, a window's positions): docs/spec.md's table says
which. Invariants kept: every form is registered under an ID of the registry, once, in the
registry's order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import InvariantViolation
from kvoffload.model.invariants import REGISTRY, foreign_tokens, stream_mismatches
from kvoffload.model.limits import MAX_BLOCKS
from kvoffload.model.snapshot import PoolView, Snapshot, TransferView
from kvoffload.model.types import CLEARED, REMOVED, STORED, KVEvent, announced

NULL = 0  # the null block's id in both pools


@dataclass(frozen=True)
class Observation:
    """What a target showed of one call: its configuration, its snapshot after the call,
    and where known its snapshot before and the call (for the transition forms)."""

    config: OffloadConfig
    after: Snapshot
    before: Snapshot | None = None
    call: tuple[Any, ...] | None = None
    # store events a worker reported failed, before or in this call (their copies are
    # dropped, not registered)
    failed_stores: frozenset[int] = frozenset()
    result: object = None  # what the call returned
    # the kv-cache events the target published in the call, in order; None where not known
    events: tuple[KVEvent, ...] | None = None


Form = Callable[[Observation], Iterator[str]]
OBSERVED: dict[str, Form] = {}


def observed(id: str) -> Callable[[Form], Form]:
    """Register the function below as the observable form of invariant ``id``."""

    def register(fn: Form) -> Form:
        if id not in REGISTRY:
            raise ValueError(f"{id} is no invariant of the registry")
        if id in OBSERVED:
            raise ValueError(f"the observable form of {id} is registered twice")
        OBSERVED[id] = fn
        return fn

    return register


def _pools(s: Snapshot) -> list[tuple[str, PoolView]]:
    return [("gpu", s.gpu), ("cpu", s.cpu)]


def _stores(s: Snapshot) -> list[TransferView]:
    return [*s.pending_flushes, *s.store_events, *s.abandoned_store_events]


def _load_transfers(s: Snapshot) -> list[TransferView]:
    return [load.transfer for load in [*s.loads, *s.abandoned_loads]]


def _mapped(pool: PoolView) -> dict[int, set[Any]]:
    """The keys the map holds for each block."""
    found: dict[int, set[Any]] = {}
    for key, ids in pool.cached:
        for block_id in ids:
            found.setdefault(block_id, set()).add(key)
    return found


@observed("POOL-QUEUE")
def pool_queue(o: Observation) -> Iterator[str]:
    for name, pool in _pools(o.after):
        for block_id, n in Counter(pool.free_queue).items():
            if n > 1:
                yield f"{name} block {block_id} is queued {n} times"
        queued = set(pool.free_queue)
        for b in pool.blocks:
            if b.ref_cnt < 0:
                yield f"{name} block {b.block_id} has ref count {b.ref_cnt}"
            if b.block_id == NULL:
                if NULL in queued:
                    yield f"{name} null block is queued"
            elif (b.block_id in queued) != (b.ref_cnt == 0):
                state = "queued" if b.block_id in queued else "not queued"
                yield f"{name} block {b.block_id} has ref count {b.ref_cnt} and is {state}"


@observed("POOL-MAP")
def pool_map(o: Observation) -> Iterator[str]:
    for name, pool in _pools(o.after):
        mapped = _mapped(pool)
        for key, ids in pool.cached:
            if not ids:
                yield f"{name} key {key} maps to no block"
            for block_id in ids:
                b = pool.blocks[block_id]
                if b.primary != key and key not in b.secondary:
                    yield f"{name} key {key} maps to block {block_id}, which does not hold it"
        for b in pool.blocks:
            for key in b.secondary:
                if key not in mapped.get(b.block_id, ()):
                    yield f"{name} secondary {key} of block {b.block_id} is not mapped"
                if b.primary is None:
                    yield f"{name} block {b.block_id} has secondary {key} but no primary"
                if key == b.primary:
                    yield f"{name} block {b.block_id} has {key} as primary and secondary"


@observed("POOL-PRIMARY")
def pool_primary(o: Observation) -> Iterator[str]:
    for name, pool in _pools(o.after):
        mapped = _mapped(pool)
        for b in pool.blocks:
            free = b.primary is not None and b.ref_cnt == 0
            if free and b.primary not in mapped.get(b.block_id, ()):
                yield (
                    f"{name} block {b.block_id} is free with primary {b.primary}, which does "
                    "not map to it: the block is unreachable"
                )


@observed("POOL-NULL")
def pool_null(o: Observation) -> Iterator[str]:
    for name, pool in _pools(o.after):
        null = pool.blocks[NULL]
        if null.primary is not None or null.secondary or NULL in _mapped(pool):
            yield f"{name} null block holds a key"


@observed("POOL-FRESH")
def pool_fresh(o: Observation) -> Iterator[str]:
    """The CPU blocks this call took as the destinations of new stores hold no key at all
    (no stamp before the copy completes)."""
    if o.before is None:
        return
    earlier = {i for t in _stores(o.before) for i in t.cpu_block_ids}
    mapped = _mapped(o.after.cpu)
    for t in _stores(o.after):
        for block_id in t.cpu_block_ids:
            b = o.after.cpu.blocks[block_id]
            if block_id not in earlier and (b.primary or b.secondary or mapped.get(block_id)):
                yield (
                    f"cpu block {block_id}, just taken for a store, already holds the key "
                    f"{b.primary or b.secondary or sorted(mapped[block_id])}"
                )


def _counted(name: str, pool: PoolView, held: Iterable[int], holders: str) -> Iterator[str]:
    """Each block's ref count against the holders ``held`` names (a block once per hold)."""
    counts = Counter(i for i in held if i != NULL)
    for b in pool.blocks[1:]:
        if b.ref_cnt != counts[b.block_id]:
            yield (
                f"{name} block {b.block_id} has ref count {b.ref_cnt}, but its holders "
                f"({holders}) are {counts[b.block_id]}"
            )


@observed("REF-GPU")
def ref_gpu(o: Observation) -> Iterator[str]:
    s = o.after
    tables = [i for r in s.requests for ids in r.block_ids for i in ids]
    copies = [i for t in [*_stores(s), *_load_transfers(s)] for i in t.gpu_block_ids]
    yield from _counted("gpu", s.gpu, tables + copies, "request tables, stores, loads")


@observed("REF-CPU")
def ref_cpu(o: Observation) -> Iterator[str]:
    s = o.after
    hits = [i for _, ids, _ in s.pending_hits for i in ids]
    copies = [i for t in [*_stores(s), *_load_transfers(s)] for i in t.cpu_block_ids]
    yield from _counted("cpu", s.cpu, hits + copies, "hits, stores, loads")


@observed("SKIP")
def skip(o: Observation) -> Iterator[str]:
    """The stores a ``step`` sent (its new in-flight store events, less the final flushes
    queued before it) and the final flushes a call queued copy only GPU blocks that are not
    null and keyed, were not in flight, and whose key the CPU map lacked (or lost in the
    call)."""
    if o.before is None:
        return
    # (a key the call's own allocations evicted may be stored again)
    held = {key for key, _ in o.before.cpu.cached} & {key for key, _ in o.after.cpu.cached}
    queued = [t for t in o.after.pending_flushes if t not in o.before.pending_flushes]
    copies = [*_sent(o), *((t, i) for t in queued for i in t.gpu_block_ids)]
    for t, gpu_id in copies:
        key = o.after.gpu.blocks[gpu_id].primary
        what = f"store {t.event}" if t.event is not None else "a final flush"
        if gpu_id == NULL or key is None:
            yield f"{what} copies gpu block {gpu_id}, which is null or unkeyed"
        elif gpu_id in o.before.in_flight_gpu_blocks:
            yield f"{what} copies gpu block {gpu_id}, already in flight"
        elif key in held:
            yield f"{what} copies gpu block {gpu_id}, whose {key} the CPU holds"


def _sent(o: Observation) -> Iterator[tuple[TransferView, int]]:
    """The GPU blocks of the store events a ``step`` sent, less the final flushes queued
    before it, each with its event."""
    if o.before is None or not o.call or o.call[0] != "step":
        return
    sent = {t.event for t in o.before.store_events}
    flushed = {i for t in o.before.pending_flushes for i in t.gpu_block_ids}
    for t in o.after.store_events:
        if t.event not in sent:
            yield from ((t, i) for i in t.gpu_block_ids if i not in flushed)


@observed("UNREACHABLE")
def unreachable(o: Observation) -> Iterator[str]:
    mapped = _mapped(o.after.cpu)
    for t in _stores(o.after):
        for block_id in t.cpu_block_ids:
            if mapped.get(block_id):
                yield (
                    f"cpu block {block_id} is mapped by {sorted(mapped[block_id])} before "
                    "its store completed"
                )


@observed("REGISTERED")
def registered(o: Observation) -> Iterator[str]:
    """The stores this call completed: every key of each source GPU block (before the call)
    is mapped to its CPU block, the primary with its token count, and the block is free."""
    if o.before is None:
        return
    still = {t.event for t in [*o.after.store_events, *o.after.abandoned_store_events]}
    mapped = _mapped(o.after.cpu)
    for t in o.before.store_events:
        if t.event in still or t.event in o.failed_stores:
            continue
        for gpu_id, cpu_id in zip(t.gpu_block_ids, t.cpu_block_ids, strict=True):
            source, block = o.before.gpu.blocks[gpu_id], o.after.cpu.blocks[cpu_id]
            keys = set(source.secondary) | ({source.primary} if source.primary else set())
            if (block.primary, block.primary_tokens) != (source.primary, source.primary_tokens):
                yield (
                    f"store {t.event} completed, but cpu block {cpu_id} holds primary "
                    f"{block.primary} ({block.primary_tokens} tokens), not gpu block "
                    f"{gpu_id}'s {source.primary} ({source.primary_tokens} tokens)"
                )
            missing = keys - set(block.secondary) - {block.primary}
            unmapped = keys - mapped.get(cpu_id, set())
            if missing or unmapped:
                yield (
                    f"store {t.event} completed, but cpu block {cpu_id} does not hold (or "
                    f"the map does not map to it) gpu block {gpu_id}'s keys "
                    f"{sorted(missing | unmapped)}"
                )
            if block.ref_cnt != 0:
                yield f"store {t.event} completed, but cpu block {cpu_id} is still in use"


@observed("PENDING")
def pending(o: Observation) -> Iterator[str]:
    s = o.after
    expected = bool(_stores(s))
    if s.has_pending_stores != expected:
        yield (
            f"has_pending_stores() is {s.has_pending_stores}, but "
            f"{'stores are' if expected else 'no store is'} queued, in flight or abandoned"
        )


@observed("IN-FLIGHT")
def in_flight(o: Observation) -> Iterator[str]:
    s = o.after
    expected = set()
    if not o.config.lazy:
        expected = {i for t in [*s.pending_flushes, *s.store_events] for i in t.gpu_block_ids}
    if set(s.in_flight_gpu_blocks) != expected:
        yield (
            f"in-flight set {sorted(s.in_flight_gpu_blocks)}, queued and in-flight stores hold "
            f"{sorted(expected)}"
        )


@observed("RESET")
def reset(o: Observation) -> Iterator[str]:
    """A reset that answered True leaves what it promises: ``reset()`` no key in the CPU
    pool, ``reset_prefix_cache`` no key in either map; after ``reset()`` no flush is
    queued, whatever it answered."""
    name = o.call[0] if o.call else None
    s = o.after
    if name == "reset":
        if s.pending_flushes:
            yield "a final flush is still queued after reset()"
        if o.result is True and (s.cpu.cached or any(b.primary for b in s.cpu.blocks)):
            yield "reset() returned True but the CPU pool still holds keys"
    if name == "reset_prefix_cache" and o.result is True and (s.gpu.cached or s.cpu.cached):
        tier = "GPU" if s.gpu.cached else "CPU"
        yield f"reset_prefix_cache() returned True but the {tier} map still holds keys"


@observed("EVENTS")
def events(o: Observation) -> Iterator[str]:
    s = o.after
    stores = [t.event for t in [*s.store_events, *s.abandoned_store_events]]
    stores += [e for e, _ in s.store_event_pending_counts]
    stores += [e for e, _ in s.store_event_requests]
    for e in stores:
        if e is None or not 0 <= e < s.store_event_counter:
            yield f"store event {e} was never issued (counter {s.store_event_counter})"
    loads = [e for e, _ in s.load_event_to_reqs]
    loads += [t.event for t in _load_transfers(s) if t.event is not None]
    for e in loads:
        if not 0 <= e < s.load_event_counter:
            yield f"load event {e} was never issued (counter {s.load_event_counter})"
    for e, n in s.store_event_pending_counts:
        if not 0 < n < o.config.world_size:
            yield f"store event {e} has partial count {n} of {o.config.world_size}"
    if o.before is not None:
        for name, was, now in [
            ("store", o.before.store_event_counter, s.store_event_counter),
            ("load", o.before.load_event_counter, s.load_event_counter),
        ]:
            if now < was:
                yield f"the {name} event counter went back from {was} to {now}"


@observed("FLUSH-COMPLETE")
def flush_complete(o: Observation) -> Iterator[str]:
    """The requests a ``finish`` or a ``step`` (one that preempted nobody) finished left no
    full block, keyed for all its tokens, without a copy on the CPU (its key mapped there
    before or after the call, or its store queued or in flight) while CPU blocks free before
    the call are still free (what the final flush would have taken; a flush that runs out
    drops the rest for capacity). Their blocks are those their tables held before the call
    past their scans' cursors, and those the call keyed and freed again (computed and
    finished in one step).
    Judged where a block is what the flush counts its room in: one full-attention group, in
    eager mode, no DCP (with several groups a position takes a block of each, and a flush
    may leave a block free that no whole position fits in)."""
    c, name = o.config, o.call[0] if o.call else None
    if o.before is None or c.lazy or c.dcp_world_size > 1 or c.num_groups != 1:
        return
    if (
        not c.full_attention(0)
        or name not in ("finish", "step")
        or getattr(o.result, "preempted", None)
    ):
        return
    left_free = set(o.before.cpu.free_queue) & set(o.after.cpu.free_queue)
    if not left_free:
        return
    was = {r.request_id: r for r in o.before.requests if r.status != "finished"}
    cursors = {t.request_id: t.num_stored_blocks for t in o.before.tracked}
    finished = [r for r in o.after.requests if r.status == "finished" and r.request_id in was]
    # A request live across a reset() is tracked no more (vLLM forgets it): only those
    # tracked before the call, or first given blocks in it, owe a flush.
    owing = [r for r in finished if r.request_id in cursors or not any(was[r.request_id].block_ids)]
    if not owing or (len(owing) < len(finished) and name == "step"):
        return
    owed: dict[int, str] = {}  # block -> whose
    for done in owing:
        cursor = cursors.get(done.request_id, ())
        for g, ids in enumerate(was[done.request_id].block_ids):
            full = min(done.num_computed_tokens // c.group_block_sizes[g], len(ids))
            if c.full_attention(g):
                owed.update((i, done.request_id) for i in ids[cursor[g] if cursor else 0 : full])
    if name == "step":
        whose = ", ".join(r.request_id for r in owing)
        for now, then in zip(o.after.gpu.blocks[1:], o.before.gpu.blocks[1:], strict=True):
            key = now.primary
            fresh = key is not None and key != then.primary and now.ref_cnt == 0
            whole = key is not None and key.num_tokens % c.group_block_sizes[key.group] == 0
            if fresh and whole and key is not None and c.full_attention(key.group):
                owed.setdefault(now.block_id, whose)
    copying = {i for t in _stores(o.after) for i in t.gpu_block_ids}
    # (present before the call counts: the flush's own allocations may evict it)
    held = {key for key, _ in [*o.before.cpu.cached, *o.after.cpu.cached]}
    for block_id, request_id in sorted(owed.items()):
        key = o.after.gpu.blocks[block_id].primary
        if block_id == NULL or key is None or key in held or block_id in copying:
            continue
        yield (
            f"{request_id} finished with gpu block {block_id} ({key}) neither stored nor "
            f"queued, while cpu blocks {sorted(left_free)} stayed free"
        )


@observed("LOAD-PINNED")
def load_pinned(o: Observation) -> Iterator[str]:
    s = o.after
    pinned = [i for _, ids, _ in s.pending_hits for i in ids]
    pinned += [i for t in _load_transfers(s) for i in t.cpu_block_ids]
    mapped = _mapped(s.cpu)
    for block_id in pinned:
        if block_id == NULL:
            continue
        b = s.cpu.blocks[block_id]
        if b.ref_cnt < 1:
            yield f"cpu block {block_id} is pinned for a load but has ref count {b.ref_cnt}"
        if b.primary is None or b.primary not in mapped.get(block_id, ()):
            yield f"cpu block {block_id} is pinned for a load but not mapped by its primary"


@observed("POSITION")
def position(o: Observation) -> Iterator[str]:
    """Each block the eager scan of a ``step`` sent holds the key of a position that scan
    reached: in its key's group, the table position the key's tokens end on lies between
    some tracked request's cursor before the step and after it (where the scan passed).
    A key that ends inside a block is no position's (the prompt tails are the final
    flush's). Judged in eager mode, without Mamba groups or DCP (whose hand-offs and
    per-rank blocks are not table positions)."""
    c = o.config
    if o.before is None or c.lazy or c.dcp_world_size > 1 or any(c.mamba):
        return
    was = {t.request_id: t.num_stored_blocks for t in o.before.tracked}
    now = {t.request_id: t.num_stored_blocks for t in o.after.tracked}
    reached: list[tuple[int, int, int]] = []  # (group, first index, end index)
    for req_id in was.keys() | now.keys():
        start = was.get(req_id, (0,) * c.num_groups)
        # (a request preempted in the step starts over; one gone from the tracked states
        # may have been scanned to its table's end)
        end = now.get(req_id, (MAX_BLOCKS,) * c.num_groups)
        reached += [(g, start[g] if end[g] >= start[g] else 0, end[g]) for g in range(c.num_groups)]
    for t, gpu_id in _sent(o):
        key = o.after.gpu.blocks[gpu_id].primary
        if key is None:
            continue  # (SKIP's)
        size = c.group_block_sizes[key.group]
        index, rest = divmod(key.num_tokens, size)
        if rest != 0:
            yield (
                f"store {t.event} copies gpu block {gpu_id} ({key}), a key that ends inside "
                f"a block of group {key.group}: on no table position a scan reaches"
            )
        elif not any(g == key.group and a < index <= b for g, a, b in reached):
            yield (
                f"store {t.event} copies gpu block {gpu_id} ({key}), but no scan of the step "
                f"reached position {index - 1} of group {key.group}, the one its key ends"
            )


@observed("EVENT-STORED")
def event_stored(o: Observation) -> Iterator[str]:
    """Each ``stored`` event of the call names a key the CPU map holds after it (unless a
    later event of the call removes it again), with tokens that are that key's."""
    events = o.events or ()
    held = {key for key, _ in o.after.cpu.cached}
    for i, event in enumerate(events):
        if event.kind != STORED:
            continue
        later = events[i + 1 :]
        gone = any(e.kind == CLEARED or (e.kind == REMOVED and e.key == event.key) for e in later)
        if event.key not in held and not gone:
            yield f"a stored event for {event.key}, which the CPU map does not hold"
        yield from foreign_tokens(event, o.config.hash_block_size)


@observed("EVENT-STREAM")
def event_stream(o: Observation) -> Iterator[str]:
    """The call's events, read from the blocks holding each key in the CPU map before it,
    give those holding it after."""
    if o.before is None or o.events is None or not o.config.kv_events:
        return
    said = announced({key: len(ids) for key, ids in o.before.cpu.cached}, o.events)
    yield from stream_mismatches(said, {key: len(ids) for key, ids in o.after.cpu.cached})


def judge(
    observation: Observation, forms: Collection[str] | None = None
) -> list[InvariantViolation]:
    """Every violation of an observable form (of those ``forms`` names, where given), in the
    registry's order."""
    return [
        InvariantViolation(id, detail)
        for id in REGISTRY
        if id in OBSERVED and (forms is None or id in forms)
        for detail in OBSERVED[id](observation)
    ]
