"""Checking vLLM releases: the table of expectations, how a verdict is judged, the key map
between vLLM's hashes and the model's keys, and (where a release is installed) short
programs through vLLM's own code in that release's environment."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvoffload.model.errors import ConfigError
from kvoffload.model.keys import BlockKey, prefix_digests
from kvoffload.model.variants import is_variant, keeps_invariants
from kvoffload.upstream.check import check_release, judge
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.vllm_target.keymap import KeyMap
from kvoffload.vllm_target.releases import RELEASES, Check, release

from scenarios import SCENARIOS


def test_every_release_names_known_variants_and_conforms_to_exactly_one() -> None:
    for row in RELEASES.values():
        assert all(
            is_variant(c.variant) and c.expect in ("conform", "disagree") for c in row.checks
        )
        assert all(c.machine in ("offload", "scheduler", "worker") for c in row.checks)
        offload = [c for c in row.checks if c.machine == "offload"]
        assert [c.expect for c in offload].count("conform") == 1
        # vLLM's own scheduler, and its worker, where checked, conform to the same variant
        assert all(
            c.variant == row.model_variant
            for c in row.checks
            if c.machine in ("scheduler", "worker") and c.expect == "conform"
        )
        # every release conforms to a variant that models its bugs: those of #53498 up to
        # 0.29.0, those of lazy mode (S26, S27) up to 0.33.0, and, live in 0.34.0, the
        # window scan's reused blocks
        assert not keeps_invariants(row.model_variant), row.version
    assert release("0.29.0").checks[0] == Check(
        "fixed", "disagree", "a bug of #53498 against the fixed model"
    )
    assert release("9.9.9").model_variant == "fixed"  # unknown: expected to conform


def test_a_verdict_is_judged_against_its_expectation() -> None:
    conform = Check("fixed", "conform", "")
    disagree = Check("fixed", "disagree", "", finds="pending_flushes")
    found = {"conforms": False, "disagreement": "call 3: snapshots differ in ['pending_flushes']"}
    assert judge(conform, {"conforms": True, "disagreement": None}) is None
    assert "disagrees" in str(judge(conform, found))
    assert judge(disagree, found) is None
    assert "none found" in str(judge(disagree, {"conforms": True, "disagreement": None}))
    other = {"conforms": False, "disagreement": "snapshots differ in ['cpu']"}
    assert "found another" in str(judge(disagree, other))
    # alternatives: either way the bug can show first
    either = Check("fixed", "disagree", "", finds="tracked|pending_flushes")
    assert judge(either, found) is None
    assert "found another" in str(judge(either, other))


def test_a_release_not_installed_is_named_with_the_command_that_installs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_VLLM_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"kvoffload install vllm==0\.34\.0"):
        check_release("vllm==0.34.0", "ci", None, install_first=False)


def test_the_key_map_pairs_vllm_hashes_with_model_digests() -> None:
    keys = KeyMap(hash_block_size=2)
    tokens = [3, 1, 4, 1, 5]
    hashes = [b"h-one", b"h-two"]  # vLLM's hashes of the two full hash blocks
    digests = prefix_digests(tokens, 2)
    keys.learn(digests, hashes)
    group1 = (1).to_bytes(4, "big")
    assert keys.key(b"h-two" + group1) == BlockKey(1, 4, digests[1])
    assert keys.vllm_key(BlockKey(0, 2, digests[0])) == b"h-one" + bytes(4)
    assert keys.model_key(None) is None


# -- vLLM's own code, in each installed release -------------------------------------------

# The counterexamples docs/upstream.md reports, and the verdict each must reach per release:
# vLLM 0.29.0 stamps the CPU block at allocation (call 3 differs from the fixed model) and
# has no final flush (call 3 differs from the model with its registration).
STAMP = [("add", "r0", [0, 1, 2, 3], 2), ("step", 2), ("step", 2), ("step", 2)]
FLUSH = [("add", "r0", [0, 1, 2], 2), ("step", 8), ("drain",), ("step", 8)]
# Two requests, one prompt, one CPU block: 0.29.0's cursor passes over the block in flight.
CURSOR = [
    ("add", "r0", [5, 6, 0, 1, 2, 3, 4, 5], 2),
    ("add", "r1", [5, 6, 0, 1, 2, 3, 4, 5], 1),
    ("step", 3),
    ("step", 3),
    ("step", 3),
]
REFRESH = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0], 1),
    ("step", 8),
    ("drain",),
    ("step", 8),
    ("drain",),
    ("step", 8),
]
# Two loads sharing a CPU block finish together: vLLM frees them in the order of a set of
# request ids (string hashing); the adapter passes them sorted, the model's order.
LOADS_TOGETHER = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2),
    ("add", "r1", [5, 6, 0, 1], 1),
    ("add", "r2", [5, 6, 0, 1], 1),
    *[("step", 8), ("drain",)] * 4,
    ("add", "r3", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 1),
    ("add", "r4", [0, 1, 2, 3, 4, 5, 6, 0], 1),
    ("step", 8),
    ("drain",),
]
# Bad input: each call must raise the model's error, naming the problem, and change nothing.
BAD_INPUT = [
    ("add", "r0", [0, 1, 2, 3], 1),
    ("add", "r0", [1, 2], 1),
    ("add", "r1", [], 1),
    ("add", "r2", list(range(40)), 1),
    ("finish", "nope"),
    ("store", 5, 0),
    ("step", -1),
    ("step", 8),  # r0 finishes; its final flush goes out with the next step
    ("step", 0),
    ("store", 0, 3),
    ("store", 0, 0),
    ("store", 0, 0),
    ("finish", "r0"),
]
# Requests that skip reading the prefix cache (S12), and lazy mode (S26, S27).
SKIP_READING = SCENARIOS["skip-reading-stored-prompt"][1]
LAZY = SCENARIOS["lazy-scan-after-reset"][1]
# A Mamba group beside full attention (0.30.0 on): states handed off, one loaded back, handed
# off again and skipped; 0.31.0 on count the outcomes in their stats. The scenario's GPU-only
# prefix-cache reset answers as #57727 has it (reset-gpu-only).
MAMBA_HANDOFFS = SCENARIOS["mamba-state-handoff-and-load"][1]
MAMBA_NO_STATS = [call for call in MAMBA_HANDOFFS if call[0] != "stats"]
MAMBA = "OffloadConfig(12, 12, (4, 4), 4, 1, mamba=(False, True), kv_events=True)"
# Fine-grained hits (0.33.0 on): a prompt tail stored at finish; a tail on a shared block
# stored again, which 0.33.0 looks for one hash boundary too far (S28); a tail block a
# decode filled, stored once.
FINE = "OffloadConfig(8, 12, (8, 8), 4, 1, mamba=(False, True))"
TAIL_AT_FINISH = SCENARIOS["fine-grained-tail-at-finish"][1]
TAIL_SHARED = SCENARIOS["fine-grained-tail-of-shared-block"][1]
TAIL_FILLED = SCENARIOS["fine-grained-tail-filled-by-decode"][1]
S33 = "reset-releases-hits+lazy-0.33+window-stale-ids+reset-gpu-only"
SMALL = "OffloadConfig(4, 2, (4,), 4, 1)"
SMALL_LAZY = "OffloadConfig(4, 2, (4,), 4, 1, lazy=True)"
LARGE = "OffloadConfig(4, 12, (4,), 4, 1)"
Case = tuple[str, list[tuple[Any, ...]], str, str | None]
CASES: dict[str, list[Case]] = {
    "0.29.0": [
        (SMALL, STAMP, "fixed", "call 3 ('step', 2): snapshots differ in ['cpu']"),
        (SMALL, FLUSH, "primary-only", "pending_flushes"),
        (SMALL, STAMP, "vllm-0.29", None),
        (SMALL, FLUSH, "vllm-0.29", None),
        (SMALL, CURSOR, "primary-only", "snapshots differ in ['tracked']"),
        (SMALL, CURSOR, "vllm-0.29", None),
        (LARGE, SKIP_READING, "vllm-0.29", None),
        (
            LARGE,
            SKIP_READING,
            "primary-only+no-final-flush+selection-0.29",
            "call 8 ('step', 16): model returned StepResult(scheduled={'r1': (0, 9)}",
        ),
    ],
    "0.30.0": [
        (SMALL, STAMP, "fixed", None),
        (SMALL, FLUSH, "fixed", None),
        (LARGE, SKIP_READING, "lazy-0.33", None),
        (SMALL_LAZY, LAZY, "lazy-0.33", None),
        (SMALL_LAZY, LAZY, "fixed", "call 4 ('drain',): snapshots differ in ['gpu']"),
        (MAMBA, MAMBA_NO_STATS, "reset-gpu-only", None),
    ],
    "0.34.0": [
        (SMALL, FLUSH, "inclusive-cpu", None),
        (LARGE, REFRESH, "inclusive-cpu", None),
        (LARGE, REFRESH, "fixed", "call 6 ('step', 8): snapshots differ in ['cpu']"),
        (LARGE, LOADS_TOGETHER, "inclusive-cpu", None),
        (SMALL, BAD_INPUT, "inclusive-cpu", None),
        (LARGE, SKIP_READING, "inclusive-cpu", None),
        (SMALL_LAZY, LAZY, "inclusive-cpu", None),
        (MAMBA, MAMBA_HANDOFFS, "inclusive-cpu+reset-gpu-only", None),
        (FINE, TAIL_AT_FINISH, "inclusive-cpu", None),
        (FINE, TAIL_SHARED, "inclusive-cpu", None),
        (FINE, TAIL_FILLED, "inclusive-cpu", None),
    ],
    "0.33.0": [
        (FINE, TAIL_AT_FINISH, S33 + "+tail-at-prompt-end", None),
        (FINE, TAIL_SHARED, S33 + "+tail-at-prompt-end", None),
        (FINE, TAIL_SHARED, S33, "snapshots differ in ['gpu', 'cpu', 'pending_flushes'"),
    ],
}


@pytest.mark.parametrize("version", sorted(CASES))
def test_vllm_programs_reach_the_verdicts_of_docs_upstream(version: str) -> None:
    cache = Cache(default_cache())
    if not cache.installed(version):
        pytest.skip(f"vllm=={version} is not installed: kvoffload install vllm=={version}")
    script = textwrap.dedent(
        f"""
        import json
        from kvoffload.model import OffloadConfig
        from kvoffload.testing.lockstep import first_disagreement
        for config, program, variant, _ in {CASES[version]!r}:
            found = first_disagreement(eval(config), program, adapter="vllm", variant=variant)
            print(json.dumps({{"found": found}}))
        """
    )
    run = subprocess.run(
        [str(cache.python), "-c", script],
        # A hash seed under which vLLM's own order of finished loads is not the model's, so
        # that LOADS_TOGETHER fails if the adapter stops passing them in sorted order.
        env=cache.environment(version) | {"PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = [json.loads(line)["found"] for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(found) == len(CASES[version])
    for (_, _, variant, expected), got in zip(CASES[version], found, strict=True):
        if expected is None:
            assert got is None, f"{variant}: {got}"
        else:
            assert got is not None and expected in got, f"{variant}: {got}"


def test_the_command_line_names_a_missing_release_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.main import main

    monkeypatch.setenv("KVOFFLOAD_VLLM_CACHE", str(tmp_path))
    assert main(["verify", "--target", "vllm==0.34.0"]) == 2
    assert "kvoffload install vllm==0.34.0" in capsys.readouterr().err
    assert main(["verify", "--target", "no-such-adapter", "--no-mutants"]) == 2
    assert "unknown target 'no-such-adapter'" in capsys.readouterr().err
