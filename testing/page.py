"""A saved failure as one page a reviewer can read: the shrunk program driven again on the
model and the target, call by call, and after every call each tier's blocks, the transfers
in flight and the requests of both sides next to each other, every value that differs
highlighted (``kvoffload replay FILE --html PAGE``).

:func:`record` drives the program as the lockstep does (:func:`~kvoffload.testing.lockstep.
compare`, in full); :func:`render` writes the page; :func:`write_page` does both.

Invariants kept:

- SAME VERDICT: each call's difference is the text ``compare(..., incremental=False)`` gives,
  and each call is applied once to each side: the outcomes the page shows are taken while
  ``lockstep.outcome`` and ``lockstep.target_outcome`` apply the call, and ``compare`` is then
  answered from that tape (:class:`_Side`), so that it compares exactly those outcomes and
  the snapshots it takes itself.
- INERT: every value that comes from the failure or from a run (a request id, a call, a
  difference, the reproducer) reaches the page through :func:`html.escape` only; the page
  holds no script, loads nothing (no network, no external asset) and says so to the browser
  (a content security policy of ``default-src 'none'``).
- EVERY FIELD: every field of the snapshot is shown, those without a table of their own in
  the table of other state, so that a difference the verdict names is always highlighted.
- DETERMINISTIC: the page is a function of the trace, the failure and the label (no time,
  no path, no random order): the same failure gives the same bytes.
"""

from __future__ import annotations

import html
import json
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

from kvoffload.model import InvariantViolation, OffloadConfig, OffloadModel
from kvoffload.model.keys import BlockKey
from kvoffload.model.snapshot import PoolView, Snapshot
from kvoffload.model.types import KVEvent
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.adapters import Target
from kvoffload.testing.failure import CONFIG_FIELDS, Failure, model_broke
from kvoffload.testing.lockstep import Call, as_outcome, compare, outcome, target_outcome

# -- the run ---------------------------------------------------------------------------

# What ``lockstep.apply`` calls on a side to apply a call: taped while the page takes the
# outcome, answered from the tape while ``compare`` applies the same call.
_APPLIED = (
    "add_request",
    "step",
    "finish",
    "complete_store",
    "complete_load",
    "reset",
    "reset_prefix_cache",
    "lookup",
    "stats",
    "outstanding",
    "fail_store",
    "corrupt",
)
# What ``compare`` reads with ``isinstance`` (``HoldsBytes``): passed through as they are.
_PASSED = ("data_mismatches", "check_data")


class _Side:
    """One side of the lockstep as ``compare`` sees it: the calls that apply a driver call
    are recorded on a tape the first time (while the page takes the outcome) and answered
    from it the second (while ``compare`` applies the same call), so the side runs each call
    once; snapshots and kv events are passed through and kept. Every other attribute is the
    side's own."""

    def __init__(self, inner: OffloadModel | Target) -> None:
        self._inner = inner
        self._tape: deque[tuple[str, tuple[object, ...], object, BaseException | None]] = deque()
        self._replaying = False
        self._astray: str | None = None
        self.snapshot_taken: Snapshot | None = None
        self.events: tuple[KVEvent, ...] = ()
        # Set on the instance, only where the side has them: a protocol check by
        # ``isinstance`` (Injectable, HoldsBytes) must see the side's own answer.
        for name in _APPLIED:
            if hasattr(inner, name):
                setattr(self, name, self._taped(name, getattr(inner, name)))
        for name in _PASSED:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _taped(self, name: str, method: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            if self._replaying:
                if not self._tape or self._tape[0][:2] != (name, args):
                    self._astray = f"{name}{args}"
                    raise LookupError(f"the page's tape has no {name}{args}")
                _, _, result, error = self._tape.popleft()
                if error is not None:
                    raise error
                return result
            try:
                result = method(*args)
            except BaseException as error:
                self._tape.append((name, args, None, error))
                raise
            self._tape.append((name, args, result, None))
            return result

        return call

    def replay(self) -> None:
        self._replaying = True
        self.snapshot_taken = None
        self.events = ()

    def done(self) -> str | None:
        """Back to live calls; what the replay asked that the tape did not hold, if anything
        (the call must have been answered from the tape exactly)."""
        self._replaying = False
        astray = self._astray or (f"{len(self._tape)} answers left" if self._tape else None)
        self._tape.clear()
        self._astray = None
        return astray

    def snapshot(self) -> Snapshot:
        taken = self._inner.snapshot()
        self.snapshot_taken = taken
        return taken

    def take_events(self) -> list[KVEvent]:
        taken = self._inner.take_events()
        self.events = tuple(sorted(taken, key=KVEvent.sort_key))
        return taken


@dataclass(frozen=True)
class Step:
    """One call as both sides ran it. ``target_outcome`` is None where the target was not
    asked (the model broke an invariant on the call); a snapshot is None where none could be
    taken (the target's snapshot raised, or the target was not asked)."""

    n: int
    call: Call
    model_outcome: object
    target_asked: bool
    target_outcome: object
    model_snapshot: Snapshot | None
    target_snapshot: Snapshot | None
    model_events: tuple[KVEvent, ...]
    target_events: tuple[KVEvent, ...]
    difference: str | None


@dataclass(frozen=True)
class Trace:
    """A program driven on ``variant`` of the model and a target, to its first difference
    (the last step's) or to its end."""

    variant: str
    config: OffloadConfig
    program: tuple[Call, ...]
    steps: tuple[Step, ...]

    @property
    def difference(self) -> str | None:
        """What ``lockstep.disagreement`` says of the program: the first difference, or None."""
        return self.steps[-1].difference if self.steps else None

    @property
    def differs_at(self) -> int | None:
        return self.steps[-1].n if self.difference is not None else None


def record(
    factory: Callable[[OffloadConfig], Target],
    variant: str,
    config: OffloadConfig,
    program: Sequence[Call],
) -> Trace:
    """Drive ``program`` on ``variant`` of the model and a target built by ``factory``, as
    ``lockstep.disagreement`` does, keeping every call's outcomes, snapshots and difference;
    the first call that differs ends the trace. The target is closed afterwards."""
    model = _Side(OffloadModel(config, variant=variant, check=keeps_invariants(variant)))
    target = _Side(factory(config))
    steps: list[Step] = []
    try:
        for n, call in enumerate(program):
            steps.append(_step(model, target, n, tuple(call)))
            if steps[-1].difference is not None:
                break
    finally:
        close = getattr(target, "close", None)
        if close is not None:
            close()
    return Trace(variant, config, tuple(tuple(call) for call in program), tuple(steps))


def _step(model: _Side, target: _Side, n: int, call: Call) -> Step:
    broke = False
    try:
        expected = outcome(cast(OffloadModel, model), call)
    except InvariantViolation as error:
        # compare says so without asking the target; the outcome shown is the violation
        expected, broke = as_outcome(error), True
    actual = None if broke else target_outcome(cast(Target, target), call)
    model.replay()
    target.replay()
    try:
        difference = compare(
            cast(OffloadModel, model), cast(Target, target), call, n, incremental=False
        )
    finally:
        astray = [side.done() for side in (model, target)]
    if any(astray):
        # compare applied the call otherwise than the page did: its verdict would not be
        # about the outcomes shown
        raise RuntimeError(f"the lockstep applied call {n} otherwise: {astray}")
    mine = model.snapshot_taken
    if mine is None and broke:
        # compare takes none where the model broke; a snapshot only reads the state
        mine = _try_snapshot(model)
    return Step(
        n,
        call,
        expected,
        not broke,
        actual,
        mine,
        target.snapshot_taken,
        model.events,
        target.events,
        difference,
    )


def _try_snapshot(side: _Side) -> Snapshot | None:
    try:
        return side.snapshot()
    except Exception:  # a model that broke may not be readable: the page says so
        return None


# -- the page --------------------------------------------------------------------------

_CSS = """
body{font:13px/1.45 sans-serif;margin:18px;color:#1d1d1d;background:#fff}
h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:22px 0 6px;padding-top:8px;
border-top:2px solid #c8c8c8}h3{font-size:13px;margin:4px 0}
summary{cursor:pointer;margin:16px 0 6px;padding-top:6px;border-top:1px solid #c8c8c8}
summary h2{display:inline;border:0;margin:0;padding:0}
.differs{background:#ffc400}
.verdict{font-size:15px;font-weight:bold}.first{border-left:6px solid #b3410e;padding:6px 10px}
.at{font-weight:bold}.note{color:#555}.muted{color:#888}
pre{white-space:pre-wrap;word-break:break-all;background:#f3f3f3;padding:8px;margin:4px 0}
table{border-collapse:collapse;margin:2px 0 10px}
td,th{border:1px solid #c8c8c8;padding:1px 6px;text-align:left;vertical-align:top}
td{font-family:monospace}caption{caption-side:top;text-align:left;color:#444;padding:2px 0}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:4px 22px}
"""

_LEGEND = (
    '<p><span class="differs">&nbsp;highlighted&nbsp;</span> a value that differs between the '
    "model and the target, the same colour in every table (where a row is on one side only, "
    "the other side says <i>absent</i>). A key is written <code>gGROUP:DIGEST@TOKENS</code>: "
    "its KV cache group, the first hex digits of its prefix digest, and the number of tokens "
    "of the prefix it names. &ndash; means none.</p>"
)

# A table's rows: what matches a row with the other side's, its label, its other cells.
_Row = tuple[Hashable, str, tuple[object, ...]]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _show(value: object, nested: bool = False) -> str:
    """A cell's text: keys short, sequences as lists, none as a dash."""
    if value is None:
        return "\u2013"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, BlockKey):
        return str(value)
    if isinstance(value, (tuple, list)):
        if not value and not nested:
            return "\u2013"
        items = ", ".join(_show(v, nested=True) for v in value)
        return f"[{items}]" if nested else items
    return str(value)


def _cell(value: object, differs: bool, span: int = 1) -> str:
    mark = ' class="differs"' if differs else ""
    wide = f' colspan="{span}"' if span > 1 else ""
    return f"<td{mark}{wide}>{_e(_show(value))}</td>"


def _side(
    ident: str,
    caption: str,
    columns: Sequence[str],
    rows: Sequence[_Row],
    facing: Sequence[_Row] | None,
) -> str:
    """One side's table. Against ``facing`` (the other side's rows; None: nothing to compare
    with), a cell that differs is highlighted, a row the other side lacks wholly, and a row
    only the other side has is written here as absent, in the same place."""
    own = {row[0]: row for row in rows}
    other = {row[0]: row for row in facing or ()}
    order = [row[0] for row in rows] + [key for key in other if key not in own]
    body = []
    for key in order:
        if key not in own:
            absent = _cell(other[key][1], True) + _cell("absent", True, len(columns) - 1)
            body.append(f"<tr>{absent}</tr>")
            continue
        _, label, cells = own[key]
        match = other.get(key)
        gone = facing is not None and match is None
        row = _cell(label, gone) + "".join(
            _cell(v, gone or (match is not None and match[2][i] != v)) for i, v in enumerate(cells)
        )
        body.append(f"<tr>{row}</tr>")
    if not body:
        body.append(f'<tr><td class="muted" colspan="{len(columns)}">none</td></tr>')
    head = "".join(f"<th>{_e(column)}</th>" for column in columns)
    return (
        f'<table id="{ident}"><caption>{_e(caption)}</caption><tr>{head}</tr>'
        + "".join(body)
        + "</table>"
    )


def _pool_rows(pool: PoolView) -> list[_Row]:
    place = {block: i for i, block in enumerate(pool.free_queue)}
    return [
        (
            b.block_id,
            f"{b.block_id} (null)" if b.block_id == 0 else str(b.block_id),
            (b.ref_cnt, b.primary, b.primary_tokens, b.secondary, place.get(b.block_id)),
        )
        for b in pool.blocks
    ]


def _transfer_rows(snapshot: Snapshot) -> list[_Row]:
    rows: list[_Row] = []
    for kind, transfers in (
        ("pending flush", snapshot.pending_flushes),
        ("store", snapshot.store_events),
        ("abandoned store", snapshot.abandoned_store_events),
    ):
        rows += [
            ((kind, i), f"{kind} #{i}", (t.event, None, t.gpu_block_ids, t.cpu_block_ids, None))
            for i, t in enumerate(transfers)
        ]
    for kind, loads in (("load", snapshot.loads), ("abandoned load", snapshot.abandoned_loads)):
        rows += [
            (
                (kind, i),
                f"{kind} #{i}",
                (
                    load.transfer.event,
                    load.request_id,
                    load.transfer.gpu_block_ids,
                    load.transfer.cpu_block_ids,
                    load.finished,
                ),
            )
            for i, load in enumerate(loads)
        ]
    return rows


# Snapshot fields with a table of their own; every other field is a row of "other".
_OWN_TABLES = frozenset(
    (
        "gpu",
        "cpu",
        "requests",
        "tracked",
        "pending_flushes",
        "store_events",
        "abandoned_store_events",
        "loads",
        "abandoned_loads",
    )
)


def _rows(snapshot: Snapshot) -> dict[str, list[_Row]]:
    """Every table's rows, by table: together they hold every field of the snapshot."""
    return {
        "gpu": _pool_rows(snapshot.gpu),
        "gpu-free": [("queue", "head first", (snapshot.gpu.free_queue,))],
        "gpu-keys": [(key, str(key), (blocks,)) for key, blocks in snapshot.gpu.cached],
        "cpu": _pool_rows(snapshot.cpu),
        "cpu-free": [("queue", "head first", (snapshot.cpu.free_queue,))],
        "cpu-keys": [(key, str(key), (blocks,)) for key, blocks in snapshot.cpu.cached],
        "transfers": _transfer_rows(snapshot),
        "requests": [
            (
                r.request_id,
                r.request_id,
                (r.status, r.num_tokens, r.num_computed_tokens, r.output, r.block_ids),
            )
            for r in snapshot.requests
        ],
        "tracked": [
            (
                t.request_id,
                t.request_id,
                (t.num_stored_blocks, t.block_ids, t.store_events, t.finished),
            )
            for t in snapshot.tracked
        ],
        "other": [
            (f.name, f.name.replace("_", " "), (getattr(snapshot, f.name),))
            for f in fields(snapshot)
            if f.name not in _OWN_TABLES
        ],
    }


_POOL_COLUMNS = ("block", "ref count", "key", "key tokens", "secondary keys", "free-queue place")
# (table, caption, columns): what each table of a call shows.
_TABLES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "gpu",
        "GPU pool: every block (0 is the null block), its ref count (the requests and "
        "transfers holding it), the key it is cached under, the tokens that key covers, its "
        "secondary (fine-grained) keys, and its place in the free queue (0 is reused first, "
        "\u2013 is not free)",
        _POOL_COLUMNS,
    ),
    (
        "gpu-free",
        "GPU free queue: the free blocks in the order they are reused",
        ("order", "blocks"),
    ),
    ("gpu-keys", "GPU key map: the blocks cached under each key", ("key", "blocks")),
    ("cpu", "CPU pool: the host blocks, with the same columns", _POOL_COLUMNS),
    (
        "cpu-free",
        "CPU free queue: the free host blocks in the order they are reused",
        ("order", "blocks"),
    ),
    ("cpu-keys", "CPU key map: the host blocks a hit can load, per key", ("key", "blocks")),
    (
        "transfers",
        "Transfers in flight: final flushes queued and not sent yet (pending flush), stores "
        "sent and not reported by every worker, loads, and those a reset abandoned",
        ("transfer", "event", "request", "GPU blocks", "CPU blocks", "finished"),
    ),
    (
        "requests",
        "Requests: status, tokens (prompt and output), tokens computed, output token ids, "
        "the GPU blocks held per KV group",
        ("request", "status", "tokens", "computed", "output", "blocks per group"),
    ),
    (
        "tracked",
        "Store tracking: per request, the blocks stored so far per group, its block table, "
        "its store events, whether it finished",
        ("request", "stored per group", "blocks per group", "store events", "finished"),
    ),
    (
        "other",
        "Other state: GPU blocks in flight, the event bookkeeping, the counters",
        ("field", "value"),
    ),
)


def _differing_fields(step: Step) -> list[str]:
    mine, theirs = step.model_snapshot, step.target_snapshot
    if mine is None or theirs is None:
        return []
    return [f.name for f in fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]


_EVENT_COLUMNS = ("kind", "key", "parent", "token ids", "block size")


def _event_rows(events: Sequence[KVEvent]) -> list[_Row]:
    """Events matched by what they say: the second of two equal events by its order."""
    seen: dict[object, int] = {}
    rows: list[_Row] = []
    for event in events:
        what = event.sort_key()
        seen[what] = seen.get(what, -1) + 1
        cells = (event.key, event.parent, event.token_ids, event.block_size)
        rows.append(((what, seen[what]), event.kind, cells))
    return rows


def _returned(ident: str, value: object, differs: bool) -> str:
    mark = ' class="differs"' if differs else ""
    return (
        f'<table id="{ident}"><caption>what the call returned (an error as Type: message)'
        f"</caption><tr><td{mark}>{_e(repr(value))}</td></tr></table>"
    )


def _call_section(step: Step, variant: str, target_label: str, shown: bool) -> str:
    """The state after one call, both sides; folded (one line that opens it) unless
    ``shown``."""
    n = step.n
    title = _e(f"Call {n}: {step.call}")
    if step.difference is not None:
        # (the difference's text is the page's first paragraph: not written twice)
        head = f'<summary><h2 class="at">{title} &ndash; differs here</h2></summary>'
    else:
        head = f'<summary><h2>{title}</h2> <span class="note">the model and the target agree'
        head += "" if shown else " (open it for the state after it)"
        head += "</span></summary>"
    differing = _differing_fields(step)
    if differing:
        head += f"<p>Snapshot fields that differ: {_e(', '.join(differing))}</p>"
    pair = [f"<h3>the model ({_e(variant)})</h3>", f"<h3>the target: {_e(target_label)}</h3>"]
    differs = step.target_asked and step.model_outcome != step.target_outcome
    pair.append(_returned(f"call-{n}-returned-model", step.model_outcome, differs))
    pair.append(
        _returned(f"call-{n}-returned-target", step.target_outcome, differs)
        if step.target_asked
        else '<p class="note">not asked: the model broke an invariant on this call</p>'
    )
    if step.model_events or step.target_events:
        caption = "kv-cache events the call published, matched as a multiset"
        model_events, target_events = (
            _event_rows(step.model_events),
            _event_rows(step.target_events),
        )
        pair.append(
            _side(f"call-{n}-events-model", caption, _EVENT_COLUMNS, model_events, target_events)
        )
        pair.append(
            _side(f"call-{n}-events-target", caption, _EVENT_COLUMNS, target_events, model_events)
        )
    mine = None if step.model_snapshot is None else _rows(step.model_snapshot)
    theirs = None if step.target_snapshot is None else _rows(step.target_snapshot)
    missing = "no snapshot: it raised" if step.target_asked else "not asked"
    for name, caption, columns in _TABLES:
        for side, rows, facing in (("model", mine, theirs), ("target", theirs, mine)):
            if rows is None:
                pair.append(f'<p class="note">{missing if side == "target" else "no snapshot"}</p>')
                continue
            ident = f"call-{n}-{name}-{side}"
            pair.append(
                _side(ident, caption, columns, rows[name], None if facing is None else facing[name])
            )
    folded = "" if not shown else " open"
    body = "\n".join(pair)
    return f'<details id="call-{n}"{folded}>{head}<div class="pair">{body}</div></details>'


def _verdict(trace: Trace) -> str:
    found = trace.difference
    if found is None:
        return (
            f"No longer differs: the model and the target agree on all {len(trace.steps)} "
            "calls of the program."
        )
    broken = model_broke(found)
    if broken is not None:
        return f"The model broke its invariant {broken} at call {trace.differs_at}."
    calls = len(trace.program)
    return f"Still differs at call {trace.differs_at} (of calls 0 to {calls - 1})."


def render(trace: Trace, failure: Failure, target_label: str) -> str:
    """The page of ``trace`` (a run of ``failure``'s program on ``target_label``)."""
    at = trace.differs_at
    first = trace.difference
    top = [
        f"<h1>{_e(target_label)} against the model ({_e(trace.variant)})</h1>",
        f'<p class="verdict">{_e(_verdict(trace))}</p>',
        f'<pre class="first">{_e(first)}</pre>' if first is not None else "",
    ]
    if failure.disagreement != first:
        top.append(
            f'<p class="note">When it was saved, on {_e(failure.adapter)} against the model '
            f"({_e(failure.variant)}), the failure said:</p>"
            f"<pre>{_e(failure.disagreement)}</pre>"
        )
    top.append(_LEGEND)
    config = "".join(
        f"<tr><th>{_e(name)}</th><td>{_e(_show(getattr(trace.config, name)))}</td></tr>"
        for name in CONFIG_FIELDS
    )
    calls = []
    for n, call in enumerate(trace.program):
        text = f'<a href="#call-{n}">{_e(call)}</a>' if n < len(trace.steps) else _e(call)
        if n == at:
            calls.append(f'<li class="at">{text} &ndash; differs here</li>')
        elif n >= len(trace.steps):
            calls.append(f'<li class="muted">{text} (not run: the trace ends at call {at})</li>')
        else:
            calls.append(f"<li>{text}</li>")
    top.append(
        '<div class="pair"><h2>The program</h2><h2>The configuration</h2>'
        '<div><p class="note">The driver calls, in order (docs/conformance.md); each links '
        f'to the state after it.</p><ol id="program" start="0">{"".join(calls)}</ol></div>'
        f'<table id="config">{config}</table></div>'
    )
    top.append("<h2>The state after each call</h2>")
    # The last call is open (the one that differs, or the program's last where none does),
    # the calls before it folded: a reviewer sees the difference first and opens the rest.
    last = len(trace.steps) - 1
    sections = [
        _call_section(step, trace.variant, target_label, step.n == last) for step in trace.steps
    ]
    data = json.dumps(failure.to_dict(), indent=1, sort_keys=True)
    bottom = (
        '<h2>Reproducer and failure file</h2><div class="pair">'
        "<h3>a program that prints the first difference (None once fixed)</h3>"
        "<h3>the failure, as saved</h3>"
        f'<pre id="reproducer">{_e(failure.reproducer())}</pre>'
        f'<pre id="failure">{_e(data)}</pre></div>'
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        # Nothing may load or run, whatever the page holds: defence behind the escaping.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'\">"
        f"<title>{_e(target_label)}: {_e(_verdict(trace))}</title>"
        f"<style>{_CSS}</style></head><body>\n"
        + "\n".join(top + sections)
        + "\n"
        + bottom
        + "\n</body></html>\n"
    )


def write_page(
    path: str | Path,
    failure: Failure,
    factory: Callable[[OffloadConfig], Target],
    variant: str,
    target_label: str,
) -> Trace:
    """Drive ``failure``'s program on ``variant`` of the model and a target built by
    ``factory``, and write the page of the run to ``path``; the trace, whose ``difference``
    is what ``lockstep.disagreement`` says."""
    trace = record(factory, variant, failure.config, failure.program)
    Path(path).write_text(render(trace, failure, target_label), encoding="utf-8")
    return trace
