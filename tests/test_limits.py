"""The bounds on work live in one place (kvoffload.model.limits) and are documented there and
in docs/conformance.md, value for value; a value of any size is shown short in an error."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.model import limits
from kvoffload.model.errors import ConfigError

DOCS = Path(__file__).parents[1] / "docs" / "conformance.md"


def test_every_limit_is_documented_with_its_value() -> None:
    table = DOCS.read_text().split("## Limits", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(MAX_\w+)` \| ([^|]+) \|", table, re.MULTILINE))
    bounds = {name: value for name, value in vars(limits).items() if name.startswith("MAX_")}
    assert set(rows) == set(bounds)
    for name, value in bounds.items():
        text = rows[name].strip()
        assert (float(text) if isinstance(value, float) else int(text)) == value, name


def test_a_value_of_any_size_is_shown_short() -> None:
    huge = [
        list(range(10**6)),
        tuple(range(10**6)),
        {n: n for n in range(10**5)},
        "x" * 10**7,
        b"y" * 10**7,
        10**10_000,  # more digits than Python writes at all
        [[0] * 1000] * 1000,
    ]
    for value in huge:
        shown = limits.brief(value)
        assert len(shown) <= limits.MAX_SHOWN + 60, shown[:200]
    assert "list of 1000000 items" in limits.brief(huge[0])
    assert limits.brief(10**10_000).startswith("an int of ")
    # short values are shown whole, as repr shows them
    for value in ([1, 2], "r0", None, 3, ("a",)):
        assert limits.brief(value) == repr(value)
    assert len(limits.cut("z" * 10**6)) < 1000 and limits.cut("short") == "short"


class _BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_value_that_repr_cannot_write_is_still_shown_short() -> None:
    # A small container may hold what repr cannot write (an int of more digits than Python
    # writes, a nest that holds itself, 10**4 levels deep, an object whose repr raises):
    # brief never raises, and stays short.
    holds_itself: list[object] = []
    holds_itself.append(holds_itself)
    deep: list[object] = []
    for _ in range(10**4):
        deep = [deep]
    for value in ([10**10_000], (1, {"k": 10**10_000}), holds_itself, deep, _BrokenRepr()):
        shown = limits.brief(value)
        assert len(shown) <= limits.MAX_SHOWN + 60, shown[:200]
    assert "an int of " in limits.brief([10**10_000])
    assert limits.brief(holds_itself).endswith("(list of 1 item)")
    assert "_BrokenRepr" in limits.brief(_BrokenRepr())


def test_the_bounds_on_a_runs_size_are_kept_in_one_place() -> None:
    """The command line and the fuzz API both check through these, so one bound, one
    message."""
    from kvoffload.model.limits import (
        MAX_SECONDS,
        MAX_SEED,
        cores,
        require_processes,
        require_seconds,
        require_seed,
    )

    assert require_seconds(1) == 1.0 and require_seconds(MAX_SECONDS) == MAX_SECONDS
    assert require_processes(cores()) == cores() and require_seed(MAX_SEED) == MAX_SEED
    refused: list[tuple[Callable[[object], object], object]] = [
        (require_seconds, v)
        for v in (0, -1.0, float("nan"), float("inf"), MAX_SECONDS * 2, True, "1")
    ]
    refused += [(require_processes, v) for v in (0, cores() + 1, True, 1.0, None)]
    refused += [(require_seed, v) for v in (-1, MAX_SEED + 1, False, 1.5)]
    for bound, value in refused:
        with pytest.raises(ConfigError, match=", got "):
            bound(value)
