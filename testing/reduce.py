"""Call-level reduction of a shrunk failure: the last pass after Hypothesis's shrinker.

Hypothesis shrinks the choices that drew a program, and now and then stops with calls in it
that nothing needs (a run of ``reset`` a derandomized search began with and no shrink pass
could delete). This pass works on the program itself: it deletes chunks of calls, from half
the program down to single calls, keeping each deletion after which the program still
disagrees, until no single call can go (delta debugging's 1-minimality).

Invariants kept:

- the reduced program is a subsequence of the original, and it disagrees in the same way
  (:func:`kind`: the same snapshot fields, the same call's result, or the same message up to
  numbers), so that a reduction never trades the bug found for another one;
- every call is its own rule of the machine, so the reduced program's length bounds the
  rules that produce it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvoffload.model import InvariantViolation
from kvoffload.testing.failure import model_broke
from kvoffload.testing.lockstep import Call


def reduce_program(
    program: Sequence[Call], disagrees: Callable[[list[Call]], str | None]
) -> tuple[list[Call], str | None]:
    """The smallest subsequence of ``program`` this pass finds on which ``disagrees`` still
    returns a difference, with that difference (None if ``program`` itself conforms)."""
    current = list(program)
    found = replay(disagrees, current)
    if found is None:
        return current, None
    wanted = kind(found)
    chunk = max(1, len(current) // 2)
    while True:
        start, removed = 0, False
        while start < len(current):
            candidate = current[:start] + current[start + chunk :]
            result = replay(disagrees, candidate)
            if result is not None and kind(result) == wanted:
                current, found, removed = candidate, result, True
            else:
                start += chunk
        if chunk == 1 and not removed:
            return current, found
        chunk = max(1, chunk // 2) if not removed else chunk


_CALL = re.compile(r"^call \d+ \('(\w+)'.*?\): ")
_DATA = re.compile(r"(cpu|gpu) block \d+ layer \d+ does not hold the KV")
_FIELDS = re.compile(r"snapshots differ in (\[[^\]]*\])")


def kind(found: str) -> str:
    """What kind of difference ``found`` describes, whatever the blocks and ids in it."""
    invariant = model_broke(found)
    if invariant is not None:
        return f"the model broke {invariant}"
    fields = _FIELDS.search(found)
    if fields:
        return "snapshot " + fields.group(1)
    call = _CALL.match(found)
    rest = found[call.end() :] if call else found
    if rest.startswith("model returned"):
        return f"result of {call.group(1) if call else '?'}"
    data = _DATA.search(rest)
    if data:
        return f"KV bytes of a {data.group(1)} block"
    return re.sub(r"\d+", "N", rest.split(":")[0])


def replay(disagrees: Callable[[list[Call]], str | None], program: list[Call]) -> str | None:
    """The difference ``program`` shows, or None: also for no program at all, and for one
    whose own model raises a broken invariant (the lockstep reports a model that breaks one
    as a difference of its own :func:`kind`, never a reduction of another)."""
    if not program:
        return None
    try:
        return disagrees(program)
    except InvariantViolation:
        return None
