"""Long work says it goes on, in a form a CI log keeps readable: a line of its own per update
(at most one per interval, the last always shown), never a carriage return, where the output
is not a terminal (kvoffload.testing.progress)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from kvoffload.testing.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_interval_and_the_last_update() -> None:
    log = io.StringIO()
    progress = Progress(every=3600.0, stream=log)
    for n in range(100):
        progress.update(f"{n} programs")
    progress.done()
    assert log.getvalue() == "0 programs\n99 programs\n"
    every = io.StringIO()
    progress = Progress(every=0.0, stream=every)
    for n in range(3):
        progress.update(f"{n} programs")
    progress.done()
    assert every.getvalue() == "0 programs\n1 programs\n2 programs\n"


def test_a_terminal_gets_one_line_rewritten() -> None:
    screen = Terminal()
    progress = Progress(stream=screen)
    for n in range(3):
        progress.update(f"{n} programs")
    progress.done()
    assert screen.getvalue() == "\r0 programs\r1 programs\r2 programs\n"


def test_a_campaign_piped_to_a_log_has_no_carriage_return(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kvoffload", "verify", "--seconds", "3", "--no-mutants"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "\r" not in run.stderr and "\r" not in run.stdout
    lines = [line for line in run.stderr.splitlines() if " programs, " in line]
    assert lines and all(line.startswith("impl: ") for line in lines)
