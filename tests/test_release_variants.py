"""The variants of vLLM's releases before and after #53532, each against the fixed model on
the scenario where they part (the code of each release says why: docs/spec.md, variants)."""

from __future__ import annotations

import pytest

from kvoffload.model import ConfigError, InvariantViolation, OffloadModel, violations
from kvoffload.model.variants import is_variant, keeps_invariants, scheduler_class
from kvoffload.testing.lockstep import apply

from helpers import complete_all_stores, make, prompt, waiting_on_a_pinned_hit
from scenarios import SCENARIOS


def test_no_hit_pins_leaves_a_found_hit_unpinned_while_its_request_waits() -> None:
    """vLLM <= 0.21.0 (#39702): nothing holds the hit between the lookup and the
    allocation; from 0.22.0 it is pinned (ref 1, out of the free queue)."""
    fixed = waiting_on_a_pinned_hit("fixed").snapshot()
    old = waiting_on_a_pinned_hit("no-hit-pins").snapshot()
    assert [h[0] for h in fixed.pending_hits] == ["b"] and old.pending_hits == ()
    pinned = fixed.pending_hits[0][1]
    assert all(fixed.cpu.blocks[i].ref_cnt == 1 for i in pinned)
    assert all(old.cpu.blocks[i].ref_cnt == 0 and i in old.cpu.free_queue for i in pinned)


def test_no_hit_pins_looks_the_hit_up_again_and_loads_the_same_blocks() -> None:
    loads = {}
    for variant in ("fixed", "no-hit-pins"):
        model = waiting_on_a_pinned_hit(variant)
        for _ in range(6):  # the hog finishes, b gets its blocks and loads
            model.step(16)
            complete_all_stores(model)
        loads[variant] = [v.transfer.cpu_block_ids for v in model.snapshot().loads]
    assert loads["fixed"] == loads["no-hit-pins"] != []


def test_step_dedup_stores_a_block_whose_store_is_in_flight_again() -> None:
    """vLLM <= 0.21.0 (PR #41289): a request that hits another's block on the GPU selects
    it again while the first store is in flight; from 0.22.0 the in-flight set skips it."""
    stored = {}
    for variant in ("fixed", "step-dedup"):
        model = make(gpu_blocks=16, cpu_blocks=16, group_block_sizes=(4,), variant=variant)
        model.checked = keeps_invariants(variant)
        tokens = prompt(9)
        model.add_request("a", tokens, max_tokens=4)
        model.step(16)  # a computes its prompt
        model.step(16)  # a's first two blocks go out in store event 0, not completed
        model.add_request("b", tokens, max_tokens=1)  # GPU hit on a's blocks
        model.step(16)
        model.step(16)
        events = model.snapshot().store_events
        stored[variant] = [i for e in events for i in e.gpu_block_ids]
    assert len(stored["fixed"]) == len(set(stored["fixed"]))
    assert len(stored["step-dedup"]) > len(set(stored["step-dedup"]))  # copied twice


def test_pool_0_23_frees_a_hashless_block_to_the_tail() -> None:
    """vLLM's BlockPool before 0.24.0 appends every freed block; 0.24.0 puts the hashless
    ones (a partial last block) at the head, to be reused first."""
    queues = {}
    for variant in ("fixed", "pool-0.23"):
        model = make(gpu_blocks=8, cpu_blocks=8, group_block_sizes=(4,), variant=variant)
        model.add_request("a", prompt(6), max_tokens=1)
        model.step(16)  # computes and finishes: block 1 full, block 2 partial
        queues[variant] = model.snapshot().gpu.free_queue
    assert queues["fixed"][0] == 2  # hashless, reused first
    assert queues["pool-0.23"][-1] == 2 and queues["pool-0.23"][0] != 2


def test_reset_releases_hits_lets_the_cpu_cache_be_cleared() -> None:
    """vLLM 0.32.0 (S21): reset() releases the pin of a hit not yet allocated; 0.30.0 and
    0.31.0 keep it, and reset() cannot clear the CPU cache."""
    fixed = waiting_on_a_pinned_hit("fixed")
    fixed.step(0)
    complete_all_stores(fixed)
    released = waiting_on_a_pinned_hit("reset-releases-hits")
    released.step(0)
    complete_all_stores(released)
    fixed.reset()
    released.reset()
    assert fixed.snapshot().pending_hits != () and released.snapshot().pending_hits == ()


def test_the_old_releases_break_only_what_their_bugs_break() -> None:
    """vllm-0.21: the missing final flush (FLUSH-COMPLETE), the registration of 0.29.0
    (REGISTERED), and nothing in flight between steps (IN-FLIGHT); no other invariant."""
    model = waiting_on_a_pinned_hit("vllm-0.21")
    found = {v.invariant for v in violations(model.engine)}
    assert "IN-FLIGHT" in found
    assert found <= {"REGISTERED", "FLUSH-COMPLETE", "IN-FLIGHT"}


def test_variants_compose() -> None:
    assert is_variant("vllm-0.23+step-dedup") and not is_variant("vllm-0.23+nope")
    composed = scheduler_class("no-final-flush+selection-0.29")
    assert composed is scheduler_class("no-final-flush+selection-0.29")
    assert keeps_invariants("selection-0.29+pool-0.23")
    assert not keeps_invariants("fixed+no-hit-pins")
    with pytest.raises(ConfigError, match="unknown variant 'fixed\\+nope'"):
        make(variant="fixed+nope")


@pytest.mark.parametrize(
    ("variant", "scenario", "invariant"),
    [
        ("serves-skip-reading", "skip-reading-after-eviction", "NO-READ"),
        ("lazy-stale-cursor", "lazy-scan-after-cpu-eviction", "LAZY-SCAN"),
        ("lazy-returns-to-tail", "lazy-store-return-and-load", "LAZY-EVICT-FIRST"),
        ("window-tail-not-recovered", "window-block-recovered", "RECOVER"),
        ("window-stale-ids", "window-block-reused", "POSITION"),
        ("reset-gpu-only", "prefix-reset-keeps-cpu", "RESET"),
        ("chunk-unaligned-hits", "chunk-hit-after-unaligned-prefix", "LOAD-TARGET"),
        ("dcp-per-rank-blocks", "dcp-scan-reaches-confirmed-only", "SKIP"),
        ("tail-at-prompt-end", "fine-grained-tail-of-shared-block", "TAIL"),
    ],
)
def test_the_later_bugs_break_the_invariant_their_variant_names(
    variant: str, scenario: str, invariant: str
) -> None:
    """The variants of S12, S27, S26, S14, S24, S6, S28, the live window scan bug and #57727,
    with every invariant checked after every call: the fixed model runs the scenario clean,
    the variant breaks the invariant its docstring names."""
    config, program = SCENARIOS[scenario]
    fixed = OffloadModel(config, check=True)
    for call in program:
        apply(fixed, call)
    buggy = OffloadModel(config, variant=variant, check=True)
    with pytest.raises(InvariantViolation) as caught:
        for call in program:
            apply(buggy, call)
    assert caught.value.invariant == invariant
