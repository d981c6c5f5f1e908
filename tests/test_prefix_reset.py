"""``reset_prefix_cache``: vLLM's ``Scheduler.reset_prefix_cache`` as the specification has
it (vLLM issue #57727): True only when afterwards neither tier serves a hit."""

from __future__ import annotations

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.model import InvalidArgumentError, OffloadModel
from kvoffload.testing.lockstep import apply

from scenarios import SCENARIOS


def _run(side: str, variant: str = "fixed") -> list[object]:
    config, program = SCENARIOS["prefix-reset-keeps-cpu"]
    target = (
        OffloadModel(config, variant=variant, check=variant == "fixed")
        if side == "model"
        else OffloadImpl(config, device="cpu", lockstep=True)
    )
    return [apply(target, call) for call in program]


@pytest.mark.parametrize("side", ["model", "implementation"])
def test_a_reset_that_leaves_the_cpu_serving_reports_failure(side: str) -> None:
    *_, without, hit, with_connector, miss = _run(side)
    assert without is False and hit == 32  # two blocks of the 33-token prompt still served
    assert with_connector is True and miss == 0


def test_vllm_reports_the_gpu_reset_alone() -> None:
    *_, without, hit, with_connector, miss = _run("model", variant="reset-gpu-only")
    assert without is True and hit == 32  # success reported, the CPU tier still serving
    assert with_connector is True and miss == 0


def test_the_gpu_reset_is_refused_while_a_request_holds_blocks() -> None:
    config, _ = SCENARIOS["prefix-reset-keeps-cpu"]
    model = OffloadModel(config)
    model.add_request("r", list(range(33)), max_tokens=4)
    model.step(64)
    assert model.reset_prefix_cache(True) is False
    assert model.engine.gpu_pool.cached  # the running request's keys are kept


def test_the_flag_must_be_a_bool_and_nothing_changes() -> None:
    config, _ = SCENARIOS["prefix-reset-keeps-cpu"]
    model = OffloadModel(config)
    model.add_request("r", list(range(8)))
    model.step(8)
    before = model.snapshot()
    with pytest.raises(InvalidArgumentError, match="reset_connector must be a bool, got 1"):
        model.reset_prefix_cache(1)  # type: ignore[arg-type]
    assert model.snapshot() == before
