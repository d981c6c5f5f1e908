"""Progress of long work (campaigns, environment builds, the bug history) on standard error.

On a terminal a line is rewritten in place; anywhere else (a CI log, a pipe) each update is a
line of its own, at most one per ``every`` seconds, so that a log shows the work moving on
without a carriage return garbling it or a line per batch flooding it.

Invariant kept: the last update before :meth:`Progress.done` is always shown.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

EVERY = 15.0  # seconds between two lines of a log


class Progress:
    def __init__(self, every: float = EVERY, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.terminal = self.stream.isatty()
        self.shown = float("-inf")  # when the last line of a log was written
        self.pending: str | None = None  # the last update not yet written

    def update(self, text: str) -> None:
        now = time.monotonic()
        if self.terminal:
            print(f"\r{text}", end="", file=self.stream, flush=True)
            self.pending = text
        elif now - self.shown >= self.every:
            print(text, file=self.stream, flush=True)
            self.shown, self.pending = now, None
        else:
            self.pending = text

    def done(self) -> None:
        """End the progress: the terminal's line closed, or the last update written."""
        if self.terminal and self.pending is not None:
            print(file=self.stream, flush=True)
        elif not self.terminal and self.pending is not None:
            print(self.pending, file=self.stream, flush=True)
        self.pending = None
