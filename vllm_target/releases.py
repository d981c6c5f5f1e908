"""What each vLLM release is expected to do under the conformance machine, in one table.

A release is checked against one or more variants of the model
(:mod:`kvoffload.model.variants`), each with the verdict the check must reach: ``conform``,
or ``disagree`` where the release has a known bug that the machine must find by itself
(``finds``: words the first difference must contain, or one of ``a|b``). The findings
behind each row are written up in ``docs/upstream.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    variant: str
    expect: str  # "conform" or "disagree"
    why: str
    finds: str | None = None
    # "offload": the conformance machine over vLLM's offload code, the model's engine
    # scheduling; "scheduler": the machine over vLLM's own scheduler and connector
    # (kvoffload.testing.scheduler_machine); "worker": the same with vLLM's own worker on
    # every rank, its DMA on an emulated device and its KV bytes checked (issue 33)
    machine: str = "offload"


@dataclass(frozen=True)
class Release:
    version: str
    note: str
    checks: tuple[Check, ...]

    @property
    def model_variant(self) -> str:
        """The variant the release conforms to."""
        return next(
            c.variant for c in self.checks if c.expect == "conform" and c.machine == "offload"
        )


def _conforming(
    versions: list[str], variant: str, note: str, why: str, worker: bool = False
) -> list[Release]:
    """Releases that conform to ``variant``, one row each; with ``worker``, their own worker
    on every rank too (the worker machine: the releases whose worker it drives)."""
    checks = [Check(variant, "conform", why)]
    if worker:
        checks.append(Check(variant, "conform", _WORKER_CONFORMS, machine="worker"))
    return [Release(v, note, tuple(checks)) for v in versions]


_WORKER_CONFORMS = (
    "vLLM's own worker on every rank: the same model, its transfers completing in issue "
    "order per worker, every KV byte checked"
)


RELEASES = {
    r.version: r
    for r in [
        *_conforming(
            ["0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0"],
            "vllm-0.21",
            "before PRs #42289 and #41289: CPU hits unpinned, stores deduplicated per step",
            "vLLM 0.29.0's model with both bugs (S1, S2) and the pool of 0.23.0",
        ),
        *_conforming(
            ["0.22.0", "0.22.1", "0.23.0"],
            "vllm-0.23",
            "pins and cross-step deduplication; no reset() yet; free_blocks appends all",
            "vLLM 0.29.0's model with the pool of 0.23.0",
        ),
        *_conforming(
            ["0.24.0"],
            "vllm-0.29+dcp-per-rank-blocks",
            "reset() (PR #39726) and the pool of 0.29.0; both bugs of #53498; DCP allowed",
            "both bugs of #53498, the CPU hits of requests that skip reading and the per-rank "
            "block counts of DCP (S6) modelled",
        ),
        *_conforming(
            ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0"],
            "vllm-0.29",
            "reset() (PR #39726) and the pool of 0.29.0; both bugs of #53498",
            "both bugs of #53498 and the CPU hits of requests that skip reading modelled",
        ),
        Release(
            "0.29.0",
            "the last release without PR #53532 (vLLM issue #53498)",
            (
                Check("fixed", "disagree", "a bug of #53498 against the fixed model"),
                Check(
                    "primary-only+serves-skip-reading+window-tail-not-recovered+window-stale-ids"
                    "+reset-gpu-only+preempt-keeps-table+selection-0.29",
                    "disagree",
                    "with its registration, its CPU hits for requests that skip reading, its "
                    "window scan, resumption and selection loop modelled, the missing final flush",
                    # seen as a queued flush in the snapshot, or in a finish's result
                    finds="flush",
                ),
                Check(
                    "vllm-0.29",
                    "conform",
                    "both bugs of #53498 and the CPU hits of requests that skip reading modelled",
                ),
            ),
        ),
        *_conforming(
            ["0.30.0", "0.31.0"],
            "lazy-0.33+window-stale-ids+reset-gpu-only+preempt-keeps-table+chunk-unaligned-hits",
            "PR #53532 (0.30.0 is the first); lazy mode's scan cursor and return to the tail; "
            "a resumed request's old store table kept (S20)",
            "the fixed model, with the lazy mode of 0.30.0 to 0.33.0 (S26, S27), the "
            "window scan's reused blocks, the prefix-cache reset of #57727, the store table "
            "kept across preemption and CPU hits after a prefix inside a chunk (S24)",
        ),
        *_conforming(
            ["0.32.0"],
            "reset-releases-hits+lazy-0.33+window-stale-ids+reset-gpu-only+chunk-unaligned-hits",
            "reset() releases the pins of CPU hits not yet allocated (S21)",
            "the fixed model with 0.32's reset of lookup pins, 0.33's lazy mode, the "
            "window scan's reused blocks, the prefix-cache reset of #57727 and CPU hits after "
            "a prefix inside a chunk (S24)",
        ),
        *_conforming(
            ["0.33.0"],
            "reset-releases-hits+lazy-0.33+window-stale-ids+reset-gpu-only+tail-at-prompt-end",
            "no CPU hit after a local prefix inside an attention chunk (S24)",
            "the fixed model with 0.32's reset of lookup pins, 0.33's lazy mode, the "
            "window scan's reused blocks, the prefix-cache reset of #57727 and the final "
            "flush's prompt tail at the prompt's end (S28)",
            worker=True,
        ),
        Release(
            "0.34.0",
            "the latest release",
            (
                # The live bug of the window scan (window-stale-ids) is not a check of its own:
                # the machine meets it in a few thousand programs, more than a check's budget
                # promises; tests/test_upstream_history.py replays its counterexample.
                Check(
                    "inclusive-cpu+window-stale-ids+reset-gpu-only",
                    "conform",
                    "the fixed model with 0.34's refresh of the CPU copy of GPU hits, the "
                    "window scan's reused blocks and the prefix-cache reset of #57727",
                ),
                # vLLM issue #57727, live: Scheduler.reset_prefix_cache without the
                # connector's reset reports success while the CPU tier still serves hits.
                Check(
                    "inclusive-cpu+window-stale-ids",
                    "disagree",
                    "the prefix-cache reset of #57727 against the model's",
                    finds="reset_prefix_cache",
                ),
                # vLLM's own Scheduler and the connector its factory builds, the model's
                # engine admitting as 0.34.0's scheduler does (issue 12).
                Check(
                    "inclusive-cpu+window-stale-ids+reset-gpu-only",
                    "conform",
                    "vLLM's own scheduler: the same model, its engine admitting as 0.34's "
                    "scheduler does",
                    machine="scheduler",
                ),
                Check(
                    "inclusive-cpu+window-stale-ids",
                    "disagree",
                    "vLLM's own scheduler: the prefix-cache reset of #57727 against the model's",
                    finds="reset_prefix_cache",
                    machine="scheduler",
                ),
                # vLLM's own SimpleCPUOffloadWorker on every rank beside that scheduler, its
                # copies on an emulated device, every block's bytes checked (issue 33).
                Check(
                    "inclusive-cpu+window-stale-ids+reset-gpu-only",
                    "conform",
                    _WORKER_CONFORMS,
                    machine="worker",
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


def release_numbers(version: str) -> tuple[int, ...] | None:
    """``0.34.1.dev3+g1a2b`` -> ``(0, 34, 1)``; None for what is no version."""
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(n) for n in match.groups()) if match else None


def governing_release(version: str | None) -> Release:
    """The row a target of ``version`` is held to: its own, or that of the newest release in
    the table before it (a branch past 0.34.0, ``0.34.1.dev3``, is held to 0.34.0's
    expectations); a version before every row, or none, is held to the fixed model."""
    if version is not None and version in RELEASES:
        return RELEASES[version]
    numbers = None if version is None else release_numbers(version)
    if numbers is not None:
        # A pre-release (0.34.0.dev2, 0.34.0rc1) comes before its release, so it is held
        # to the release before; the local part (+g1a2b) says nothing of that.
        public = (version or "").split("+")[0]
        dev = re.search(r"^v?\d+\.\d+\.\d+\.?(dev|rc|a|b)\d*", public) is not None
        older = [
            row
            for v, row in RELEASES.items()
            if (n := release_numbers(v)) is not None and (n < numbers or (n == numbers and not dev))
        ]
        if older:
            row = max(older, key=lambda r: release_numbers(r.version) or ())
            note = f"held to vllm=={row.version}'s checks, the newest release before {version}"
            return Release(row.version, note, row.checks)
    return release(version or "unknown")
