"""The model engine's admission gates and order (``kvoffload.model.engine.Admission``), as
vLLM 0.34.0's own scheduler has them: each scenario's outcome changes with its knob alone.
tests/test_upstream_scheduler.py runs the same programs against vLLM's scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.model.engine import VLLM_ADMISSION, Admission
from kvoffload.model.errors import ConfigError
from kvoffload.upstream.scheduler import model_call

VARIANT = "inclusive-cpu+window-stale-ids+reset-gpu-only"  # 0.34.0's row

# r1's 13 tokens need 4 blocks while r0 holds 4 of the 7: admitted on its first chunk, not
# on its whole sequence (vLLM's ``scheduler_reserve_full_isl``). Then an abort, and a reset
# of both tiers.
FULL_SEQUENCE = [
    ("add", "r0", [5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 1], 3),
    ("add", "r1", [3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 1, 1], 1),
    ("step", 9, True),
    ("step", 15, True),
    ("abort", "r0"),
    ("reset_prefix_cache", True),
    ("step", 15, True),
]
# After a GPU reset, r2 and r3 both hit the CPU copy of [0, 1, 2, 3]: r2's load parks it
# with 3 more blocks to come, so r3's load does not fit beside that reservation (vLLM's
# ``_inflight_prefill_reserved_blocks``) and only one load goes out.
RESERVED = [
    ("add", "r0", [0, 1, 2, 3], 2),
    ("step", 8, True),
    ("step", 8, True),
    ("reset_prefix_cache", False),
    ("add", "r1", [0, 1, 2, 3], 1),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5], 1),
    ("add", "r3", [0, 1, 2, 3, 0], 1),
    ("abort", "r1"),
    ("step", 8, True),
]
# r3's load finished while r2, preempted, went back to the front of the waiting queue: r3
# holds its blocks and is taken first (vLLM's kv_holding_waiting), where the waiting queue's
# order would stop at r2, whose whole prompt does not fit.
HOLDERS = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0], 2),
    ("step", 32, True),
    ("step", 32, True),
    ("reset_prefix_cache", False),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0, 0], 1),
    ("step", 1, False),
    ("step", 32, True),
    ("step", 32, True),
    ("reset_prefix_cache", False),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0], 2),
    ("add", "r3", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 0, 0], 2),
    ("step", 1, False),
    *[("step", 32, True)] * 4,
]


# Three requests decoding in a lazy pool of 6 blocks: r5, then r4 preempted; r4 resumes
# through a CPU hit whose load finishes in the last step.
PREEMPTED_LOAD = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0], 2),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0], 1),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0, 0], 1),
    ("step", 32, True),
    ("step", 32, True),
    ("reset_prefix_cache", False),
    ("add", "r3", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0, 0], 8),
    ("add", "r4", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0], 8),
    ("step", 1, False),
    ("add", "r5", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0], 5),
    *[("step", 8, True)] * 11,
]


def last_step(config: OffloadConfig, program: list[tuple[Any, ...]], admission: Admission) -> Any:
    model = OffloadModel(config, VARIANT, admission=admission)
    results = [model_call(model, call) for call in program]
    return [r for r in results if isinstance(r, tuple)][-1]


def test_whole_sequence_admission_waits_for_the_whole_sequence() -> None:
    config = OffloadConfig(8, 16, (4,), 4)
    model = OffloadModel(config, VARIANT, admission=Admission(whole_sequence=True))
    second = [model_call(model, call) for call in FULL_SEQUENCE[:4]][-1]
    assert isinstance(second, tuple) and second[0] == {"r0": 6}  # r1 waits
    model = OffloadModel(config, VARIANT)
    second = [model_call(model, call) for call in FULL_SEQUENCE[:4]][-1]
    assert isinstance(second, tuple) and second[0] == {"r0": 6, "r1": 9}


def test_a_load_fits_beside_the_reservations_of_parked_loads() -> None:
    config = OffloadConfig(5, 2, (4,), 4)
    reserved = last_step(config, RESERVED, Admission(load_reservations=True))
    assert reserved[4:] == (0, (2,), (1,))  # r2's load alone
    free = last_step(config, RESERVED, Admission())
    assert free[4:] == (0, (2, 3), (1, 1))  # r3's too


def test_a_request_holding_blocks_is_taken_before_the_waiting_queue() -> None:
    config = OffloadConfig(7, 12, (4,), 4)
    assert last_step(config, HOLDERS, Admission(holders_first=True))[0] == {"r3": 1}
    assert last_step(config, HOLDERS, Admission())[0] == {}


def test_a_preempted_request_whose_load_finished_is_preempted_still() -> None:
    """vLLM's scheduler promotes a finished load to PREEMPTED when the request was ever
    preempted (``num_preemptions``), to WAITING otherwise."""
    model = OffloadModel(OffloadConfig(7, 2, (4,), 4, lazy=True), VARIANT)
    for call in PREEMPTED_LOAD[:-1]:
        model_call(model, call)
    statuses = {r.request_id: r.status for r in model.snapshot().requests}
    assert statuses["r4"] == "waiting_for_remote_kvs"
    model_call(model, PREEMPTED_LOAD[-1])
    views = {r.request_id: r for r in model.snapshot().requests}
    assert views["r4"].status == "preempted" and views["r4"].num_computed_tokens == 16


def test_the_gates_are_for_full_attention_groups_only() -> None:
    with pytest.raises(ConfigError, match="full-attention groups only"):
        OffloadModel(
            OffloadConfig(8, 8, (4, 4), 4, sliding_windows=(None, 3)), admission=VLLM_ADMISSION
        )
