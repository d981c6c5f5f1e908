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
from dataclasses import replace

from kvoffload.model import InvariantViolation
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError
from kvoffload.testing.failure import Failure, model_broke, target_broke, verdict_of
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
    broken = target_broke(found)
    if broken is not None:
        return f"the target breaks {broken}"
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


Checker = Callable[[OffloadConfig], Callable[[list[Call]], str | None]]
# (configuration, program, its difference) -> the program regrouped into the machine's
# rules, its difference, and its count of rules
Regrouper = Callable[[OffloadConfig, list[Call], str], tuple[list[Call], str, int]]


def reduced(failure: Failure, disagrees: Checker, regroup: Regrouper | None = None) -> Failure:
    """``failure`` after the call-level pass, replayed by ``disagrees`` (the machine's own
    target and model variant in a configuration), in the simplest configuration in which a
    program still disagrees the same way (:func:`simplest`), then regrouped into the
    machine's rules where it says how; as it was if it does not replay (a flaky failure is
    reported as Hypothesis found it)."""
    config, program, found = simplest(failure.config, list(failure.program), disagrees)
    if found is None or verdict_of(found) != failure.verdict:
        # (a verdict's class is kept: a model that broke an invariant stays one, a target
        # that breaks one stays one, and a difference stays a difference, whatever a replay
        # of another kind shows)
        return failure
    rules = len(program)  # every call its own rule at most
    if regroup is not None:
        program, found, rules = regroup(config, program, found)
    return replace(
        failure,
        config=config,
        program=tuple(program),
        disagreement=found,
        rule_steps=min(failure.rule_steps, rules),
    )


def simplest(
    config: OffloadConfig, program: list[Call], disagrees: Checker
) -> tuple[OffloadConfig, list[Call], str | None]:
    """The configuration made as simple as :func:`simpler_config` can, the program reduced
    in it; then, since a program may need a call in its configuration that the simpler one
    must not have (a lazy program's extra step that stores a block, say), each call left
    out once more with the simpler configuration tried on what remains."""
    found = replay(disagrees(config), program)
    if found is None:
        return config, program, None
    wanted = kind(found)
    config = simpler_config(config, program, disagrees, wanted)
    program, found = reduce_program(program, disagrees(config))
    for i in range(len(program)):
        without = program[:i] + program[i + 1 :]
        simpler = simpler_config(config, without, disagrees, wanted)
        if simpler != config:
            # The configuration lattice is finite: each recursion lifts one more setting.
            return simplest(simpler, without, disagrees)
    return config, program, found


def simpler_config(
    config: OffloadConfig, program: Sequence[Call], disagrees: Checker, wanted: str
) -> OffloadConfig:
    """``config`` made simpler where ``program`` still disagrees in the same way (``wanted``,
    a :func:`~kvoffload.testing.reduce.kind`): eager instead of lazy, one worker instead of
    several. Hypothesis shrinks the choices that drew a program; a choice drawn first (the
    configuration) can rarely change without changing what every later choice means, so a
    lazy counterexample of an eager bug stays lazy, and longer, unless the configuration is
    tried on its own. One rank of decode context parallelism instead of two, too."""
    for change in ({"lazy": False}, {"dcp_world_size": 1}, {"world_size": 1}):
        # Each only lifts restrictions: a target that takes the configuration takes these.
        try:
            candidate = replace(config, **change)
        except ConfigError:  # one worker, where decode context parallelism needs two
            continue
        if candidate == config:
            continue
        result = replay(disagrees(candidate), list(program))
        if result is not None and kind(result) == wanted:
            config = candidate
    return config
