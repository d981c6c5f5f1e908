"""Hypothesis settings profiles, always selected explicitly: ``fast`` (the default test run),
``ci`` (derandomized, no example database) and ``nightly`` (long campaigns). With ``CI`` set
Hypothesis would otherwise load a profile of its own; ``load()`` chooses ours. The example
database lives under ``.hypothesis/``."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

DATABASE = ".hypothesis/examples"
_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def register() -> None:
    db = DirectoryBasedExampleDatabase(DATABASE)
    settings.register_profile(
        "fast",
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        database=db,
        suppress_health_check=_QUIET,
    )
    settings.register_profile(
        "ci",
        max_examples=200,
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=_QUIET,
    )
    settings.register_profile(
        "nightly",
        max_examples=5000,
        stateful_step_count=60,
        deadline=None,
        database=db,
        suppress_health_check=_QUIET,
    )


def chosen() -> str:
    """``KVOFFLOAD_PROFILE`` if set; else ``ci`` when ``CI`` is set; else ``fast``."""
    return os.environ.get("KVOFFLOAD_PROFILE", "ci" if os.environ.get("CI") else "fast")


def load(name: str | None = None) -> settings:
    register()
    settings.load_profile(name or chosen())
    return settings.get_profile(name or chosen())
