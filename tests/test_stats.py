"""The connector's stats (vLLM's ``get_stats``): what a drain reports, model and
implementation alike."""

from __future__ import annotations

from typing import cast

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadModel, OffloadStats
from kvoffload.testing.lockstep import apply

from scenarios import SCENARIOS


def _reports(side: str, name: str) -> list[OffloadStats]:
    """The stats reports of scenario ``name`` run on the model or the implementation."""
    config, program = SCENARIOS[name]
    target = (
        OffloadModel(config)
        if side == "model"
        else OffloadImpl(config, device="cpu", lockstep=True)
    )
    results = [apply(target, call) for call in program]
    reports = [r for r, call in zip(results, program, strict=True) if call[0] == "stats"]
    assert all(isinstance(r, OffloadStats) for r in reports)
    return cast(list[OffloadStats], reports)


@pytest.mark.parametrize("side", ["model", "implementation"])
def test_a_store_abandoned_by_a_reset_stays_pending_until_its_copy_completes(side: str) -> None:
    in_flight, after_reset, done = _reports(side, "stats-across-reset")
    # Two full blocks of a 33-token prompt in 16-token blocks, stored in flight; the null
    # block is always in use.
    assert in_flight == OffloadStats(0, 3, 2, 16, False)
    assert after_reset == in_flight  # abandoned, still pinned
    assert done == OffloadStats(0, 1, 0, 16, False)


@pytest.mark.parametrize("side", ["model", "implementation"])
def test_a_completed_load_is_counted_by_the_next_drain_only(side: str) -> None:
    loading, loaded, again = _reports(side, "stats-count-a-load-once")
    assert loading.load_blocks == 0 and loading.used_blocks == 3  # pinned by the load
    assert loaded.load_blocks == 2 and loaded.used_blocks == 1
    assert again.load_blocks == 0


def test_stats_report_the_configuration() -> None:
    config, _ = SCENARIOS["lazy-store-return-and-load"]
    report = OffloadModel(config).stats()
    assert report == OffloadStats(0, 1, 0, config.cpu_blocks, True)
