"""The lockstep throughput measurement: both machines run and are reported side by side.
(Figures are recorded by ``kvoffload bench``, never asserted here.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload.testing.machine import Recorder
from kvoffload.testing.stateful import machine_for
from kvoffload.testing.throughput import Throughput, TrivialMachine, measure, report


def test_both_machines_run_the_same_programs() -> None:
    result = measure(examples=5, rounds=1)
    assert result.lockstep_steps > 0 and result.trivial_steps > 0
    assert result.lockstep_calls >= result.lockstep_steps  # a rule makes at least one call
    assert result.ratio == result.lockstep_rate / result.trivial_rate
    # the same programs, the checks aside: the same rules, the same driver calls
    assert result.unchecked_steps == result.lockstep_steps > 0
    assert result.unchecked_calls == result.lockstep_calls
    assert result.floor_ratio == result.unchecked_rate / result.trivial_rate
    assert TrivialMachine.steps == result.trivial_steps


def test_the_report_gives_rates_and_ratio() -> None:
    summary, section = report(Throughput(10, 300, 1.5, 900, 1.0, 450, 300, 0.5, 450))
    assert "200 steps/s against 900" in summary[0] and "ratio 0.22" in summary[0]
    assert "nothing checked: ratio 0.67" in summary[0]
    assert "| conformance | 300 | 1.50 | 200 |" in section
    assert "| unchecked | 300 | 0.50 | 600 |" in section
    assert any("the checks take 67% of" in line for line in section)
    assert any("same programs (450 driver calls)" in line for line in section)
    assert "| trivial | 900 | 1.00 | 900 |" in section
    assert any("450 driver calls, 1.5 per rule" in line for line in section)


def _rules(machine: type) -> dict[str, dict[str, object]]:
    """Each rule of a Hypothesis state machine class, by name, with its argument strategies."""
    marked = (getattr(machine, name, None) for name in dir(machine))
    rules = (getattr(f, "hypothesis_stateful_rule", None) for f in marked)
    return {r.function.__name__: dict(r.arguments) for r in rules if r is not None}


def test_the_trivial_machine_has_the_conformance_machines_rules_and_draws() -> None:
    # The ratio means something only while both machines draw alike: a draw added to the
    # conformance machine (a request flag, say) must be added to the trivial one too.
    trivial, conformance = _rules(TrivialMachine), _rules(machine_for("impl", loads=False))
    assert trivial.keys() == conformance.keys()
    for name, arguments in conformance.items():
        assert trivial[name] == arguments, name


def test_the_unchecked_machine_makes_the_calls_and_checks_nothing() -> None:
    # Its rate bounds the conformance machine's only while it does the same work less the
    # checks: a fault the conformance machine finds in its first programs runs through it
    # unnoticed, on as many programs.
    config = settings(
        max_examples=10,
        stateful_step_count=30,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    fault = "fault:pin-dropped-early"
    checked = Recorder()
    with pytest.raises(AssertionError, match="reproduce with"):
        run_state_machine_as_test(machine_for(fault, checked, loads=False), settings=config)
    unchecked = Recorder()
    machine = machine_for(fault, unchecked, loads=False, checks=False)
    run_state_machine_as_test(machine, settings=config)
    assert unchecked.programs >= 10 > checked.programs  # (assume() rejects a layout or two)
    assert unchecked.steps >= unchecked.rule_steps > 0
    assert not unchecked.invariants  # no invariant counted: none was checked
    assert checked.invariants
