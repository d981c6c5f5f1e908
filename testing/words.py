"""A difference in plain words (issue 34): what the model does at the call and the target
does not, sentence by sentence, for a reviewer who has not read the model.

The lockstep describes a difference field by field as the snapshots hold it
(``pending_flushes: (TransferView(event=None, ...),) in the model, () in the
implementation``): exact, and the form a reproducer and a regression test need. The same
difference in words reads ``the model stores GPU block 1 into CPU block 1 at the final
flush; vLLM does not``. Both are kept: the words come after the raw text, behind
:data:`MARK`, so that every parser of the raw text (the verdict class, the reduction's kind
of difference, the history's table) reads it as before, and :func:`words_of` finds them.

What it keeps:
- FAITHFUL: a sentence is written only from values that differ; a field whose two values
  are equal gives none, and a difference no rule below words still gives a sentence (both
  values, named by their field), so that words never hide a difference.
- CAUSE FIRST: sentences about the transfers (what is stored, loaded, queued) come before
  those about results and pools, and derived fields (the in-flight set, the counters,
  ``has_pending_stores``) come last: the first sentence names the cause where it can.
- BOUNDED: at most :data:`MAX_SENTENCES` sentences, then how many more there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

from kvoffload.model.snapshot import (
    BlockView,
    LoadView,
    PoolView,
    RequestView,
    Snapshot,
    StoreTrackView,
    TransferView,
)
from kvoffload.model.types import CLEARED, STORED, ConnectorMetadata, KVEvent, StepResult

# How a difference's words are appended to its raw text (and found again by words_of).
MARK = " In words: "
MAX_SENTENCES = 4
# The name of a target in words when it gives none (``name_in_words`` on the target).
IMPLEMENTATION = "the implementation"

# The snapshot's fields, cause first (CAUSE FIRST); a field not named here comes after these.
ORDER = (
    "pending_flushes",
    "store_events",
    "loads",
    "tracked",
    "pending_hits",
    "cpu",
    "gpu",
    "requests",
    "abandoned_store_events",
    "abandoned_loads",
    "store_event_pending_counts",
    "store_event_requests",
    "load_event_to_reqs",
    "in_flight_gpu_blocks",
    "store_event_counter",
    "load_event_counter",
    "has_pending_stores",
)
# The fields that say what is copied: their sentences come before the results'.
TRANSFERS = ORDER[:4]


def name_of(target: object) -> str:
    """How the words name ``target``: its ``name_in_words`` (``vLLM``), else
    :data:`IMPLEMENTATION`."""
    name = getattr(target, "name_in_words", None)
    return name if isinstance(name, str) and name else IMPLEMENTATION


def in_words(sentences: Sequence[str]) -> str:
    """The sentences as the text after :data:`MARK` (BOUNDED), or ``""`` for none."""
    if not sentences:
        return ""
    shown = "; ".join(sentences[:MAX_SENTENCES])
    more = len(sentences) - MAX_SENTENCES
    return MARK + shown + (f"; and {more} more difference(s)." if more > 0 else ".")


def words_of(found: str) -> str | None:
    """The words of a difference (after its last :data:`MARK`), or None where it has none."""
    _, mark, words = found.rpartition(MARK)
    return words if mark else None


def without_words(found: str) -> str:
    """The raw text of a difference, its words left out."""
    raw, mark, _ = found.rpartition(MARK)
    return raw if mark else found


def difference_words(
    expected: object,
    actual: object,
    mine: Snapshot | None,
    theirs: Snapshot | None,
    events: tuple[Sequence[KVEvent], Sequence[KVEvent]] | None,
    target: str,
) -> list[str]:
    """Every sentence of one call's difference: the transfers' (:data:`TRANSFERS`), the
    results', the kv events' (only the model's, only the target's), then the rest of the
    snapshots' (CAUSE FIRST)."""
    fields = [] if mine is None or theirs is None else differing(mine, theirs)
    said = snapshot_words(mine, theirs, target, [f for f in fields if f in TRANSFERS])
    if expected != actual:
        said += result_words(expected, actual, target)
    if events is not None:
        said += event_words(*events, target)
    return said + snapshot_words(mine, theirs, target, [f for f in fields if f not in TRANSFERS])


def differing(mine: Snapshot, theirs: Snapshot) -> list[str]:
    """The fields in which two snapshots differ, in :data:`ORDER`."""
    fields = [f for f in mine.__dataclass_fields__ if getattr(mine, f) != getattr(theirs, f)]
    return sorted(fields, key=lambda f: ORDER.index(f) if f in ORDER else len(ORDER))


def snapshot_words(
    mine: Snapshot | None, theirs: Snapshot | None, target: str, fields: Sequence[str]
) -> list[str]:
    """The sentences of ``fields``, in which two snapshots differ."""
    said: list[str] = []
    for f in fields:
        words = _FIELD_WORDS.get(f)
        a, b = getattr(mine, f), getattr(theirs, f)
        # FAITHFUL: a field the rules below do not word (or word as no difference at all)
        # still gives a sentence
        said += (words(a, b, target) if words is not None else []) or [
            _both(f.replace("_", " "), a, b, target)
        ]
    return said


def _both(what: str, mine: object, theirs: object, target: str) -> str:
    return f"{what} is {_value(mine)} in the model, {_value(theirs)} in {target}"


def _value(value: object) -> str:
    if isinstance(value, tuple | list):
        return "[" + ", ".join(str(v) for v in value) + "]" if value else "none"
    return str(value)


def _blocks(ids: Iterable[int]) -> str:
    ids = list(ids)
    if not ids:
        return "no block"
    return f"block {ids[0]}" if len(ids) == 1 else f"blocks {ids}"


def _copy(t: TransferView) -> str:
    return f"GPU {_blocks(t.gpu_block_ids)} into CPU {_blocks(t.cpu_block_ids)}"


# -- transfers ----------------------------------------------------------------------------


def _flushes(
    mine: tuple[TransferView, ...], theirs: tuple[TransferView, ...], target: str
) -> list[str]:
    """A final flush queued by one side only (or with other blocks)."""
    said = []
    a, b = _pairs(mine), _pairs(theirs)
    only_mine, only_theirs = [p for p in a if p not in b], [p for p in b if p not in a]
    if only_mine:
        said.append(
            f"at the final flush the model stores {_pairs_words(only_mine)}; {target} does not"
        )
    if only_theirs:
        said.append(
            f"at the final flush {target} stores {_pairs_words(only_theirs)}; the model does not"
        )
    if not said:  # the same copies, queued in another order or grouping
        said.append(
            f"at the final flush the model queues {[_copy(t) for t in mine]}, {target} "
            f"{[_copy(t) for t in theirs]}"
        )
    return said


def _pairs(transfers: Iterable[TransferView]) -> list[tuple[int, int]]:
    return [p for t in transfers for p in zip(t.gpu_block_ids, t.cpu_block_ids, strict=False)]


def _pairs_words(pairs: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"GPU block {g} into CPU block {c}" for g, c in pairs)


def _matched(
    mine: Iterable[Any],
    theirs: Iterable[Any],
    target: str,
    key: Callable[[Any], Any],
    alone: Callable[[Any, Any, str, str], str],
    changed: Callable[[Any, Any, Any], list[str]],
) -> list[str]:
    """The items of two sides matched by ``key``: ``alone(key, item, side, other)`` for an
    item one side holds only, ``changed(key, mine, theirs)`` for one both hold otherwise."""
    a = {key(v): v for v in mine}
    b = {key(v): v for v in theirs}
    said: list[str] = []
    for k in sorted(a.keys() | b.keys(), key=lambda k: (k is not None, k)):
        x, y = a.get(k), b.get(k)
        if x == y:
            continue
        if x is None or y is None:
            side, other, held = ("the model", target, x) if y is None else (target, "the model", y)
            said.append(alone(k, held, side, other))
        else:
            said += changed(k, x, y)
    return said


def _store_events(
    mine: tuple[TransferView, ...], theirs: tuple[TransferView, ...], target: str, what: str
) -> list[str]:
    """Store events by their id: held by one side only, or copying other blocks."""
    return _matched(
        mine,
        theirs,
        target,
        lambda t: t.event,
        lambda e, t, side, other: (
            f"store event {e} ({_copy(t)}) is {what} in {side}; not in {other}"
        ),
        lambda e, x, y: [f"store event {e} copies {_copy(x)} in the model, {_copy(y)} in {target}"],
    )


def _loads(
    mine: tuple[LoadView, ...], theirs: tuple[LoadView, ...], target: str, what: str = ""
) -> list[str]:
    """Loads by their request: held by one side only, or with other blocks or state."""
    return _matched(
        mine,
        theirs,
        target,
        lambda v: v.request_id,
        lambda r, v, side, other: (
            f"the load of {r}{what} ({_load(v)}) is in {side}; not in {other}"
        ),
        lambda r, x, y: [
            f"the load of {r}{what} is {_load(x)} in the model, {_load(y)} in {target}"
        ],
    )


def _load(v: LoadView) -> str:
    t = v.transfer
    sent = "not sent yet" if t.event is None else f"load event {t.event}"
    done = ", its request finished" if v.finished else ""
    return f"CPU {_blocks(t.cpu_block_ids)} into GPU {_blocks(t.gpu_block_ids)}, {sent}{done}"


def _tracked(
    mine: tuple[StoreTrackView, ...], theirs: tuple[StoreTrackView, ...], target: str
) -> list[str]:
    """The eager store state of a request: its cursors (blocks scanned per group), its store
    events, its finished flag."""
    return _matched(
        mine,
        theirs,
        target,
        lambda v: v.request_id,
        lambda r, v, side, other: f"the store scan of {r} is tracked by {side}; not by {other}",
        lambda r, x, y: _scan(r, x, y, target),
    )


def _scan(rid: str, x: StoreTrackView, y: StoreTrackView, target: str) -> list[str]:
    said = [
        f"the store scan of {rid} has passed {n} block(s) of group {g} in the model, {m} in "
        f"{target}"
        for g, (n, m) in enumerate(zip(x.num_stored_blocks, y.num_stored_blocks, strict=False))
        if n != m
    ]
    if x.store_events != y.store_events:
        said.append(
            f"the store scan of {rid} waits for store events {list(x.store_events)} in the "
            f"model, {list(y.store_events)} in {target}"
        )
    if x.finished != y.finished:
        said.append(
            f"the store scan of {rid} is finished in {'the model' if x.finished else target} only"
        )
    if x.block_ids != y.block_ids or len(x.num_stored_blocks) != len(y.num_stored_blocks):
        said.append(_both(f"the store scan of {rid}'s blocks", x.block_ids, y.block_ids, target))
    return said


def _hits(
    mine: tuple[tuple[str, tuple[int, ...], int], ...],
    theirs: tuple[tuple[str, tuple[int, ...], int], ...],
    target: str,
) -> list[str]:
    """The CPU hits a lookup pinned for a request, not yet loaded."""
    return _matched(
        mine,
        theirs,
        target,
        lambda h: h[0],
        lambda r, h, side, other: f"{r} holds {_hit(h)} in {side}; no CPU hit in {other}",
        lambda r, x, y: [f"{r} holds {_hit(x)} in the model, {_hit(y)} in {target}"],
    )


def _hit(hit: tuple[str, tuple[int, ...], int]) -> str:
    _, blocks, tokens = hit
    return f"a CPU hit of {tokens} token(s) pinning {_blocks(blocks)}"


# -- pools and requests -------------------------------------------------------------------


def _pool(tier: str) -> Callable[[PoolView, PoolView, str], list[str]]:
    def words(mine: PoolView, theirs: PoolView, target: str) -> list[str]:
        said = []
        for x, y in zip(mine.blocks, theirs.blocks, strict=False):
            if x != y:
                said += _block(tier, x, y, target)
        a, b = dict(mine.cached), dict(theirs.cached)
        for key in sorted(a.keys() | b.keys(), key=str):
            if a.get(key) != b.get(key):
                said.append(
                    f"the {tier} caches key {key} in {_blocks(a.get(key, ()))} in the model, "
                    f"{_blocks(b.get(key, ()))} in {target}"
                )
        if mine.free_queue != theirs.free_queue and set(mine.free_queue) == set(theirs.free_queue):
            said.append(
                f"the {tier} free queue evicts in another order: {list(mine.free_queue)} in "
                f"the model, {list(theirs.free_queue)} in {target}"
            )
        if len(mine.blocks) != len(theirs.blocks):
            said.append(
                _both(f"the {tier} pool's size", len(mine.blocks), len(theirs.blocks), target)
            )
        return said

    return words


def _block(tier: str, x: BlockView, y: BlockView, target: str) -> list[str]:
    said = []
    name = f"{tier} block {x.block_id}"
    if x.ref_cnt != y.ref_cnt:
        said.append(f"{name} is {_holds(x.ref_cnt)} in the model, {_holds(y.ref_cnt)} in {target}")
    if (x.primary, x.primary_tokens) != (y.primary, y.primary_tokens):
        said.append(f"{name} is {_keyed(x)} in the model, {_keyed(y)} in {target}")
    if x.secondary != y.secondary:
        said.append(
            f"{name} is also registered under {_value([str(k) for k in x.secondary])} in the "
            f"model, {_value([str(k) for k in y.secondary])} in {target}"
        )
    return said


def _holds(ref_cnt: int) -> str:
    return "free (ref count 0)" if ref_cnt == 0 else f"in use (ref count {ref_cnt})"


def _keyed(b: BlockView) -> str:
    if b.primary is None:
        return "without a key"
    tokens = "" if b.primary_tokens is None else f" ({b.primary_tokens} tokens)"
    return f"stamped with key {b.primary}{tokens}"


def _requests(
    mine: tuple[RequestView, ...], theirs: tuple[RequestView, ...], target: str
) -> list[str]:
    return _matched(
        mine,
        theirs,
        target,
        lambda v: v.request_id,
        lambda r, v, side, other: f"{side} has request {r} ({v.status}); {other} does not",
        lambda r, x, y: _request(r, x, y, target),
    )


def _request(rid: str, x: RequestView, y: RequestView, target: str) -> list[str]:
    said = []
    if x.status != y.status:
        said.append(f"{rid} is {x.status} in the model, {y.status} in {target}")
    if x.num_computed_tokens != y.num_computed_tokens:
        said.append(
            f"{rid} has {x.num_computed_tokens} computed token(s) in the model, "
            f"{y.num_computed_tokens} in {target}"
        )
    if (x.num_tokens, x.output) != (y.num_tokens, y.output):
        said.append(_both(f"{rid}'s output", x.output, y.output, target))
    said += [
        f"{rid}'s table of group {g} is {list(p)} in the model, {list(q)} in {target}"
        for g, (p, q) in enumerate(zip(x.block_ids, y.block_ids, strict=False))
        if p != q
    ]
    return said


def _in_flight(mine: tuple[int, ...], theirs: tuple[int, ...], target: str) -> list[str]:
    only_mine = [b for b in mine if b not in theirs]
    only_theirs = [b for b in theirs if b not in mine]
    said = []
    if only_mine:
        said.append(f"GPU {_blocks(only_mine)} is being stored in the model; not in {target}")
    if only_theirs:
        said.append(f"GPU {_blocks(only_theirs)} is being stored in {target}; not in the model")
    return said


def _pending(mine: bool, theirs: bool, target: str) -> list[str]:
    side = "the model" if mine else target
    other = target if mine else "the model"
    return [f"{side} reports stores pending (has_pending_stores); {other} reports none"]


_FIELD_WORDS: dict[str, Callable[[Any, Any, str], list[str]]] = {
    "gpu": _pool("GPU"),
    "cpu": _pool("CPU"),
    "requests": _requests,
    "tracked": _tracked,
    "pending_flushes": _flushes,
    "store_events": lambda a, b, t: _store_events(a, b, t, "in flight"),
    "abandoned_store_events": lambda a, b, t: _store_events(a, b, t, "abandoned by a reset"),
    "loads": _loads,
    "abandoned_loads": lambda a, b, t: _loads(a, b, t, " (abandoned by a reset)"),
    "pending_hits": _hits,
    "in_flight_gpu_blocks": _in_flight,
    "has_pending_stores": _pending,
}


# -- results and events -------------------------------------------------------------------


def result_words(expected: object, actual: object, target: str) -> list[str]:
    """What a call returned on each side: an error against a result, a step's schedule and
    transfers, or both values."""
    error_mine, error_theirs = isinstance(expected, str), isinstance(actual, str)
    if error_mine or error_theirs:
        if error_mine and error_theirs:
            return [f"the model raises {expected}, {target} {actual}"]
        if error_mine:
            return [f"the model rejects the call ({expected}); {target} accepts it"]
        return [f"{target} raises {actual}; the model completes the call"]
    if isinstance(expected, StepResult) and isinstance(actual, StepResult):
        return _step_words(expected, actual, target)
    if type(expected) is type(actual) and is_dataclass(expected) and is_dataclass(actual):
        # a result of named fields (the stats, a finish): the fields that differ
        return [
            _both(
                f"the result's {f.name}", getattr(expected, f.name), getattr(actual, f.name), target
            )
            for f in fields(expected)
            if getattr(expected, f.name) != getattr(actual, f.name)
        ]
    return [f"the call returns {_value(expected)} in the model, {_value(actual)} in {target}"]


def _step_words(mine: StepResult, theirs: StepResult, target: str) -> list[str]:
    said = []
    for rid in sorted(mine.scheduled.keys() | theirs.scheduled.keys()):
        x, y = mine.scheduled.get(rid), theirs.scheduled.get(rid)
        if x != y:
            said.append(
                f"the step computes {_tokens(x)} of {rid} in the model, {_tokens(y)} in {target}"
            )
    for what, a, b in (
        ("waits for its CPU load", mine.loading, theirs.loading),
        ("finishes", mine.finished, theirs.finished),
        ("is preempted", mine.preempted, theirs.preempted),
    ):
        for rid in sorted(set(a) ^ set(b)):
            side, other = ("the model", target) if rid in a else (target, "the model")
            said.append(f"{rid} {what} in {side}; not in {other}")
    said += metadata_words(mine.metadata, theirs.metadata, target)
    return said or [_both("the step's result", mine, theirs, target)]


def _tokens(span: tuple[int, int] | None) -> str:
    return "nothing" if span is None else f"tokens {span[0]} to {span[1]}"


def metadata_words(mine: ConnectorMetadata, theirs: ConnectorMetadata, target: str) -> list[str]:
    said = []
    store = (mine.store_gpu_blocks, mine.store_cpu_blocks)
    if store != (theirs.store_gpu_blocks, theirs.store_cpu_blocks):
        said.append(
            f"the step stores {_sent(*store)} in the model, "
            f"{_sent(theirs.store_gpu_blocks, theirs.store_cpu_blocks)} in {target}"
        )
    load = (mine.load_cpu_blocks, mine.load_gpu_blocks)
    if load != (theirs.load_cpu_blocks, theirs.load_gpu_blocks):
        said.append(
            f"the step loads {_sent(*load, 'CPU', 'GPU')} in the model, "
            f"{_sent(theirs.load_cpu_blocks, theirs.load_gpu_blocks, 'CPU', 'GPU')}"
            f" in {target}"
        )
    if (mine.store_event, mine.load_event) != (theirs.store_event, theirs.load_event) and not said:
        said.append(
            f"the step sends store event {mine.store_event} and load event {mine.load_event} "
            f"in the model, {theirs.store_event} and {theirs.load_event} in {target}"
        )
    if mine.load_event_to_reqs != theirs.load_event_to_reqs:
        said.append(
            _both(
                "the loads outstanding",
                sorted(mine.load_event_to_reqs.items()),
                sorted(theirs.load_event_to_reqs.items()),
                target,
            )
        )
    return said


def _sent(source: Sequence[int], into: Sequence[int], src: str = "GPU", dst: str = "CPU") -> str:
    if not source:
        return "nothing"
    return f"{src} {_blocks(source)} into {dst} {_blocks(into)}"


def event_words(mine: Sequence[KVEvent], theirs: Sequence[KVEvent], target: str) -> list[str]:
    """The kv-cache events one side published and the other did not (as a multiset)."""
    rest = list(theirs)
    only_mine = []
    for e in mine:
        if e in rest:
            rest.remove(e)
        else:
            only_mine.append(e)
    said = []
    if only_mine:
        said.append(f"the model announces {_announced(only_mine)}; {target} does not")
    if rest:
        said.append(f"{target} announces {_announced(rest)}; the model does not")
    return said


def _announced(events: Sequence[KVEvent]) -> str:
    parts = []
    for e in events[:MAX_SENTENCES]:
        if e.kind == CLEARED:
            parts.append("the CPU tier cleared")
        else:
            parts.append(
                f"key {e.key} {'stored on' if e.kind == STORED else 'removed from'} the CPU"
            )
    more = len(events) - MAX_SENTENCES
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
