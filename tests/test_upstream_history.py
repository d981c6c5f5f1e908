"""The bug history (``kvoffload history``): its data agrees with the release table and the
model's variants, its verdicts are judged as documented, and (where the releases are
installed) the shrunk counterexample of each bug in reach disagrees in the last release with
the bug, naming it, and conforms in the first release with the fix."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvoffload.main import main
from kvoffload.model.errors import ConfigError
from kvoffload.model.variants import is_variant
from kvoffload.testing.failure import target_broke
from kvoffload.upstream import history
from kvoffload.upstream.bugs import BUGS, HistoricalBug, select
from kvoffload.upstream.install import Cache
from kvoffload.vllm_target.releases import RELEASES, Check, release_numbers

from helpers import found_in_release
from scenarios import SCENARIOS


def _version(version: str) -> tuple[int, ...]:
    numbers = release_numbers(version)
    assert numbers is not None, version
    return numbers


def test_the_history_lists_29_bugs_each_in_reach_or_saying_what_it_needs() -> None:
    assert [b.id for b in BUGS] == [f"S{n}" for n in range(1, 30)]
    for bug in BUGS:
        assert _version(bug.buggy) < _version(bug.fixed), bug.id
        if bug.in_scope:
            assert bug.isolation and bug.fixed_variant and bug.finds and bug.method, bug.id
            assert is_variant(bug.isolation) and is_variant(bug.fixed_variant), bug.id
            # the fixed release conforms to its own row of the release table
            assert RELEASES[bug.fixed].model_variant == bug.fixed_variant, bug.id
            # the two releases differ: the last buggy one has a model of its own
            assert RELEASES[bug.buggy].model_variant != bug.fixed_variant, bug.id
            assert bug.buggy in RELEASES, bug.id
        else:
            assert bug.out_of_reach and bug.isolation is None and bug.fixed_variant is None
    # the eager full-attention bugs of the reference history are all in reach
    assert {"S1", "S2", "S9", "S25"} <= {b.id for b in BUGS if b.in_scope}


def test_bugs_are_chosen_by_row_or_by_their_catalogue_id() -> None:
    assert select(None) == BUGS
    assert [b.id for b in select("S9, S1,S9")] == ["S9", "S1"]
    assert [b.id for b in select("no-final-flush,lazy-returns-to-tail")] == ["S9", "S26"]
    # an old name of a form is read as the id it was renamed to
    assert [b.id for b in select("lazy-tail")] == ["S26"]
    with pytest.raises(ConfigError, match=r"unknown bugs \['S30'\]"):
        select("S1,S30")
    with pytest.raises(ConfigError, match="unknown bugs"):
        select(",")


def test_each_release_runs_once_with_each_check_once_in_release_order() -> None:
    plan = history.checks_by_release(select("S25,S9,S10,S3"))
    assert list(plan) == ["0.29.0", "0.30.0", "0.33.0", "0.34.0"]
    assert len(plan["0.29.0"]) == 2  # S9 and S10, one process
    assert plan["0.30.0"] == [
        Check(
            "lazy-0.33+window-stale-ids+reset-gpu-only+preempt-keeps-table+chunk-unaligned-hits",
            "conform",
            "0.30.0 conforms",
        )
    ]  # once for both
    every = history.checks_by_release(select("S9"), releases=True)
    assert list(every) == sorted(RELEASES, key=_version)
    assert all(c in every[v] for v, row in RELEASES.items() for c in row.checks)


def _outcome(conforms: bool, disagreement: str | None = None, **more: Any) -> dict[str, Any]:
    failure = None if conforms else {"rule_steps": 3, "program": [["step", 8]] * 4}
    return {
        "conforms": conforms,
        "disagreement": disagreement,
        "failure": failure,
        "seconds_to_first_failure": more.get("seconds"),
        "programs_to_first_failure": more.get("programs"),
        "programs": 10,
        "seconds": 1.0,
    }


def _fake_run(found: dict[str, str], fixed_conforms: bool = True) -> Any:
    """A stand-in for the releases' processes: each buggy release disagrees as ``found``
    says (bug id -> its first difference), each fixed release conforms or not."""

    def run(target: Any, install: bool, checks: tuple[Check, ...], *_: Any) -> list[Any]:
        results = []
        for check in checks:
            if check.expect == "conform":
                results.append(_outcome(fixed_conforms, None if fixed_conforms else "call 1"))
                continue
            bug = next(b for b in BUGS if b.in_scope and b.buggy_check() == check)
            seconds = float(bug.id[1:])  # S1 at 1 s, S25 at 25 s
            results.append(_outcome(False, found[bug.id], seconds=seconds, programs=2))
        return results

    return run


def test_a_bug_counts_only_with_its_words_found_and_its_fix_conforming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Cache, "installed", lambda self, version: True)
    words = {b.id: f"call 3: snapshots differ in [{b.finds}]" for b in BUGS if b.in_scope}
    monkeypatch.setattr(history, "run_in_cache", _fake_run(words))
    page, verdicts = tmp_path / "history.md", tmp_path / "history.json"
    status = history.run_history("S1,S9,S25,S3", None, None, False, str(page), False, str(verdicts))
    assert status == 0
    out = capsys.readouterr().out
    report = json.loads(verdicts.read_text())
    assert report["exit_status"] == 0 and report["bugs_found"] == report["bugs_in_reach"] == 3
    assert report["median_seconds_to_first_failure"] == 9.0
    bugs = {bug["id"]: bug for bug in report["bugs"]}
    assert bugs["S9"]["counted"] and bugs["S9"]["first_difference"] == words["S9"]
    assert not bugs["S3"]["in_reach"] and "sliding-window" in bugs["S3"]["problem"]
    # median of 1, 9 and 25 seconds
    assert (
        "3 of 3 bugs in reach found" in out and "median seconds to the first failure 9.0 s" in out
    )
    text = page.read_text()
    assert "`kvoffload history --only S1,S9,S25,S3 --profile ci --write docs/history.md`" in text
    assert "| S3 | PR #42296 | 0.21.0 → 0.22.0 | not yet reachable |" in text
    assert "needs sliding-window groups of another block size: S3" in text

    # another difference first: not this bug
    monkeypatch.setattr(history, "run_in_cache", _fake_run(words | {"S9": "call 2: tracked"}))
    assert history.run_history("S9", None, None, False, None) == 1
    assert "expected a disagreement in 'pending_flushes', found another" in capsys.readouterr().out
    # the fixed release disagrees: not found either
    monkeypatch.setattr(history, "run_in_cache", _fake_run(words, fixed_conforms=False))
    assert history.run_history("S25", None, None, False, None) == 1
    assert "vllm==0.34.0: expected to conform, but it disagrees" in capsys.readouterr().out


def test_the_median_target_is_judged_among_the_bugs_found() -> None:
    bug = next(b for b in BUGS if b.in_scope)
    slow = history.BugResult(bug, True, True, 30.0, 900, 4, 6, "x", None)
    fast = history.BugResult(bug, True, True, 2.0, 40, 3, 3, "x", None)
    unfixed = history.BugResult(bug, True, False, 0.1, 1, 3, 3, "x", "vllm==x: disagrees")
    assert history.median_seconds([slow, fast, unfixed]) == 16.0
    assert "(MISSED)" in history.totals([slow, fast, unfixed])
    assert "(met)" in history.totals([fast, unfixed])


def test_absent_releases_are_named_with_the_command_that_installs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVOFFLOAD_VLLM_CACHE", str(tmp_path))
    assert main(["history", "--only", "S25"]) == 2
    err = capsys.readouterr().err
    assert "releases 0.33.0, 0.34.0 are not installed" in err and "--install" in err
    assert main(["history", "--only", "S0"]) == 2
    assert "unknown bugs ['S0']" in capsys.readouterr().err


# -- each bug's shrunk counterexample, in its releases --------------------------------------

SMALL = (4, 2, (4,), 4, 1)
LARGE = (4, 12, (4,), 4, 1)
# r0 stored, then a long filler holds the GPU while r2 comes back: its CPU hit is pinned
# from 0.22.0 on (the model), not in 0.21.0, and its allocation fails
HELD_HIT = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2),
    ("step", 8),
    ("step", 8),
    ("drain",),
    ("add", "r1", [7, 1, 2, 3, 4, 5, 6, 0, 1], 4),
    ("step", 8),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0], 1),
    ("step", 8),
]


def _scenario(name: str) -> tuple[tuple[Any, ...], list[Any]]:
    """A scenario of ``tests/scenarios.py`` as (the configuration's fields, the program)."""
    config, program = SCENARIOS[name]
    fields = (config.gpu_blocks, config.cpu_blocks, config.group_block_sizes)
    return (
        *fields,
        *(config.hash_block_size, config.world_size, config.lazy, config.sliding_windows),
        *(config.kv_events, config.attention_chunks, config.dcp_world_size, config.mamba),
    ), program


COUNTEREXAMPLES: dict[str, tuple[tuple[Any, ...], list[Any]]] = {
    "S1": (LARGE, HELD_HIT),
    # the block in flight is selected again by the next step's scan
    "S2": (SMALL, [("add", "r0", [0, 1, 2, 3], 2), ("step", 8), ("step", 8)]),
    # the request's only blocks complete in its finishing step: no final flush
    "S9": (
        LARGE,
        [("add", "r1", [7, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 1), ("step", 8), ("step", 8)],
    ),
    # the CPU block stamped with the GPU block's key at allocation
    "S10": (SMALL, [("add", "r0", [0, 1, 2, 3], 2), ("step", 8), ("step", 8)]),
    # r0 stored while it decodes, then asked for by a request that skips reading the cache
    "S12": _scenario("skip-reading-stored-prompt"),
    # r1 repeats r0's prompt: its window hit starts with the null of a block that left the
    # window; 0.30.0 takes that block back from the GPU prefix cache (the CPU pool, of one
    # block, is full, so the window group's cursor stays on it), 0.29.0 passes over it
    "S14": (
        (7, 2, (4, 4), 4, 1, False, (None, 3)),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2),
            ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 0], 1),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("step", 8),
        ],
    ),
    # r0's final flush still holds a GPU block when r1's prompt needs its third: r1, the
    # last running request, preempts itself; up to 0.31.0 its store table is kept
    "S20": (
        SMALL,
        [
            ("add", "r0", [0, 1, 2, 3], 2),
            ("step", 2),
            ("step", 2),
            ("step", 2),
            ("add", "r1", [7, 1, 2, 3, 4, 5, 6, 0, 1], 4),
            ("step", 8),
            ("step", 8),
        ],
    ),
    # a reset while a hit waits pinned
    "S21": (
        LARGE,
        [
            ("add", "r1", [0, 1, 2, 3], 1),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("add", "r2", [7, 1, 2, 3, 4, 5, 6, 0, 1], 4),
            ("step", 8),
            ("add", "r3", [0, 1, 2, 3, 0], 1),
            ("step", 8),
            ("reset",),
        ],
    ),
    # a lazily stored prompt's GPU blocks freed back to the tail
    "S26": _scenario("lazy-store-return-and-load"),
    # blocks behind the lazy scan's cursor, their CPU copies evicted, never stored again
    "S27": _scenario("lazy-scan-after-cpu-eviction"),
    # a GPU hit of one block, inside the first attention chunk, then a CPU hit: up to 0.32.0
    # its load writes into the null block
    "S24": _scenario("chunk-hit-after-unaligned-prefix"),
    # with DCP over two ranks, 0.24.0's scan reaches a block not yet confirmed
    "S6": _scenario("dcp-scan-reaches-confirmed-only"),
    # a prompt of 8 tokens, ending on a hash boundary, its tail (4) on a block it shares
    # with a longer prompt: 0.33.0's final flush looks for the tail at 8 and stores nothing
    "S28": _scenario("fine-grained-tail-of-shared-block"),
    # a GPU prefix hit refreshes its CPU copy in 0.34.0
    "S25": (
        LARGE,
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2),
            ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0], 1),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("step", 8),
        ],
    ),
}


def _cases() -> dict[str, list[tuple[str, Any, list[Any], str, str | None]]]:
    """Per release: (bug, config, program, variant, words the difference must name; None
    when it must conform)."""
    cases: dict[str, list[tuple[str, Any, list[Any], str, str | None]]] = {}
    for bug in BUGS:
        if bug.id in COUNTEREXAMPLES:
            config, program = COUNTEREXAMPLES[bug.id]
            assert bug.isolation and bug.fixed_variant
            cases.setdefault(bug.buggy, []).append(
                (bug.id, config, program, bug.isolation, bug.finds)
            )
            cases.setdefault(bug.fixed, []).append(
                (bug.id, config, program, bug.fixed_variant, None)
            )
    return cases


def test_every_bug_in_reach_has_a_counterexample() -> None:
    assert {b.id for b in BUGS if b.in_scope} == set(COUNTEREXAMPLES)


CASE_RELEASES: list[str] = sorted(_cases(), key=_version)


def _first_disagreements(
    version: str, runs: list[tuple[tuple[Any, ...], list[Any], str]]
) -> list[str | None]:
    """In ``version``'s environment, vLLM's first disagreement with each (configuration's
    fields, program, variant), or None; skipped where the release is not installed."""
    script = textwrap.dedent(
        f"""
        import json
        from kvoffload.model import OffloadConfig
        from kvoffload.testing.lockstep import first_disagreement
        for config, program, variant in {runs!r}:
            found = first_disagreement(
                OffloadConfig(*config), program, adapter="vllm", variant=variant
            )
            print(json.dumps({{"found": found}}))
        """
    )
    found = found_in_release(version, script)
    assert len(found) == len(runs)
    return found


@pytest.mark.parametrize("version", CASE_RELEASES)
def test_each_counterexample_shows_its_bug_and_conforms_once_fixed(version: str) -> None:
    cases = _cases()[version]
    runs = [(config, program, variant) for _, config, program, variant, _ in cases]
    for (bug, _, _, variant, words), got in zip(
        cases, _first_disagreements(version, runs), strict=True
    ):
        if words is None:
            assert got is None, f"{bug} in {version} vs {variant}: {got}"
        else:
            found = got is not None and any(w in got for w in words.split("|"))
            assert found, f"{bug} in {version} vs {variant}: {got}"
            assert got is not None and target_broke(got) == BREAKS_FROM_VLLM.get(bug), got


# The bugs whose counterexample breaks an invariant judged on vLLM's own state (issue 34):
# both of #53498 in 0.29.0, and 0.21.0's in-flight set emptied between steps. Every other one
# differs from the model with every observable form holding on vLLM's state, or breaking
# only what the isolating variant's other bugs break too (their invariants need ghost
# records: docs/spec.md).
BREAKS_FROM_VLLM = {"S2": "IN-FLIGHT", "S9": "FLUSH-COMPLETE", "S10": "POOL-FRESH"}


def _with_and_without(version: str, scenario: str, part: str) -> tuple[str | None, str | None]:
    """A scenario's first disagreement in ``version``'s environment against its row's model,
    and against that model without the variant ``part`` (a live bug the row models)."""
    fields, program = _scenario(scenario)
    variant = RELEASES[version].model_variant
    without = variant.replace(f"+{part}", "")
    assert without != variant
    conforming, buggy = _first_disagreements(
        version, [(fields, program, variant), (fields, program, without)]
    )
    return conforming, buggy


@pytest.mark.parametrize("version", ["0.30.0", "0.34.0"])
def test_the_live_window_scan_bug_shows_in_vllm_and_its_variant_conforms(version: str) -> None:
    """The counterexample of the live bug (docs/upstream.md): the release against its own row's
    model conforms; against that model without ``window-stale-ids`` it stores the reused
    block, which the fixed scan passes over. vLLM's own state shows the bug (issue 34): the
    block it stores holds the prompt-tail key of the other group's table, on no position its
    scan reached."""
    conforming, buggy = _with_and_without(version, "window-block-reused", "window-stale-ids")
    assert conforming is None, conforming
    assert buggy is not None and "store_gpu_blocks=(2,)" in buggy, buggy
    assert buggy.startswith(
        "the target breaks POSITION at call 5 ('step', 8): store 1 copies gpu block 2 "
    ), buggy


@pytest.mark.parametrize("version", ["0.30.0", "0.34.0"])
def test_the_prefix_cache_reset_of_57727_shows_in_vllm_and_its_variant_conforms(
    version: str,
) -> None:
    """vLLM issue #57727 (docs/upstream.md): a prefix-cache reset without the connector's
    reports success while the CPU tier still serves the stored prompt. Against its row's model
    the release conforms; against that model without ``reset-gpu-only`` the reset's answer
    differs (vLLM True, the model False), and with the connector's reset both agree."""
    conforming, buggy = _with_and_without(version, "prefix-reset-keeps-cpu", "reset-gpu-only")
    assert conforming is None, conforming
    # vLLM's own state breaks RESET: the reset it reported done left the CPU holding keys
    assert buggy is not None and buggy.startswith(
        "the target breaks RESET at call 4 ('reset_prefix_cache', False): "
        "reset_prefix_cache() returned True but the CPU map still holds keys"
    ), buggy


def test_an_unreachable_bug_has_no_checks() -> None:
    bug = HistoricalBug("host-buffer-chunks", "0.1.0", "0.2.0", out_of_reach="a GPU")
    assert not bug.in_scope and history.checks_by_release([bug]) == {}
    with pytest.raises(AssertionError, match="out of reach"):
        bug.buggy_check()


def test_a_difference_in_a_cell_names_the_state_before_the_result() -> None:
    both = (
        "call 8 ('step', 8): model returned StepResult(a), implementation StepResult(b); "
        "snapshots differ in ['cpu', 'pending_hits']: cpu: block 1 | 2"
    )
    assert history._short(both) == (
        "call 8 ('step', 8): results differ; snapshots differ in ['cpu', 'pending_hits']: "
        "cpu: block 1 / 2"
    )
    assert history._short("x" * 200).endswith("…") and len(history._short("x" * 200)) == 160
