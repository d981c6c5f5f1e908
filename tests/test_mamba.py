"""Mamba groups in align mode: the table's shape, the prefill split, the boundary-state
hand-offs and their outcomes, a CPU hit of one state after nulls (docs/spec.md, "Mamba
groups")."""

from __future__ import annotations

import pytest

from kvoffload.model import OffloadModel
from kvoffload.model.arith import mamba_chunk
from kvoffload.model.keys import block_keys, prefix_digests

from helpers import config, drain, prompt

NULL = 0


def _model(gpu_blocks: int = 16, cpu_blocks: int = 16, lazy: bool = False) -> OffloadModel:
    cfg = config(gpu_blocks, cpu_blocks, (4, 4), 4, lazy=lazy, mamba=(False, True))
    return OffloadModel(cfg, check=True)


@pytest.mark.parametrize(
    ("start", "num_new", "prefill_end", "num_tokens", "junction", "expected"),
    [
        (0, 10, 13, 13, 0, 8),  # a chunk before the prompt's last ends on a boundary
        (0, 13, 13, 13, 0, 12),  # the prompt's last chunk stops at the last boundary first
        (12, 1, 13, 13, 0, 1),  # the last token alone
        (0, 3, 13, 13, 0, 0),  # no boundary within the budget: nothing
        (6, 6, 13, 13, 0, 2),  # a chunk starting inside a block stops at the next boundary
        (0, 12, 13, 13, 6, 4),  # the junction at 6, floored to its block: 4
        (13, 1, 13, 14, 0, 1),  # decode: not split
    ],
)
def test_a_prefill_chunk_ends_where_a_state_is_cached(
    start: int, num_new: int, prefill_end: int, num_tokens: int, junction: int, expected: int
) -> None:
    assert mamba_chunk(start, num_new, prefill_end, num_tokens, 4, junction) == expected


def test_a_mamba_table_keeps_its_running_state_and_hands_off_each_full_one() -> None:
    model = _model()
    tokens = prompt(13)
    model.add_request("r", tokens, max_tokens=3)
    first = model.step(10)  # split to 8: the states at 4 are never computed
    assert first.scheduled == {"r": (0, 8)}
    table = model.engine.req_to_blocks["r"][1]
    assert table[0] == NULL and table[1] != NULL and len(table) == 2
    # the state at 8 was handed off and stored by this step's event
    state = table[1]
    assert state in first.metadata.store_gpu_blocks
    drain(model)
    model.step(10)  # 8 to 12 (the last boundary before the last token)
    table = model.engine.req_to_blocks["r"][1]
    assert [b != NULL for b in table] == [False, True, True]  # the state copied from, kept
    drain(model)
    model.step(10)  # 12 to 13: the state at 8 leaves the table
    table = model.engine.req_to_blocks["r"][1]
    assert [b != NULL for b in table] == [False, False, True, True]
    keys = block_keys(prefix_digests(tokens, 4), 1, 4, 4)
    cpu = {b.primary for b in model.snapshot().cpu.blocks if b.primary is not None}
    assert {keys[1], keys[2]} <= cpu  # the states at 8 and 12 reached the CPU
    assert model.stats().save_outcomes == (("stored", 2),)


def test_a_repeat_loads_one_state_block_after_nulls_and_skips_handing_it_back() -> None:
    model = _model()
    tokens = prompt(12)
    model.add_request("a", tokens, max_tokens=1)
    for _ in range(4):
        model.step(8)
        drain(model)
    model.stats()
    # the GPU forgets; the CPU keeps every state (so the reset reports that a tier serves)
    assert not model.reset_prefix_cache()
    assert all(b.primary is None for b in model.snapshot().gpu.blocks)
    model.add_request("b", [*tokens, 1], max_tokens=1)
    loading = model.step(8)
    assert loading.loading == ("b",)
    table = model.engine.req_to_blocks["b"]
    # full attention loads three blocks, the Mamba group one: the state at 12
    assert len(loading.metadata.load_gpu_blocks) == 4
    assert table[1][:2] == [NULL, NULL] and table[1][2] in loading.metadata.load_gpu_blocks
    assert model.complete_load(loading.metadata.load_event) == ("b",)
    model.step(8)
    # the loaded state, keyed when its load completed, was handed off again: cached already
    assert model.stats().save_outcomes == (("skipped_already_cached", 1),)


def test_lazy_mode_takes_no_hand_off() -> None:
    model = _model(lazy=True)
    model.add_request("r", prompt(12), max_tokens=1)
    step = model.step(8)
    assert not step.metadata.store_gpu_blocks  # nothing freed yet, no hand-off taken
    assert model.stats().save_outcomes == ()


def test_a_hit_on_a_state_cached_this_step_waits_for_the_next_step() -> None:
    model = _model()
    tokens = prompt(9)
    model.add_request("a", tokens, max_tokens=1)
    model.add_request("b", tokens, max_tokens=1)
    # a computes 8 tokens and keys its state at 8 as the step is scheduled; b's hit on that
    # state would read what this step's forward has not written yet
    assert model.step(32).scheduled == {"a": (0, 8)}
    # next step b takes the hit (8 tokens) and computes its last token
    assert model.step(32).scheduled == {"a": (8, 9), "b": (8, 9)}


def test_a_prefill_chunk_stops_where_full_attention_caches_past_the_common_hit() -> None:
    model = _model()
    first = prompt(17)
    model.add_request("a", first, max_tokens=1)
    for _ in range(3):
        model.step(8)  # chunks of 8: a's states at 8 and 16, its full-attention blocks at 4s
        drain(model)
    # b shares a's first 14 tokens: full attention hits 12 tokens, Mamba only 8 (a has no
    # state at 12), so the common hit is 8 and 12 is a junction b's first chunk stops at
    model.add_request("b", [*first[:14], 9, 9, 9, 9, 9, 9], max_tokens=1)
    assert model.step(8).scheduled == {"b": (8, 12)}
