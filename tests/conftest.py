"""Loads the Hypothesis profile explicitly (see :mod:`kvoffload.testing.profiles`)."""

from __future__ import annotations

from kvoffload.testing import profiles

profiles.load()
