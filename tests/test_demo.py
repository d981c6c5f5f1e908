"""``kvoffload demo`` walks the story with every invariant checked, and shows each #53498
variant caught by its invariant."""

from __future__ import annotations

import pytest

from kvoffload.main import main


def test_demo_of_the_fixed_model_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "the final flush is queued" in out
    assert "secondary ['g0:" in out  # the prompt-tail key travelled to the CPU block
    assert "load event 0 copies cpu->gpu" in out
    assert "lookup(prompt) = 8 tokens" in out
    assert "every invariant held after every call" in out


@pytest.mark.parametrize(
    ("variant", "invariant"),
    [("no-final-flush", "FLUSH-COMPLETE"), ("phantom-primary", "POOL-PRIMARY")],
)
def test_demo_of_a_bug_variant_stops_at_the_violated_invariant(
    variant: str, invariant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--variant", variant]) == 1
    assert f"INVARIANT VIOLATED: {invariant}:" in capsys.readouterr().out


def test_an_unknown_variant_is_refused_by_the_command_line() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--variant", "nope"])
    assert caught.value.code == 2
