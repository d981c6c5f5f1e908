"""Hypothesis settings profiles, always selected explicitly: ``fast`` (the default test run),
``ci`` (derandomized, no example database) and ``nightly`` (long campaigns). With ``CI`` set
Hypothesis would otherwise load a profile of its own; ``load()`` chooses ours. The example
database lives under ``.hypothesis/`` (of the caller's folder for an isolated subprocess:
:func:`kvoffload.testing.isolation.database_folder`)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvoffload.testing.isolation import database_folder


def without_local_constants() -> None:
    """Hypothesis draws, now and then, a constant it read from the source of the modules
    imported so far outside site-packages (kvoffload's, a vLLM tree's, within a time limit
    of its own). What a seed draws would then depend on what happens to be imported, and
    how fast: a derandomized run in pytest, under ``kvoffload verify`` or on a slower machine
    would run other programs, and a draw-rate floor would hold in one and not in another.
    The machine's draws are its own: only Hypothesis's global constants are used."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # a Hypothesis without local constants
        return
    if hasattr(providers, "_get_local_constants"):
        empty = Constants()
        providers._get_local_constants = lambda: empty
        providers.CONSTANTS_CACHE.cache.clear()


without_local_constants()


def _base() -> settings:
    """What every profile shares. One failure is enough: stop at the first disagreement and
    shrink it, rather than hunt for more and explain each (the reproducer says what
    differed). Programs are slow next to Hypothesis's own draws, hence no deadline."""
    return settings(
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )


def register() -> None:
    base, db = _base(), DirectoryBasedExampleDatabase(str(database_folder()))
    settings.register_profile("fast", base, max_examples=60, stateful_step_count=30, database=db)
    settings.register_profile(
        "ci",
        base,
        max_examples=1000,
        stateful_step_count=40,
        derandomize=True,
        database=None,
    )
    settings.register_profile(
        "nightly", base, max_examples=5000, stateful_step_count=60, database=db
    )


def chosen() -> str:
    """``KVOFFLOAD_PROFILE`` if set; else ``ci`` when ``CI`` is set; else ``fast``."""
    return os.environ.get("KVOFFLOAD_PROFILE", "ci" if os.environ.get("CI") else "fast")


def load(name: str | None = None) -> settings:
    """Load ``name`` (default: :func:`chosen`) as the current profile and return it."""
    register()
    settings.load_profile(name or chosen())
    return settings.get_profile(name or chosen())


def get(name: str) -> settings:
    """The profile ``name``, without making it the current one."""
    register()
    return settings.get_profile(name)
