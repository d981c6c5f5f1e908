"""What every lockstep machine shares: the program it records, the recorder it reports to, its
failures as data, and the one campaign loop that runs any of them in batches.

A machine (:mod:`kvoffload.testing.stateful`'s offload machine, over the implementation or
vLLM's offload code; :mod:`kvoffload.testing.scheduler_machine`'s, over vLLM's own
``Scheduler``) subclasses :class:`LockstepMachine` with its rules, and says only how one call
is checked (:meth:`LockstepMachine.check`) and what a failure of it is
(:meth:`LockstepMachine.failure`).

Invariants kept:

- ONE RECORD: every call a rule makes goes through :meth:`LockstepMachine.run`, so the
  program of a failure is exactly the calls applied, in order; a rule is counted once
  however many calls it makes (``continued``).
- FAILURE AS DATA: the first difference of a program becomes a
  :class:`~kvoffload.testing.failure.Failure` of the machine that found it, left in the
  recorder for the campaign (which reduces and saves it) and shown with its reproducer,
  built from validated literals only.
- REDUCED AND SAVED: a campaign (:func:`run_machine_campaign`) reduces the failure it
  stops at with the machine's own reduction and saves it
  (:func:`~kvoffload.testing.failure.save`), whichever machine found it.
- BATCHES: :func:`run_batches` runs batch ``k`` of a random profile from seed ``seed + k``
  (``seed`` drawn when not given), until a failure, the profile's examples (no
  ``seconds``), or the time is spent; a failure that is not a recorded difference (an
  error of the machine) propagates, never passes for conformance.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvoffload.model import OffloadConfig
from kvoffload.testing.efficiency import Efficiency
from kvoffload.testing.failure import (
    BREAKS,
    Failure,
    model_broke,
    save,
    target_broke,
    validate,
)
from kvoffload.testing.lockstep import Call
from kvoffload.testing.progress import Progress


@dataclass
class Recorder:
    """What a campaign saw: programs, steps, rule and invariant counts, the last failure."""

    programs: int = 0
    steps: int = 0  # driver calls
    rule_steps: int = 0  # Hypothesis steps (rules run, the initial request included)
    rules: dict[str, int] = field(default_factory=dict)
    invariants: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    first_failure: float | None = None
    first_failing_program: int | None = None  # 1 when the very first program failed
    failure: dict[str, Any] | None = None
    # per kind of layout ("full attention", "hybrid"): programs run, their driver calls and
    # the seconds spent in them
    layout_programs: dict[str, int] = field(default_factory=dict)
    layout_calls: dict[str, int] = field(default_factory=dict)
    layout_seconds: dict[str, float] = field(default_factory=dict)
    # what the target's cache cost in hits and copies (issue 34: never a verdict)
    efficiency: Efficiency = field(default_factory=Efficiency)
    # called as each program ends (a campaign's progress), if set
    on_program: Callable[[Recorder], None] | None = None

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def timed(self, layout: str, calls: int, seconds: float) -> None:
        """One program of ``layout``'s kind made ``calls`` driver calls in ``seconds``, setup
        to teardown."""
        self.count(self.layout_programs, layout)
        self.layout_calls[layout] = self.layout_calls.get(layout, 0) + calls
        self.layout_seconds[layout] = self.layout_seconds.get(layout, 0.0) + seconds
        if self.on_program is not None:
            self.on_program(self)

    def speeds(self) -> dict[str, tuple[float, float]]:
        """Per kind of layout, programs and driver calls per second of the time spent in
        them."""
        return {
            layout: (n / seconds, self.layout_calls[layout] / seconds)
            for layout, n in sorted(self.layout_programs.items())
            if (seconds := self.layout_seconds.get(layout, 0.0)) > 0
        }


class TargetBrokeInvariant(AssertionError):
    """A failing program on which the target's own state breaks an invariant of the spec."""


class LockstepMachine(RuleBasedStateMachine):
    """The base of the machines: subclass with ``recorder`` and ``variant`` set, rules that
    call :meth:`run`, a setup that calls :meth:`begin`, and :meth:`check` and
    :meth:`failure`."""

    variant: ClassVar[str] = "fixed"  # the model variant the target is compared with
    recorder: ClassVar[Recorder] = Recorder()

    config: OffloadConfig
    program: list[Call]
    prompts: list[list[int]]
    layout_kind: str  # the kind of layout the recorder times the program under

    def begin(self, config: OffloadConfig, layout_kind: str, started: float) -> None:
        """A new program on ``config``: nothing recorded yet."""
        self.config = config
        self.program = []
        self.prompts = []
        self.next_id = 0
        self.rule_steps = 0
        self.started = started
        self.layout_kind = layout_kind
        type(self).recorder.programs += 1
        type(self).recorder.failure = None  # what a failing example leaves is its own

    def run(self, call: Call, rule_name: str, continued: bool = False) -> None:
        """Apply ``call`` to both sides and compare. ``continued``: the call is not the first
        of its rule (rules that make several calls count as one step when shrunk)."""
        rec = type(self).recorder
        rec.steps += 1
        self.program.append(call)
        if not continued:
            rec.count(rec.rules, rule_name)
            self.rule_steps += 1
            rec.rule_steps += 1
        found = self.check(call, len(self.program) - 1)
        if found:
            if rec.first_failure is None:
                rec.first_failure = time.perf_counter() - rec.started
                rec.first_failing_program = rec.programs
            failure = self.failure(found)
            rec.failure = failure.to_dict()
            message = f"{found}\n\nreproduce with:\n{failure.reproducer()}"
            # One exception type per verdict class, so that Hypothesis shrinks each class as
            # a bug of its own and never trades a broken invariant for a mere difference
            # (issue 34).
            if failure.verdict == BREAKS:
                raise TargetBrokeInvariant(message)
            raise AssertionError(message)

    def check(self, call: Call, n: int) -> str | None:
        """Apply call ``n`` to both sides: the first difference, or None."""
        raise NotImplementedError

    def failure(self, found: str) -> Failure:
        """The program so far, failing with ``found``, as data."""
        raise NotImplementedError

    def close_target(self) -> None:
        """Let the target's threads or devices go with its program."""

    def teardown(self) -> None:
        self.close_target()
        if hasattr(self, "layout_kind"):  # a program whose setup ran
            type(self).recorder.timed(
                self.layout_kind, len(self.program), time.perf_counter() - self.started
            )


@dataclass(frozen=True)
class Batches:
    """What :func:`run_batches` ran: the failure it stopped at, the seeds, the time."""

    failure: dict[str, Any] | None
    seed: int | None  # the failing batch's seed, or the first batch's
    seconds: float


def run_batches(
    machine: type[LockstepMachine],
    batch: settings,
    seconds: float | None = None,
    seed: int | None = None,
    stop: Callable[[], bool] | None = None,
    after_batch: Callable[[float], None] | None = None,
) -> Batches:
    """Run ``machine`` under ``batch`` until a failure; once (no ``seconds``), or batch
    after batch until ``seconds`` are spent or ``stop()`` says so. ``after_batch`` is told
    the seconds spent after each batch."""
    recorder = machine.recorder
    if seed is None and not batch.derandomize:
        seed = random.getrandbits(32)
    used = seed
    start = time.perf_counter()
    failure: dict[str, Any] | None = None
    for n in itertools.count():
        if seed is not None:
            used = seed + n
            hypothesis_seed(used)(machine)
        try:
            run_state_machine_as_test(machine, settings=batch)
        except (AssertionError, Flaky):
            failure = recorder.failure
            # The recorder holds the last example's disagreement; without one, what failed
            # is not a disagreement (an error of the machine) and must not pass for
            # conformance.
            if failure is None:
                raise
        elapsed = time.perf_counter() - start
        if after_batch is not None:
            after_batch(elapsed)
        if failure is not None or seconds is None or elapsed >= seconds:
            break
        if stop is not None and stop():
            break
    # a failure's batch reruns from its own seed; a clean run from the first batch's
    return Batches(failure, used if failure is not None else seed, time.perf_counter() - start)


@dataclass
class CampaignResult:
    adapter: str  # the target driven (a name of the registry, or the model alone)
    conforms: bool
    seconds: float
    first_failure: float | None
    recorder: Recorder
    failure: dict[str, Any] | None
    seed: int | None = None  # the seed of the batch that failed, or of the first batch
    saved: Path | None = None  # where the failure was saved

    @property
    def broken_invariant(self) -> str | None:
        """The invariant the model itself broke on the failure's program, or None."""
        return None if self.failure is None else model_broke(self.failure["disagreement"])

    @property
    def verdict_class(self) -> str:
        """``conforms``, ``breaks ID`` (the target's own state breaks an invariant: a bug),
        ``differs`` (every invariant holds on the target's state: a change to review), or
        ``the model broke ID``."""
        if self.failure is None:
            return "conforms"
        found = self.failure["disagreement"]
        broke = model_broke(found)
        if broke is not None:
            return f"the model broke {broke}"
        broken = target_broke(found)
        return "differs" if broken is None else f"breaks {broken}"

    @property
    def shrunk_steps(self) -> int | None:
        """Rules in the shrunk counterexample (Hypothesis's steps)."""
        return None if self.failure is None else int(self.failure["rule_steps"])

    @property
    def shrunk_calls(self) -> int | None:
        """Driver calls in the shrunk counterexample (a rule may make several)."""
        return None if self.failure is None else len(self.failure["program"])


def run_machine_campaign(
    machine: type[LockstepMachine],
    adapter: str,
    batch: settings,
    reduce: Callable[[Failure], Failure],
    seconds: float | None = None,
    seed: int | None = None,
    stop: Callable[[], bool] | None = None,
    progress: bool = False,
) -> CampaignResult:
    """:func:`run_batches` of ``machine`` (driving ``adapter``), then its failure, if any,
    reduced by ``reduce`` and saved. With ``progress``, a line per program as it ends (at
    most one per :attr:`Progress.every` in a log): a batch of the ci profile is a thousand
    programs, minutes without a word otherwise."""
    recorder = machine.recorder
    start = time.perf_counter()
    shown = Progress() if progress else None

    def say(elapsed: float) -> None:
        if shown is not None:
            shown.update(
                f"{adapter}: {recorder.programs} programs, {recorder.steps} steps, {elapsed:.0f} s"
            )

    if shown is not None:
        recorder.on_program = lambda rec: say(time.perf_counter() - start)
    try:
        batches = run_batches(machine, batch, seconds, seed, stop, say)
    finally:
        if shown is not None:
            shown.done()
        recorder.on_program = None  # a result crosses processes (the matrix's): no closure
    failure, saved = batches.failure, None
    if failure is not None:
        record = reduce(validate(failure | {"seed": batches.seed}))
        failure = record.to_dict()
        saved = save(record)
    return CampaignResult(
        adapter,
        failure is None,
        time.perf_counter() - start,
        recorder.first_failure,
        recorder,
        failure,
        batches.seed,
        saved,
    )
