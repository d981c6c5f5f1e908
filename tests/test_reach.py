"""``kvoffload verify --target vllm... --coverage``: how much of vLLM's offload code the
checks reach. The report's arithmetic on a made-up coverage.py report, and a real
measurement of vLLM 0.34.0 where the release is installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.main import main
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.upstream.reach import (
    DEAD,
    HEADLINE,
    SCHEDULER,
    UNREACHABLE,
    WATCHED,
    FileReach,
    Unreachable,
    counted_out,
    from_report,
    load,
    missed_lines,
    missed_ranges,
    reachable_summary,
    table,
)


def _reach(missing: tuple[int, ...], executed: tuple[int, ...]) -> FileReach:
    return FileReach(HEADLINE, 10, 10 - len(missing), 4, 1, missing, ((3, 4),), executed)


def test_missed_lines_are_ranges_split_only_by_a_line_that_ran() -> None:
    reach = _reach((2, 3, 6, 9, 12), (1, 4, 10))
    # 3 and 6: lines 4 (ran) lies between, a new range; 6 and 9: nothing ran between them.
    assert missed_ranges(reach) == [(2, 3), (6, 9), (12, 12)]
    assert missed_lines(reach) == "2-3, 6-9, 12"


def test_percentages_count_statements_and_branches() -> None:
    reach = _reach((2, 3), (1,))
    assert reach.statement_percent == 80.0 and reach.branch_percent == 25.0
    assert reach.percent == pytest.approx(100 * 9 / 14)
    empty = FileReach("x.py", 0, 0, 0, 0, (), (), ())
    assert empty.percent == empty.statement_percent == empty.branch_percent == 100.0
    assert table([reach])[2].startswith(f"| {HEADLINE} | 10 | 8 | 4 | 1 | 80.0 | 25.0 | 64.3 |")


def test_a_report_keeps_the_watched_files_the_release_has(tmp_path: Path) -> None:
    root = tmp_path / "vllm"
    for rel in WATCHED[:2]:  # a release without the core files
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / "other.py").write_text("y = 2\n")
    summary = {"num_statements": 3, "covered_lines": 2, "num_branches": 2, "covered_branches": 1}
    entry = {
        "summary": summary,
        "missing_lines": [3],
        "missing_branches": [[2, -1]],
        "executed_lines": [1, 2],
    }
    report = {"files": {str(root / WATCHED[0]): entry, str(root / "other.py"): entry}}
    reaches = from_report(report, root)
    # The second watched file was never imported: not in the report, so not in the table;
    # an unwatched file is never shown.
    assert [r.path for r in reaches] == [WATCHED[0]]
    assert reaches[0].missing_branches == ((2, -1),) and reaches[0].covered_statements == 2
    saved = tmp_path / "reach.json"
    saved.write_text(json.dumps([r.as_json() for r in reaches]))
    assert load(saved) == reaches


SOURCE = """\
def f(state):
    if state is None:
        return
    for x in state:
        if x:
            g(x)
    return 1


def h(state):
    if state is None:
        return 0
    if state is None:
        return 1
"""


def test_an_unreachable_entry_is_found_by_its_text_in_its_function() -> None:
    body = Unreachable("x.py", "f", "for x in state:", 1, 2, DEAD, "a loop never entered")
    assert body.lines(SOURCE) == range(5, 7)
    itself = Unreachable("x.py", "f", "return", 0, 1, DEAD, "the early return")
    assert itself.lines(SOURCE) == range(3, 4)
    # An anchor twice in its function, or a function the source lacks: not located.
    assert Unreachable("x.py", "h", "if state is None:", 1, 1, DEAD, "").lines(SOURCE) is None
    assert Unreachable("x.py", "k", "return", 0, 1, DEAD, "").lines(SOURCE) is None


def test_missed_statements_listed_unreachable_are_counted_out_and_ran_ones_reported() -> None:
    entries = (
        Unreachable("x.py", "f", "for x in state:", 1, 2, DEAD, "never entered"),
        Unreachable("x.py", "f", "if state is None:", 1, 1, SCHEDULER, "no state"),
        Unreachable("x.py", "k", "return", 0, 1, DEAD, "a function of another release"),
        Unreachable("y.py", "f", "return", 0, 1, DEAD, "another file"),
    )
    # Line 5 is missed, line 6 ran (the list is wrong there), line 3 is missed.
    out, ran, unlocated = counted_out("x.py", SOURCE, {3, 5, 7}, {2, 4, 6}, entries)
    assert out == ((3, SCHEDULER), (5, DEAD)) and ran == (6,) and unlocated == 1
    reach = FileReach("x.py", 7, 4, 0, 0, (3, 5, 7), (), (2, 4, 6), out, ran, unlocated)
    assert reach.reachable_statements == 5 and reach.reachable_percent == 80.0
    summary = reachable_summary(reach)
    assert summary.startswith("x.py: 4 of the 5 statements a run can reach ran (80.0%)")
    assert f"1 of {SCHEDULER}" in summary and f"1 of {DEAD}" in summary
    assert "LISTED UNREACHABLE BUT RAN: 6" in summary and "1 of the list's entries" in summary


def test_every_unreachable_entry_is_in_vllm_0_34() -> None:
    # The list is written against 0.34.0's files: each entry names one place in its file,
    # and every line it spans is code (neither blank nor a comment).
    cache = Cache(default_cache())
    if not cache.installed("0.34.0"):
        pytest.skip("vllm==0.34.0 is not installed: kvoffload install vllm==0.34.0")
    for entry in UNREACHABLE:
        assert entry.path in WATCHED, entry
        source = (cache.release("0.34.0") / "vllm" / entry.path).read_text()
        text = source.splitlines()
        lines = entry.lines(source)
        assert lines is not None, entry
        for n in lines:
            assert text[n - 1].strip() and not text[n - 1].strip().startswith("#"), (entry, n)


def test_coverage_is_for_vllm_targets_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--target", "impl", "--coverage", "--no-mutants"]) == 2
    assert "--coverage measures vLLM's code" in capsys.readouterr().err


def test_coverage_html_must_be_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["verify", "--target", "vllm==0.34.0", "--coverage-html", str(a_file)])
    assert stop.value.code == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_vllm_0_34_is_measured_while_its_checks_run(tmp_path: Path) -> None:
    cache = Cache(default_cache())
    if not cache.installed("0.34.0"):
        pytest.skip("vllm==0.34.0 is not installed: kvoffload install vllm==0.34.0")
    probe = [str(cache.python), "-c", "import coverage"]
    if subprocess.run(probe, capture_output=True, check=False).returncode:
        pytest.skip("the cache's environment predates coverage.py: kvoffload install vllm==0.34.0")
    result, html = tmp_path / "verdict.json", tmp_path / "html"
    command = [sys.executable, "-m", "kvoffload", "verify", "--target", "vllm==0.34.0"]
    command += ["--profile", "fast", "--seconds", "5", "--seed", "1", "--json", str(result)]
    command += ["--coverage-html", str(html)]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| vLLM file | statements |" in run.stdout and (html / "index.html").exists()
    rows = {row["path"]: row for row in json.loads(result.read_text())["coverage"]}
    assert set(rows) == set(WATCHED)  # 0.34.0 has every watched file, and imports each
    manager = rows[HEADLINE]
    assert 0 < manager["covered_statements"] < manager["statements"]
    assert 0 < manager["covered_branches"] < manager["branches"]
    source = (cache.release("0.34.0") / "vllm" / HEADLINE).read_text().splitlines()

    def line_of(text: str) -> int:
        return next(n for n, line in enumerate(source, 1) if text in line)

    # Reached: the lookup's CPU hit search, and the lazy scan (lazy mode is drawn). Never
    # reached: a null block handed off (vLLM's scheduler hands off only blocks it has just
    # keyed, and so does the model's engine).
    missed = manager["missing_lines"]
    # The statements listed unreachable: none ran, every entry is in 0.34.0's source, and
    # the figure of the rest is reported.
    assert manager["ran_unreachable"] == [] and manager["unlocated"] == 0
    assert manager["unreachable"] and all(n in missed for n, _ in manager["unreachable"])
    assert "statements a run can reach ran" in run.stdout
    # Reached because the adapters act as vLLM does: a step whose workers completed no store
    # sends no worker metadata, and the CPU pool is sized from its bytes on the
    # configurations with an even number of CPU blocks.
    assert line_of("if not isinstance(meta, SimpleCPUOffloadWorkerMetadata):") + 1 not in missed
    assert line_of("num_cpu_blocks = (") not in missed
    assert line_of("self.cpu_coordinator.find_longest_cache_hit(") not in missed
    assert line_of("gpu_pool = self._gpu_block_pool") not in missed
    assert line_of("stats.dropped_null_block += 1") in missed
