"""The bounds on the work a configuration, a failure file or a command-line argument can ask
for, in one place (``docs/conformance.md``, "Limits", lists them with their reasons).

Every value that sizes work (a pool, a block, a request, a world of workers, a program, a
file, a number of processes, a number of seconds) is checked against its bound here before
any work starts, and refused with an error that names the bound (exit status 2 on the
command line). The bounds are far above what the machine draws and what vLLM deployments
run, and far below what exhausts this process: a value past them is a mistake or an
attack, never a configuration.

Invariant kept: :func:`brief` of any value is at most ``MAX_SHOWN`` characters plus a note
of the length cut, so that an error naming a value of any size stays one short line.
"""

from __future__ import annotations

import itertools
import math
import os
import reprlib

from kvoffload.model.errors import ConfigError

# -- a configuration (kvoffload.model.config.OffloadConfig) -------------------------------
# Blocks of one pool, the null block included: 4M, four times the scheduler benchmark's
# largest pool (10**6 blocks), the model's pool a list of that many blocks.
MAX_BLOCKS = 2**22
# Tokens of one block (a group's block size, the hash block size, a window, a chunk): vLLM's
# block sizes are 16 to a few thousand tokens (Mamba's align mode: up to the chunk size).
MAX_BLOCK_TOKENS = 2**16
# KV cache groups: hybrid models have a handful.
MAX_GROUPS = 32
# Workers (tensor-parallel ranks) reporting each transfer, and ranks of decode context
# parallelism: the implementation holds a buffer set per worker.
MAX_WORLD_SIZE = 256
# The implementation's KV bytes in all (every worker's GPU and CPU pools of every group and
# layer), allocated at construction: 8 GiB.
MAX_KV_BYTES = 8 * 2**30

# -- calls --------------------------------------------------------------------------------
# Tokens of one request, prompt and outputs (vLLM's max_model_len reaches 10**6 or so).
MAX_REQUEST_TOKENS = 2**22
# A step's token budget (vLLM's max_num_batched_tokens is thousands).
MAX_STEP_TOKENS = 2**24

# -- files and programs -------------------------------------------------------------------
# A failure file, read with this cap: a shrunk failure is a few kilobytes.
MAX_FAILURE_BYTES = 2 * 2**20
# Calls of one program (a failure file's, a replay's): the longest profile draws 60 rules.
MAX_PROGRAM_CALLS = 10_000

# -- the command line ---------------------------------------------------------------------
# Seconds a campaign runs: a week.
MAX_SECONDS = 7 * 24 * 3600.0
# A seed: Hypothesis takes any int, but a seed is printed and typed again.
MAX_SEED = 2**64 - 1
# Characters of a value an error message shows.
MAX_SHOWN = 120


def cores() -> int:
    """Processes worth running at once here (``--jobs``, ``fuzz --workers``): the cores this
    process may use."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # a system without affinity masks
        return os.cpu_count() or 1


def _got(value: object, typed: str | None) -> str:
    """What an error says it got: what was typed, where the value was read from text."""
    return brief(value if typed is None else typed)


def require_seconds(value: object, typed: str | None = None) -> float:
    """A run's seconds: finite, above 0, at most :data:`MAX_SECONDS`; or ConfigError
    (naming ``typed``, the text the value was read from, if given)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_SECONDS
    ):
        raise ConfigError(
            f"seconds must be finite, > 0 and at most {MAX_SECONDS:.0f} (a week), "
            f"got {_got(value, typed)}"
        )
    return float(value)


def require_processes(value: object, what: str = "processes", typed: str | None = None) -> int:
    """A number of processes to run at once: 1 to :func:`cores`; or ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= cores():
        raise ConfigError(
            f"{what} must be from 1 to {cores()} (the cores here), got {_got(value, typed)}"
        )
    return value


def require_seed(value: object, typed: str | None = None) -> int:
    """A seed: a whole number from 0 to :data:`MAX_SEED`; or ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"the seed must be from 0 to {MAX_SEED}, got {_got(value, typed)}")
    return value


def brief(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, cut to ``limit`` characters with the length said: an error names a
    value of any size in one short line. A value is written whole only when a bounded walk
    of it finds it small; a larger one is written by :mod:`reprlib` (a few items of each
    container, a few levels deep), so that a list of millions of items, a deep or
    self-holding nest, or an int of more digits than Python writes costs no more than a
    short value, and never raises."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    try:
        text = repr(value) if _small(value, 4 * limit) else ""
    except Exception:  # an object whose own repr breaks: reprlib names its type instead
        text = ""
    if not text:
        text = _Short(limit).repr(value)
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            shown = text if len(text) <= limit else f"{text[:limit]}..."
            count = len(value)
            return f"{shown} ({type(value).__name__} of {count} item{'s' * (count != 1)})"
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text)} characters)"
    return text


def _small(value: object, budget: int) -> bool:
    """Whether ``value``'s ``repr`` is cheap: at most ``budget`` items, characters and int
    digits in all, counted by a walk that stops as soon as the budget is spent (a nest that
    holds itself spends it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            budget -= len(item)
        elif isinstance(item, int):
            budget -= item.bit_length() // 3 + 1
        elif isinstance(item, dict):
            budget -= len(item) + 1
            if budget >= 0:
                stack.extend(itertools.chain.from_iterable(item.items()))
        elif isinstance(item, (list, tuple, set, frozenset)):
            budget -= len(item) + 1
            if budget >= 0:
                stack.extend(item)
        else:
            budget -= 1
        if budget < 0:
            return False
    return True


class _Short(reprlib.Repr):
    """:mod:`reprlib`'s short repr, with ints of any size (Python refuses to write an int of
    more than 4300 digits at all): a few items per container, three levels deep."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.maxlevel = 3
        for name in ("maxtuple", "maxlist", "maxarray", "maxdict", "maxset", "maxfrozenset"):
            setattr(self, name, 8)
        self.maxdeque = 8
        self.maxstring = self.maxother = self.maxlong = limit // 2

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.limit:
            return f"an int of {x.bit_length()} bits"
        return super().repr_int(x, level)


def cut(text: str, limit: int = 4 * MAX_SHOWN) -> str:
    """A message cut to ``limit`` characters (the last guard of a one-line error)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
