"""The lockstep throughput measurement: both machines run and are reported side by side.
(Figures are recorded by ``kvoffload bench``, never asserted here.)"""

from __future__ import annotations

from kvoffload.testing.stateful import machine_for
from kvoffload.testing.throughput import Throughput, TrivialMachine, measure, report


def test_both_machines_run_the_same_programs() -> None:
    result = measure(examples=5, rounds=1)
    assert result.lockstep_steps > 0 and result.trivial_steps > 0
    assert result.lockstep_calls >= result.lockstep_steps  # a rule makes at least one call
    assert result.ratio == result.lockstep_rate / result.trivial_rate
    assert TrivialMachine.steps == result.trivial_steps


def test_the_report_gives_rates_and_ratio() -> None:
    summary, section = report(Throughput(10, 300, 1.5, 900, 1.0, 450))
    assert "200 steps/s against 900" in summary[0] and "ratio 0.22" in summary[0]
    assert "| conformance | 300 | 1.50 | 200 |" in section
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
