"""vLLM #53498's two bugs as model variants, and the invariant that catches each."""

from __future__ import annotations

from kvoffload.model import violations

from helpers import complete_all_stores, make, prompt


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
    model, hit = _run_reference_scenario("bug-53498-no-final-flush")
    assert hit == 16  # the block confirmed after the last scan was never stored
    assert _ids(model) == {"FLUSH-COMPLETE"}


def test_phantom_primary_makes_stored_blocks_unreachable_by_their_primary() -> None:
    model, hit = _run_reference_scenario("bug-53498-phantom-primary")
    assert hit == 0
    assert {"POOL-PRIMARY"} <= _ids(model)


def test_phantom_primary_is_caught_at_the_completion_that_creates_it() -> None:
    model = make(variant="bug-53498-phantom-primary")
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


def test_phantom_primary_keeps_secondary_keys_reachable() -> None:
    """Stamp then insert: the secondary lands, the primary does not (vLLM #53498)."""
    model = make(group_block_sizes=(4,), hash_block_size=2, variant="bug-53498-phantom-primary")
    model.checked = False
    model.add_request("r", prompt(10), max_tokens=3)
    for _ in range(5):
        model.step(4)
    model.step(0)
    complete_all_stores(model)
    cached = model.snapshot().cpu.cached
    assert [key.num_tokens for key, _ in cached] == [10]  # only the prompt-tail secondary
