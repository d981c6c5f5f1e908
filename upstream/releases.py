"""What each vLLM release is expected to do under the conformance machine, in one table.

A release is checked against one or more variants of the model
(:mod:`kvoffload.model.variants`), each with the verdict the check must reach: ``conform``,
or ``disagree`` where the release has a known bug that the machine must find by itself
(``finds``: words the first difference must contain). The findings behind each row are
written up in ``docs/upstream.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    variant: str
    expect: str  # "conform" or "disagree"
    why: str
    finds: str | None = None


@dataclass(frozen=True)
class Release:
    version: str
    note: str
    checks: tuple[Check, ...]

    @property
    def model_variant(self) -> str:
        """The variant the release conforms to."""
        return next(c.variant for c in self.checks if c.expect == "conform")


RELEASES = {
    r.version: r
    for r in [
        Release(
            "0.29.0",
            "the last release without PR #53532 (vLLM issue #53498)",
            (
                Check("fixed", "disagree", "a bug of #53498 against the fixed model"),
                Check(
                    "bug-53498-primary-only",
                    "disagree",
                    "with its registration modelled, the missing final flush",
                    # seen as a queued flush in the snapshot, or in a finish's result
                    finds="flush",
                ),
                Check("vllm-0.29", "conform", "both bugs of #53498 modelled"),
            ),
        ),
        Release(
            "0.30.0",
            "the first release with PR #53532",
            (Check("fixed", "conform", "the fixed model"),),
        ),
        Release(
            "0.34.0",
            "the latest release",
            (
                Check(
                    "inclusive-cpu",
                    "conform",
                    "the fixed model with 0.34's refresh of the CPU copy of GPU hits",
                ),
            ),
        ),
    ]
}


def release(version: str) -> Release:
    """The row of ``version``; a release not in the table is expected to conform to the
    fixed model."""
    found = RELEASES.get(version)
    if found is not None:
        return found
    return Release(version, "not in the table", (Check("fixed", "conform", "the fixed model"),))
