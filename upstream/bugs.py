"""The history of vLLM's SimpleCPUOffload bugs: the 29 fixed upstream between vLLM 0.19.0
and 0.34.0, each with the last release that has it and the first with its fix, as read from
the shipped wheels (release against release diffs of the connector and the block pool).

For a bug in the model's reach, ``isolation`` is the model the last buggy release is
compared with: the model of the first release with the fix, in which that release's *other*
bugs are modelled (a composed variant of :mod:`kvoffload.model.variants`), so that the first
difference can only be this bug; ``finds`` is what that difference must name (words of its
description: a snapshot field, a result); ``fixed_variant`` is the model the fixed release
conforms to; ``method`` says how the bug was isolated. A bug out of reach says what the
machine lacks to reach it (``out_of_reach``).

Invariants: ids are unique and in order; a bug is either in reach, with every field of its
checks, or out of reach with the reason; its last buggy release comes before its fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.model.errors import ConfigError
from kvoffload.vllm_target.releases import Check


@dataclass(frozen=True)
class HistoricalBug:
    id: str
    ref: str
    title: str
    buggy: str  # the last release with the bug
    fixed: str  # the first release with its fix
    isolation: str | None = None  # the model the buggy release is compared with
    fixed_variant: str | None = None  # the model the fixed release conforms to
    finds: str | None = None  # what the first difference must name (``a|b``: either)
    method: str = ""  # how the bug is isolated from the buggy release's other bugs
    out_of_reach: str | None = None  # why the machine cannot reach it yet

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
_S10 = "bug-53498-primary-only"
_S9 = "bug-53498-no-final-flush"
_S12 = "serves-skip-reading"
_S14 = "window-no-recover"
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
        "S1",
        "#39702, PR #42289",
        "CPU hits not pinned between lookup and allocation (TOCTOU)",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+step-dedup+scan-breaks-unhashed",
        "vllm-0.23",
        "pending_hits",
        "0.21.0's other bug (S2) and its scan's stop at an unkeyed block modelled",
    ),
    HistoricalBug(
        "S2",
        "PR #41289",
        "in-flight stores deduplicated within a step only: a block stored twice",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+no-hit-pins+scan-breaks-unhashed",
        "vllm-0.23",
        "in_flight_gpu_blocks",
        "0.21.0's other bug (S1) and its scan's stop at an unkeyed block modelled",
    ),
    HistoricalBug(
        "S3",
        "PR #42296",
        "scheduler vs hash block size; masked sliding-window blocks",
        "0.21.0",
        "0.22.0",
        out_of_reach="sliding-window groups of another block size",
    ),
    HistoricalBug(
        "S4",
        "#45704, PR #46278",
        "store copy not fenced after the step's compute",
        "0.23.0",
        "0.24.0",
        out_of_reach="the worker's copy streams (a GPU target); the implementation has it "
        "as the fault store-skips-compute-wait",
    ),
    HistoricalBug(
        "S5",
        "PR ?",
        "load_event_to_reqs handed to the metadata by reference",
        "0.23.0",
        "0.24.0",
        out_of_reach="a worker reading the metadata after the scheduler changed it (the "
        "adapter reads it when it is built)",
    ),
    HistoricalBug(
        "S6",
        "PR #46394",
        "DCP/PCP global-token conversions",
        "0.24.0",
        "0.25.0",
        "vllm-0.29",
        "vllm-0.29",
        "tracked|loads",
        "0.24.0's other bugs (those of 0.29.0's model) modelled",
    ),
    HistoricalBug(
        "S7",
        "PR ?",
        "PCP no longer scales block sizes",
        "0.25.1",
        "0.26.0",
        out_of_reach="prefill context parallelism (PCP); DCP alone is modelled",
    ),
    HistoricalBug(
        "S8",
        "PR #49071",
        "EAGLE mode not propagated to the CPU lookup",
        "0.26.0",
        "0.27.0",
        out_of_reach="speculative decoding",
    ),
    HistoricalBug(
        "S9",
        "#53498 (bug 2), PR #53532",
        "no final flush at request finish",
        "0.29.0",
        "0.30.0",
        f"{_S10}+{_S12}+{_S14}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        "pending_flushes",
        "0.29.0's registration (S10), CPU hits for requests that skip reading (S12), "
        "window scan (S14) and selection loop modelled",
    ),
    HistoricalBug(
        "S10",
        "#53498 (bug 1), PR #53532",
        "stores registered without _insert_block_hash: stamped primary, no secondary keys",
        "0.29.0",
        "0.30.0",
        f"{_S9}+{_S12}+{_S14}+selection-0.29+{_LIVE}+{_S20}",
        f"{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        "snapshots differ in ['cpu']",
        "0.29.0's missing final flush (S9), CPU hits for requests that skip reading (S12), "
        "window scan (S14) and selection loop modelled",
    ),
    HistoricalBug(
        "S11",
        "PR #54325",
        "BlockStored events of the CPU tier",
        "0.29.0",
        "0.30.0",
        out_of_reach="0.29.0's kv-cache events (the machine compares events from 0.30.0 on; no "
        "variant models the earlier ones yet)",
    ),
    HistoricalBug(
        "S12",
        "PR #54998",
        "skip_reading_prefix_cache not respected: a CPU hit served to a prompt-logprobs request",
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
        "S13",
        "PR #54736",
        "fine-grained hybrid hits, FA partial tail at finish",
        "0.29.0",
        "0.30.0",
        out_of_reach="fine-grained partial hits (a Mamba group larger than the hash block) "
        "and 0.29.0's positional scan of Mamba tables",
    ),
    HistoricalBug(
        "S14",
        "PR ?",
        "sliding-window retained tail nulled in the block table, never stored",
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
        "S15",
        "PR ?",
        "DCP scales only full-attention groups",
        "0.29.0",
        "0.30.0",
        out_of_reach="DCP/PCP with hybrid groups",
    ),
    HistoricalBug(
        "S16",
        "PR #56621",
        "CPU stores on steps without a forward pass",
        "0.29.0",
        "0.30.0",
        out_of_reach="the worker's no-forward steps (a GPU target)",
    ),
    HistoricalBug(
        "S17",
        "PR ?",
        "per-tensor block regions for mixed page sizes",
        "0.29.0",
        "0.30.0",
        out_of_reach="the worker's KV layouts (a GPU target)",
    ),
    HistoricalBug(
        "S18",
        "PR ?",
        "disk backend DMA events",
        "0.29.0",
        "0.30.0",
        out_of_reach="the disk backend (a GPU target)",
    ),
    HistoricalBug(
        "S19",
        "PR #55033",
        "non-prefix-cacheable groups skipped",
        "0.30.0",
        "0.31.0",
        out_of_reach="special hybrid groups and lazy mode",
    ),
    HistoricalBug(
        "S20",
        "PR #57816",
        "eager-store placement reset on preemption (MRV2)",
        "0.31.0",
        "0.32.0",
        f"{_LAZY}+{_LIVE}+{_S24}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S24}",
        "tracked",
        "0.31.0's lazy mode (S26, S27) and reset (S21) modelled",
    ),
    HistoricalBug(
        "S21",
        "PR ?",
        "reset() keeps the pins of CPU hits not yet allocated",
        "0.31.0",
        "0.32.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S20}+{_S24}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S24}",
        "pending_hits",
        "0.31.0's lazy mode (S26, S27) and resumption (S20) modelled",
    ),
    HistoricalBug(
        "S22",
        "PR ?",
        "cacheable prefix from the coordinator",
        "0.31.0",
        "0.32.0",
        out_of_reach="hybrid retention intervals and hash lookahead",
    ),
    HistoricalBug(
        "S23",
        "#50821, PR #52921",
        "CPU pool size across PP and draft workers",
        "0.32.0",
        "0.33.0",
        out_of_reach="workers with different KV layouts (a GPU target)",
    ),
    HistoricalBug(
        "S24",
        "PR ?",
        "chunked-local hits start on a chunk boundary",
        "0.32.0",
        "0.33.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}",
        f"reset-releases-hits+{_LAZY}+{_LIVE}+{_S28}",
        "model returned StepResult",
        "0.32.0's lazy mode (S26, S27) modelled",
    ),
    HistoricalBug(
        "S25",
        "#39972",
        "CPU copy of a GPU-hot prefix never refreshed in the CPU LRU",
        "0.33.0",
        "0.34.0",
        f"inclusive-cpu+{_LAZY}+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "cpu: free queue",
        "0.33.0's lazy mode (S26, S27) and final flush's prompt tail (S28) modelled",
    ),
    HistoricalBug(
        "S26",
        "#40332",
        "lazy mode returns offloaded blocks to the MRU end",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+lazy-cursor+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "gpu: free queue",
        "0.33.0's scan cursor (S27) modelled, and its eager mode (without S25's refresh, "
        "with S28's prompt tail)",
    ),
    HistoricalBug(
        "S27",
        "PR ?",
        "lazy mode's stale scan cursor: blocks behind it never stored",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+lazy-tail+{_LIVE}+{_S28}",
        f"inclusive-cpu+{_LIVE}",
        "model returned StepResult",
        "0.33.0's return of lazy stores to the tail (S26) modelled, and its eager mode "
        "(without S25's refresh, with S28's prompt tail)",
    ),
    HistoricalBug(
        "S28",
        "PR ?",
        "the final flush looks for the FA prompt tail at the prompt's end, not where the GPU "
        "keys it (before the last token): a prompt ending on a hash boundary leaves it behind",
        "0.33.0",
        "0.34.0",
        f"reset-releases-hits+{_LAZY}+{_LIVE}",
        f"inclusive-cpu+{_LIVE}",
        "pending_flushes",
        "0.33.0's lazy mode (S26, S27) modelled, and its eager mode (without S25's refresh)",
    ),
    HistoricalBug(
        "S29",
        "PR ?",
        "host buffer pinned in bounded chunks",
        "0.33.0",
        "0.34.0",
        out_of_reach="the worker's host buffers (a GPU target)",
    ),
]


def select(only: str | None) -> list[HistoricalBug]:
    """The bugs ``only`` names (``S1,S9``), every one when None."""
    if not only:
        return BUGS
    wanted = [part.strip() for part in only.split(",") if part.strip()]
    known = {b.id: b for b in BUGS}
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        raise ConfigError(f"unknown bugs {unknown or [only]}; known: {', '.join(known)}")
    return [known[w] for w in dict.fromkeys(wanted)]
