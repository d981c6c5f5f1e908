"""The history of vLLM's SimpleCPUOffload bugs: the 29 fixed upstream between vLLM 0.19.0
and 0.34.0, each with the last release that has it and the first with its fix, as read from
the shipped wheels (release against release diffs of the connector and the block pool).
Each row is a bug of the catalogue (:mod:`kvoffload.model.catalogue`), which gives its id,
its number (S1 to S29), its reference and its title.

For a bug in the model's reach, ``isolation`` is the model the last buggy release is
compared with: the model of the first release with the fix, in which that release's *other*
bugs are modelled (a composed variant of :mod:`kvoffload.model.variants`), so that the first
difference can only be this bug; ``finds`` is what that difference must name (words of its
description: a snapshot field, a result); ``fixed_variant`` is the model the fixed release
conforms to; ``method`` says how the bug was isolated. A bug out of reach says what the
machine lacks to reach it (``out_of_reach``).

Invariants: the rows are the catalogue's S1 to S29, each once and in order; a bug is either
in reach, with every field of its checks, or out of reach with the reason; its last buggy
release comes before its fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.model.catalogue import BY_ID, canonical
from kvoffload.model.errors import ConfigError
from kvoffload.vllm_target.releases import Check


@dataclass(frozen=True)
class HistoricalBug:
    bug: str  # its id in the bug catalogue (kvoffload.model.catalogue), which numbers the row
    buggy: str  # the last release with the bug
    fixed: str  # the first release with its fix
    isolation: str | None = None  # the model the buggy release is compared with
    fixed_variant: str | None = None  # the model the fixed release conforms to
    finds: str | None = None  # what the first difference must name (``a|b``: either)
    method: str = ""  # how the bug is isolated from the buggy release's other bugs
    out_of_reach: str | None = None  # why the machine cannot reach it yet

    @property
    def id(self) -> str:
        """The row's number in the history (S1 to S29)."""
        number = BY_ID[self.bug].history
        assert number is not None, f"{self.bug} has no row in the history"
        return number

    @property
    def ref(self) -> str:
        return BY_ID[self.bug].ref

    @property
    def title(self) -> str:
        return BY_ID[self.bug].title

    @property
    def in_scope(self) -> bool:
        return self.out_of_reach is None

    def buggy_check(self) -> Check:
        """The last release with the bug, against the model with its other bugs."""
        assert self.isolation is not None, f"{self.id} is out of reach"
        return Check(self.isolation, "disagree", f"{self.id} by itself", self.finds)

    def fixed_check(self) -> Check:
        """The first release with the fix, against its own model."""
        assert self.fixed_variant is not None, f"{self.id} is out of reach"
        return Check(self.fixed_variant, "conform", f"{self.fixed} conforms")


# vLLM 0.29.0's other bugs and its selection loop, which the fixed model of 0.30.0 has not.
_S10 = "primary-only"
_S9 = "no-final-flush"
_S12 = "serves-skip-reading"
_S14 = "window-tail-not-recovered"
# vLLM 0.30.0 to 0.33.0's lazy mode (S26 and S27), which every fixed model of them includes.
_LAZY = "lazy-0.33"
# Live in every release that draws sliding windows and resets (0.24.0 to 0.34.0), so every
# model of them includes both: the scan stores a window block freed and reused by another
# position; a prefix-cache reset without the connector's reports success (#57727).
_LIVE = "window-stale-ids+reset-gpu-only"
# Up to 0.31.0 (S20): a preempted request resumed as a new one keeps its old store table.
_S20 = "preempt-keeps-table"
# Up to 0.32.0 (S24): a CPU hit after a local prefix that ends inside an attention chunk.
_S24 = "chunk-unaligned-hits"
# 0.33.0 (S28; fine-grained layouts are drawn from 0.33.0 on): the final flush looks for the
# prompt tail at the prompt's end.
_S28 = "tail-at-prompt-end"
BUGS: list[HistoricalBug] = [
    HistoricalBug(
        "no-hit-pins",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+step-dedup+scan-breaks-unhashed",
        "vllm-0.23",
        "pending_hits",
        "0.21.0's other bug (S2) and its scan's stop at an unkeyed block modelled",
    ),
    HistoricalBug(
        "step-dedup",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+no-hit-pins+scan-breaks-unhashed",
        "vllm-0.23",
        "in_flight_gpu_blocks",
        "0.21.0's other bug (S1) and its scan's stop at an unkeyed block modelled",
    ),
    HistoricalBug(
        "scan-breaks-unhashed",
        "0.21.0",
        "0.22.0",
        out_of_reach="sliding-window groups of another block size",
    ),
    HistoricalBug(
        "store-skips-compute-wait",
        "0.23.0",
        "0.24.0",
        out_of_reach="overlapped execution: the worker machine drives vLLM's synchronous "
        "scheduling, where a forward has run before a later step stores its blocks "
        "(docs/upstream.md); the implementation has it as the fault store-skips-compute-wait",
    ),
    HistoricalBug(
        "metadata-by-reference",
        "0.23.0",
        "0.24.0",
        out_of_reach="0.23.0's worker: the worker machine drives 0.34.0's only (its workers "
        "read the very metadata object the scheduler built, as vLLM's in-process executor "
        "hands it over)",
    ),
    HistoricalBug(
        "dcp-per-rank-blocks",
        "0.24.0",
        "0.25.0",
        "vllm-0.29",
        "vllm-0.29",
        "tracked|loads",
        "0.24.0's other bugs (those of 0.29.0's model) modelled",
    ),
    HistoricalBug(
        "pcp-block-sizes",
        "0.25.1",
        "0.26.0",
        out_of_reach="prefill context parallelism (PCP); DCP alone is modelled",
    ),
    HistoricalBug(
        "eagle-lookup",
        "0.26.0",
        "0.27.0",
        out_of_reach="speculative decoding",
    ),
    HistoricalBug(
        "no-final-flush",
        "0.29.0",
        "0.30.0",
        f"{_S10}+{_S12}+{_S14}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        "pending_flushes",
        "0.29.0's registration (S10), CPU hits for requests that skip reading (S12), "
        "window scan (S14) and selection loop modelled",
    ),
    HistoricalBug(
        "primary-only",
        "0.29.0",
        "0.30.0",
        f"{_S9}+{_S12}+{_S14}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        "snapshots differ in ['cpu']",
        "0.29.0's missing final flush (S9), CPU hits for requests that skip reading (S12), "
        "window scan (S14) and selection loop modelled",
    ),
    HistoricalBug(
        "cpu-stored-events",
        "0.29.0",
        "0.30.0",
        out_of_reach="0.29.0's kv-cache events (the machine compares events from 0.30.0 on; no "
        "variant models the earlier ones yet)",
    ),
    HistoricalBug(
        "serves-skip-reading",
        "0.29.0",
        "0.30.0",
        f"{_S10}+{_S9}+{_S14}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        # The CPU hit it serves shows first as its load, or, when the step that would send
        # the load differs first in its stores, as the hit pinned for the request.
        "'loads'|'pending_hits'",
        "0.29.0's registration (S10), missing final flush (S9), window scan (S14) and "
        "selection loop modelled",
    ),
    HistoricalBug(
        "no-partial-tail",
        "0.29.0",
        "0.30.0",
        out_of_reach="fine-grained partial hits (a Mamba group larger than the hash block) "
        "and 0.29.0's positional scan of Mamba tables",
    ),
    HistoricalBug(
        "window-tail-not-recovered",
        "0.29.0",
        "0.30.0",
        f"{_S10}+{_S9}+{_S12}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        # the cursor left on the null position (CPU pool full), or the block taken back
        # from the GPU prefix cache in the model's store and not in 0.29.0's
        "tracked|in_flight_gpu_blocks",
        "0.29.0's registration (S10), missing final flush (S9), CPU hits for requests that "
        "skip reading (S12) and selection loop modelled",
    ),
    HistoricalBug(
        "dcp-hybrid-groups",
        "0.29.0",
        "0.30.0",
        out_of_reach="DCP/PCP with hybrid groups",
    ),
    HistoricalBug(
        "no-forward-stores",
        "0.29.0",
        "0.30.0",
        out_of_reach="0.29.0's worker: the worker machine drives 0.34.0's model runner glue "
        "only (it catches the class: a step without a forward that drops its stores)",
    ),
    HistoricalBug(
        "mixed-page-sizes",
        "0.29.0",
        "0.30.0",
        out_of_reach="0.29.0's worker: the worker machine drives 0.34.0's only (it catches "
        "the class: a block stride that copies part of a page)",
    ),
    HistoricalBug(
        "disk-dma-events",
        "0.29.0",
        "0.30.0",
        out_of_reach="0.29.0's worker: the worker machine drives 0.34.0's disk backend only "
        "(it catches the class: a staging buffer written to the file before its copy ran)",
    ),
    HistoricalBug(
        "uncacheable-groups",
        "0.30.0",
        "0.31.0",
        out_of_reach="special hybrid groups and lazy mode",
    ),
    HistoricalBug(
        "preempt-keeps-table",
        "0.31.0",
        "0.32.0",
        f"{_LAZY}+{_LIVE}+{_S24}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S24}",
        "tracked",
        "0.31.0's lazy mode (S26, S27) and reset (S21) modelled",
    ),
    HistoricalBug(
        "reset-keeps-hit-pins",
        "0.31.0",
        "0.32.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S24}",
        "pending_hits",
        "0.31.0's lazy mode (S26, S27) and resumption (S20) modelled",
    ),
    HistoricalBug(
        "coordinator-prefix",
        "0.31.0",
        "0.32.0",
        out_of_reach="hybrid retention intervals and hash lookahead",
    ),
    HistoricalBug(
        "pool-size-across-workers",
        "0.32.0",
        "0.33.0",
        out_of_reach="workers with different KV layouts: the worker machine gives every rank "
        "the same layout",
    ),
    HistoricalBug(
        "chunk-unaligned-hits",
        "0.32.0",
        "0.33.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S28}",
        "model returned StepResult",
        "0.32.0's lazy mode (S26, S27) modelled",
    ),
    HistoricalBug(
        "cpu-lru-not-refreshed",
        "0.33.0",
        "0.34.0",
        f"inclusive-cpu+{_LAZY}+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "cpu: free queue",
        "0.33.0's lazy mode (S26, S27) and final flush's prompt tail (S28) modelled",
    ),
    HistoricalBug(
        "lazy-returns-to-tail",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+lazy-stale-cursor+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "gpu: free queue",
        "0.33.0's scan cursor (S27) modelled, and its eager mode (without S25's refresh, "
        "with S28's prompt tail)",
    ),
    HistoricalBug(
        "lazy-stale-cursor",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+lazy-returns-to-tail+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "model returned StepResult",
        "0.33.0's return of lazy stores to the tail (S26) modelled, and its eager mode "
        "(without S25's refresh, with S28's prompt tail)",
    ),
    HistoricalBug(
        "tail-at-prompt-end",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}",
        f"inclusive-cpu+{_LIVE}",
        "pending_flushes",
        "0.33.0's lazy mode (S26, S27) modelled, and its eager mode (without S25's refresh)",
    ),
    HistoricalBug(
        "host-buffer-chunks",
        "0.33.0",
        "0.34.0",
        out_of_reach="host buffers past CUDA's registration limit (hundreds of GiB): the "
        "worker machine pins 0.34.0's buffer, on a machine of a few GiB",
    ),
]


def select(only: str | None) -> list[HistoricalBug]:
    """The bugs ``only`` names, by row (``S1,S9``) or by id (``no-final-flush``), every one
    when None."""
    if not only:
        return BUGS
    wanted = [part.strip() for part in only.split(",") if part.strip()]
    known = {b.id: b for b in BUGS}
    by_id = {b.bug: b.id for b in BUGS}
    wanted = [by_id.get(canonical(w), w) for w in wanted]
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        raise ConfigError(f"unknown bugs {unknown or [only]}; known: {', '.join(known)}")
    return [known[w] for w in dict.fromkeys(wanted)]
