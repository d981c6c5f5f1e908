"""The efficiency figures (issue 34): counted on a target's own snapshots call by call, each
count moved by the case it names, and reported beside the verdict without changing it."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import settings

from kvoffload.model import OffloadModel
from kvoffload.model.snapshot import Snapshot
from kvoffload.testing import profiles
from kvoffload.testing.campaign import report, run_campaign
from kvoffload.testing.efficiency import Efficiency, ProgramEfficiency
from kvoffload.testing.lockstep import Call, outcome

from helpers import config, prompt

P = prompt(49)  # three full blocks of 16 and a token


def _run(model: OffloadModel, counts: ProgramEfficiency, calls: list[Call]) -> Snapshot:
    for call in calls:
        before = model.snapshot()
        result = outcome(model, call)
        counts.observe(call, before, model.snapshot(), result)
    return model.snapshot()


def _stored(model: OffloadModel, counts: ProgramEfficiency) -> Snapshot:
    """r0's prompt computed, finished and stored on the CPU."""
    return _run(model, counts, [("add", "r0", P, 1), ("step", 64), ("step", 0), ("drain",)])


def test_a_repeated_prompt_is_served_every_block_its_tiers_hold() -> None:
    model, counts = OffloadModel(config(8, 8)), ProgramEfficiency(config(8, 8))
    _stored(model, counts)
    _run(model, counts, [("add", "r1", P, 1), ("step", 64)])
    c = counts.end(model.snapshot())
    # r0 found nothing held; r1 its three blocks, all served (the last token is computed)
    assert (c.admitted, c.held_blocks, c.served_blocks, c.unserved_blocks) == (2, 3, 3, 0)
    assert (c.stored_blocks, c.stored_twice, c.stranded_cpu_blocks) == (3, 0, 0)


def test_blocks_held_but_not_served_are_counted() -> None:
    """A target that recomputes a prompt its tiers hold: the held blocks are those of the
    snapshot before the step, the served ones what it scheduled."""
    cfg = config(8, 8)
    held = OffloadModel(cfg)
    _stored(held, ProgramEfficiency(cfg))
    before = held.snapshot()
    fresh, counts = OffloadModel(cfg), ProgramEfficiency(cfg)
    _run(fresh, counts, [("add", "r1", P, 1)])
    result = fresh.step(64)  # nothing held here: all 49 tokens computed
    counts.observe(("step", 64), before, fresh.snapshot(), result)
    c = counts.end(None)
    assert (c.admitted, c.held_blocks, c.served_blocks, c.unserved_blocks) == (1, 3, 0, 3)


def test_a_request_that_skips_reading_is_not_counted() -> None:
    model, counts = OffloadModel(config(8, 8)), ProgramEfficiency(config(8, 8))
    _stored(model, counts)
    _run(model, counts, [("add", "r1", P, 1, True), ("step", 64)])
    assert counts.end(None).admitted == 1  # r0 only


def test_a_store_of_a_key_the_cpu_holds_is_a_copy_made_twice() -> None:
    cfg = config(8, 8)
    model, counts = OffloadModel(cfg), ProgramEfficiency(cfg)
    _run(model, counts, [("add", "r0", P, 3), ("step", 64)])
    before = model.snapshot()
    result = model.step(8)  # the scan stores the three blocks the first step confirmed
    after = model.snapshot()
    # the state before the step, as a target whose CPU already held r0's first key
    key = after.gpu.blocks[after.store_events[0].gpu_block_ids[0]].primary
    assert key is not None
    stale = replace(before, cpu=before.cpu._replace(cached=((key, (1,)),)))
    counts.observe(("step", 8), stale, after, result)
    c = counts.end(None)
    assert (c.stored_blocks, c.stored_twice) == (3, 1)


def test_a_cpu_block_whose_prefix_no_tier_holds_is_stranded() -> None:
    cfg = config(8, 8)
    model, counts = OffloadModel(cfg), ProgramEfficiency(cfg)
    last = _stored(model, counts)
    assert counts.end(last).stranded_cpu_blocks == 0
    # the first block's key gone from both maps: the second and third are unreachable
    first = next(key for key, _ in last.cpu.cached if key.num_tokens == 16)
    gone = replace(
        last,
        gpu=last.gpu._replace(cached=tuple(e for e in last.gpu.cached if e[0] != first)),
        cpu=last.cpu._replace(cached=tuple(e for e in last.cpu.cached if e[0] != first)),
    )
    counts = ProgramEfficiency(cfg, prompts={"r0": tuple(P)})
    assert counts.end(gone).stranded_cpu_blocks == 1  # the second block; the third's prefix is held


def test_figures_add_up_and_read_as_a_line() -> None:
    total = Efficiency()
    total.add(Efficiency(admitted=2, held_blocks=5, served_blocks=4, unserved_blocks=1))
    total.add(Efficiency(admitted=1, stored_blocks=3, stored_twice=1))
    assert total.as_dict()["admitted"] == 3 and total.unserved_blocks == 1
    assert "4 of 5 held blocks served (1 unserved)" in total.line()
    assert "1 of 3 stored blocks" in total.line()


def test_a_campaign_reports_its_figures_beside_the_verdict() -> None:
    result = run_campaign("impl", settings(profiles.get("ci"), max_examples=40))
    assert result.conforms
    figures = report(result, "ci", None, 0)["efficiency"]
    assert figures == result.recorder.efficiency.as_dict()
    assert figures["admitted"] > 0 and figures["stored_blocks"] > 0
    assert figures["served_blocks"] <= figures["held_blocks"]
    assert figures["stored_twice"] <= figures["stored_blocks"]
