"""Hypothesis settings profiles, always selected explicitly.

``fast`` is the default test run; ``ci`` is what ``.ci/run`` selects; ``nightly`` is for long
campaigns. Set ``KVOFFLOAD_PROFILE`` to choose; with ``CI`` set and no choice, ``ci``.
The example database lives under ``.hypothesis/`` except in ``ci``, which is derandomized.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_DB = DirectoryBasedExampleDatabase(".hypothesis/examples")

settings.register_profile(
    "fast", max_examples=60, stateful_step_count=30, deadline=None, database=_DB
)
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    stateful_step_count=60,
    deadline=None,
    database=_DB,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVOFFLOAD_PROFILE", "ci" if os.environ.get("CI") else "fast"))
