"""The lockstep throughput measurement: both machines run and are reported side by side.
(Figures are recorded by ``kvoffload bench``, never asserted here.)"""

from __future__ import annotations

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
