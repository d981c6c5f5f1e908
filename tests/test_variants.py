"""vLLM #53498's two bugs as model variants, and the invariant that catches each."""

from __future__ import annotations

from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadConfig, OffloadModel, violations
from kvoffload.model.keys import BlockKey
from kvoffload.testing.lockstep import Call, apply

from helpers import complete_all_stores, make, prompt, waiting_on_a_pinned_hit


def _ids(model: object) -> set[str]:
    from kvoffload.model import OffloadModel

    assert isinstance(model, OffloadModel)
    return {v.invariant for v in violations(model.engine)}


def _run_reference_scenario(variant: str) -> tuple[object, int]:
    """A 33-token prompt in two chunks, hash blocks of 8 in 16-token blocks, finished after
    prefill, its stores completed; returns the model and the repeat's CPU hit."""
    model = make(group_block_sizes=(16,), hash_block_size=8, variant=variant)
    model.checked = False
    tokens = prompt(33)
    model.add_request("r", tokens, max_tokens=1)
    model.step(16)
    model.step(17)  # computes the rest of the prompt and finishes
    model.step(0)
    complete_all_stores(model)
    return model, model.lookup(tokens)


def test_fixed_model_serves_the_repeat_from_cpu() -> None:
    model, hit = _run_reference_scenario("fixed")
    assert hit == 32
    assert _ids(model) == set()


def test_no_final_flush_loses_the_last_block_and_flush_complete_catches_it() -> None:
    model, hit = _run_reference_scenario("no-final-flush")
    assert hit == 16  # the block confirmed after the last scan was never stored
    assert _ids(model) == {"FLUSH-COMPLETE"}


def test_phantom_primary_makes_stored_blocks_unreachable_by_their_primary() -> None:
    model, hit = _run_reference_scenario("phantom-primary")
    assert hit == 0
    assert {"POOL-PRIMARY"} <= _ids(model)


def test_phantom_primary_is_caught_at_the_completion_that_creates_it() -> None:
    model = make(variant="phantom-primary")
    model.checked = False
    model.add_request("r", prompt(40), max_tokens=3)
    model.step(16)
    model.step(16)  # store event 0 for block 1, its CPU block stamped at allocation
    assert _ids(model) == set()  # stamped but not mapped: nothing is reachable yet
    model.complete_store(0)
    assert {"REGISTERED", "POOL-PRIMARY"} <= _ids(model)
    # The phantom block is not in the map, so the next scan selects the same key again.
    model.step(16)
    assert model.snapshot().cpu.cached == ()


def _store_with_prompt_tail(variant: str) -> OffloadModel:
    """A 10-token prompt in 4-token blocks hashed by 2: its tail key (10 tokens) is a
    secondary key of block 2; every store completed."""
    model = make(group_block_sizes=(4,), hash_block_size=2, variant=variant)
    model.checked = False
    model.add_request("r", prompt(10), max_tokens=3)
    for _ in range(5):
        model.step(4)
    model.step(0)
    complete_all_stores(model)
    return model


def test_phantom_primary_keeps_secondary_keys_reachable() -> None:
    """Stamp then insert: the secondary lands, the primary does not (vLLM #53498)."""
    cached = _store_with_prompt_tail("phantom-primary").snapshot().cpu.cached
    assert [key.num_tokens for key, _ in cached] == [10]  # only the prompt-tail secondary


# -- what driving vLLM's own code taught the model (docs/upstream.md) -------------------------


def test_primary_only_registers_the_stamp_without_count_or_secondary_keys() -> None:
    """vLLM 0.29.0: the stamped primary is inserted into the map directly at completion, so
    the block is reachable by it, with no token count, and its secondary keys are lost."""
    model = _store_with_prompt_tail("primary-only")
    cpu = model.snapshot().cpu
    registered = [b for b in cpu.blocks if b.primary is not None]
    assert registered, "nothing was stored"
    assert all(b.primary_tokens is None and b.secondary == () for b in registered)
    mapped = {key.num_tokens for key, _ in cpu.cached}
    assert {4, 8} <= mapped
    assert 10 not in mapped  # the prompt tail's key, a secondary, is lost
    assert "REGISTERED" in _ids(model)


def test_vllm_029_passes_over_blocks_in_flight_while_the_cpu_pool_is_full() -> None:
    """Two requests with one prompt, one CPU block: the second's scan stores the shared
    block; the first's scan, with the pool now full, passes over it (in flight) in 0.29.0
    and stays put from 0.30.0 on. Only the cursor differs; both retry nothing else."""
    cursors = {}
    for variant in ("fixed", "vllm-0.29"):
        model = make(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,), variant=variant)
        model.checked = False
        tokens = [5, 6, 0, 1, 2, 3, 4, 5]
        model.add_request("r0", tokens, max_tokens=2)
        model.add_request("r1", tokens, max_tokens=1)
        for _ in range(3):
            model.step(3)
        cursors[variant] = {t.request_id: t.num_stored_blocks for t in model.snapshot().tracked}
    assert cursors["fixed"] == {"r0": (0,), "r1": (1,)}
    assert cursors["vllm-0.29"] == {"r0": (1,), "r1": (1,)}


def test_inclusive_cpu_refreshes_the_cpu_copy_of_a_gpu_prefix_hit() -> None:
    """vLLM 0.34.0: a request that hits the GPU prefix cache moves the CPU copies of that
    prefix to the most-recently-used end of the CPU free queue."""
    queues = {}
    for variant in ("fixed", "inclusive-cpu"):
        model = make(gpu_blocks=4, cpu_blocks=12, group_block_sizes=(4,), variant=variant)
        tokens = [0, 1, 2, 3, 4, 5, 6, 0]
        model.add_request("r0", tokens, max_tokens=2)
        model.add_request("r1", tokens, max_tokens=1)
        for _ in range(3):
            model.step(8)
            complete_all_stores(model)
        queues[variant] = model.snapshot().cpu.free_queue
    assert queues["fixed"][-2:] == (1, 2)
    assert queues["inclusive-cpu"][-2:] == (2, 1)  # block 1 holds the prefix r1 hit on GPU
    assert sorted(queues["fixed"]) == sorted(queues["inclusive-cpu"])


def test_inclusive_cpu_reset_releases_the_pins_of_unallocated_cpu_hits() -> None:
    """A CPU hit whose allocation failed stays pinned until the next lookup; 0.34.0's
    reset releases it, 0.30.0's keeps it."""
    pinned = {}
    for variant in ("fixed", "inclusive-cpu"):
        model = waiting_on_a_pinned_hit(variant)
        assert [h[0] for h in model.snapshot().pending_hits] == ["b"]
        model.reset()
        pinned[variant] = model.snapshot().pending_hits
    assert pinned["fixed"] != ()
    assert pinned["inclusive-cpu"] == ()


def test_the_0_29_selection_passes_over_what_needs_no_store_when_the_pool_is_full() -> None:
    """The plans side by side: a block in flight, then one to store, no CPU block free."""
    from kvoffload.model.arith import plan_selection
    from kvoffload.model.variants import plan_selection_029

    storable = [[False, True], [True]]
    assert plan_selection(storable, 0) == ([[], []], [0, 0], True)
    assert plan_selection_029(storable, 0) == ([[], []], [1, 0], True)
    # With room, both take the same blocks and pass the same ones.
    assert plan_selection_029(storable, 2) == plan_selection(storable, 2)


def test_preempt_keeps_table_appends_the_resumed_table_and_table_catches_it() -> None:
    model = OffloadModel(
        make(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,)).config,
        variant="preempt-keeps-table",
        check=False,
    )
    model.add_request("r0", [0, 1, 2, 3, 4], max_tokens=3)
    model.add_request("r1", [5, 6, 0, 1, 2], max_tokens=3)
    for _ in range(4):
        model.step(3)  # the fourth step preempts r1
    state = model.engine.connector.reqs_to_store["r1"]
    assert state.block_ids == ([3],)  # the freed block is still named
    assert [v.invariant for v in violations(model.engine)] == ["TABLE"]


def test_scan_breaks_unhashed_stops_at_the_block_a_kept_table_names_again() -> None:
    # r2 is preempted and comes back with its old table kept (vLLM <= 0.31.0); the pool of
    # 0.23.0 gives it its old block again, its key dropped, for the new table's second
    # position. With the CPU pool full (r1's store in flight), 0.29.0's selection passes
    # over the blocks that need no store: from 0.22.0 that unkeyed block in the old table
    # too; up to 0.21.0 the scan stops there, its cursor staying put.
    cursors = {}
    for variant in (
        "pool-0.23+selection-0.29+preempt-keeps-table",
        "pool-0.23+selection-0.29+preempt-keeps-table+scan-breaks-unhashed",
    ):
        model = OffloadModel(
            make(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,)).config,
            variant=variant,
            check=False,
        )
        # The machine draws no preemption with the pool of 0.23.0 (its free queue cannot
        # take the store that follows); the scan is what is shown here.
        model.engine.preemption = True
        model.add_request("r1", [0, 1, 2, 3], max_tokens=2)
        model.add_request("r2", [0, 1, 2, 3], max_tokens=3)
        for _ in range(3):
            model.step(8)
        state = model.engine.connector.reqs_to_store["r2"]
        assert state.block_ids == ([2, 1, 2],)  # the old table, then the new one
        assert model.engine.gpu_pool.blocks[2].block_hash is None
        cursors[variant] = state.num_stored_blocks
    assert cursors == {
        "pool-0.23+selection-0.29+preempt-keeps-table": [1],
        "pool-0.23+selection-0.29+preempt-keeps-table+scan-breaks-unhashed": [0],
    }


def test_the_model_of_a_pool_before_0_24_waits_instead_of_preempting() -> None:
    # The crowd of test_engine's preemption test: with the pool of 0.23.0 the machine draws
    # no preemption (its free queue cannot take the store that follows, docs/upstream.md),
    # so r1 waits for a block instead of being preempted, and keeps its table.
    model = OffloadModel(
        make(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,)).config,
        variant="pool-0.23",
    )
    model.add_request("r0", [0, 1, 2, 3, 4], max_tokens=3)
    model.add_request("r1", [5, 6, 0, 1, 2], max_tokens=3)
    for _ in range(3):
        model.step(3)
    blocked = model.step(3)
    assert blocked.scheduled == {"r0": (6, 7)} and blocked.preempted == ()
    r1 = model.engine.requests["r1"]
    assert r1.status == "running" and r1.num_computed_tokens == 3
    assert model.engine.blocks_of("r1") == [[3]]


def test_a_key_captured_as_a_primary_and_stored_as_a_secondary_has_an_empty_event() -> None:
    # vLLM 0.30.0 to 0.34.0 (window-stale-ids): the scan takes for the window group's
    # position 0 a block the full-attention group reused, captured under its key then (g0@12,
    # the prefix of 12 tokens); at completion that key is the block's secondary one. vLLM's
    # capture under a primary names no block size, so the event has size 0 and no tokens.
    config = OffloadConfig(8, 12, (8, 4), 4, 1, False, sliding_windows=(None, 3), kv_events=True)
    program: list[Call] = [
        ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6], 3),
        *[("step", 3)] * 7,
        ("store", 0, 0),
    ]
    model = OffloadModel(config, variant="window-stale-ids")
    for call in program:
        apply(model, call)
    events = model.take_events()
    reused = next(
        e
        for e in events
        if isinstance(e.key, BlockKey) and (e.key.group, e.key.num_tokens) == (0, 12)
    )
    assert (reused.token_ids, reused.block_size, reused.parent) == ((), 0, None)
    # The implementation with the same scan publishes the same events (its bytes for that
    # block are another position's, which is what its byte check is for).
    impl = OffloadImpl(config, faults=["window-stale-ids"], device="cpu", lockstep=True)
    for call in program:
        apply(impl, call)
    assert sorted(map(str, impl.take_events())) == sorted(map(str, events))


def test_dcp_per_rank_blocks_loads_over_the_local_prefix_and_load_target_catches_it() -> None:
    # vLLM 0.24.0 (S6) with two DCP ranks: a prompt of three blocks stored, the GPU's prefix
    # cache reset, its first two blocks computed again; the prompt then hits the GPU for 8
    # tokens and loads its third block from the CPU. 0.24.0's back-trace counts the local
    # prefix in per-rank tokens (2 blocks of 2), so the load lands on the prefix's second
    # block, not the third (vLLM 0.24.0 does exactly this: it conforms to the variant).
    config = OffloadConfig(12, 12, (4,), 4, 2, dcp_world_size=2)
    stem = [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    settle: list[Call] = [("step", 8), ("drain",)] * 4
    program: list[Call] = [
        ("add", "r0", stem, 2),
        *settle,
        ("reset_prefix_cache", False),
        ("add", "r1", stem[:8], 1),
        *settle,
        ("add", "r2", stem, 1),
        ("step", 8),
    ]
    for variant, position in (("fixed", 2), ("dcp-per-rank-blocks", 1)):
        model = OffloadModel(config, variant=variant)
        for call in program:
            apply(model, call)
        load = model.engine.connector.reqs_to_load["r2"].transfer.gpu_block_ids
        assert load == [model.engine.req_to_blocks["r2"][0][position]], variant
        found = _ids(model)
        assert ("LOAD-TARGET" in found) == (variant != "fixed"), (variant, found)
