"""vLLM 0.34.0's own ``Scheduler`` (with the SimpleCPUOffload connector its factory builds)
against the model, step by step: the tokens each step schedules and the connector metadata
it sends (``kvoffload.upstream.scheduler``; docs/upstream.md). Runs where vLLM 0.34.0 is
installed, in its release environment."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from kvoffload.model import OffloadConfig
from kvoffload.model.errors import InvalidArgumentError
from kvoffload.upstream.scheduler import VllmScheduler, first_step_difference

from helpers import found_in_release

# A request decoding while a second one hits the first one's blocks on the GPU and a third
# is admitted beside them; every step agrees.
SHARED = [
    ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0], 3),
    ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 2, 2], 2),
    ("add", "c", [1, 1, 1, 1, 1], 2),
    *[("step", 5)] * 8,
]
# A prompt stored, the GPU pool then filled by another one, the prompt again: its hit comes
# from the CPU and loads.
CPU_HIT = [
    ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
    *[("step", 8)] * 3,
    ("add", "f", [3] * 19, 1),
    *[("step", 8)] * 4,
    ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], 1),
    *[("step", 8)] * 4,
]
# vLLM admits a waiting request only if its whole sequence fits the free blocks
# (``scheduler_reserve_full_isl``, on by default); the model's engine admits it when its
# first chunk fits. Here r1's 13 tokens need 4 blocks while r0 holds 4 of the 7.
FULL_SEQUENCE = [
    ("add", "r0", [5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 1], 3),
    ("add", "r1", [3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 1, 1], 1),
    ("step", 9),
    ("step", 15),
]
# (configuration, program, vLLM's whole-sequence admission, the difference expected)
CASES: list[tuple[str, list[tuple[Any, ...]], bool, str | None]] = [
    ("OffloadConfig(16, 16, (4,), 4)", SHARED, True, None),
    ("OffloadConfig(6, 16, (4,), 4, 2)", CPU_HIT, True, None),
    (
        "OffloadConfig(8, 16, (4,), 4)",
        FULL_SEQUENCE,
        True,
        "call 3 ('step', 15): vLLM's scheduler ({'r0': 6}",
    ),
    # with it off, vLLM admits r1 as the model does
    ("OffloadConfig(8, 16, (4,), 4)", FULL_SEQUENCE, False, None),
]


def test_vllm_schedules_as_the_model_does_but_for_whole_sequence_admission() -> None:
    """Each step's scheduled tokens and connector metadata agree, but where vLLM's default
    admission (the whole sequence must fit) refuses a request the model admits."""
    script = textwrap.dedent(
        f"""
        import json
        from kvoffload.model import OffloadConfig
        from kvoffload.upstream.scheduler import first_step_difference
        for config, program, whole, _ in {CASES!r}:
            found = first_step_difference(eval(config), program, whole_sequence_admission=whole)
            print(json.dumps({{"found": found}}))
        """
    )
    found = found_in_release("0.34.0", script)
    assert len(found) == len(CASES)
    for (*_, expected), got in zip(CASES, found, strict=True):
        if expected is None:
            assert got is None, got
        else:
            assert got is not None and got.startswith(expected), got


def test_the_scheduler_target_refuses_what_it_does_not_drive_yet() -> None:
    # Refused before vLLM is imported: these run without it.
    with pytest.raises(InvalidArgumentError, match="add and step calls"):
        first_step_difference(OffloadConfig(8, 8, (4,), 4), [("drain",)])
    with pytest.raises(InvalidArgumentError, match="one full-attention group in eager mode"):
        VllmScheduler(OffloadConfig(8, 8, (4,), 4, lazy=True))
