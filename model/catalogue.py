"""The bug catalogue: every bug the kit knows, under one id.

A bug has up to three forms, and each form is named by the bug's id:

- a variant of the model (:data:`kvoffload.model.variants.VARIANTS`), the spec with that bug;
- a fault of the implementation (:data:`kvoffload.impl.faults.FAULTS`), the same bug in
  real code, which the conformance machine must find;
- a row of vLLM's history (:data:`kvoffload.upstream.bugs.BUGS`, its ``S`` number here),
  the bug in the vLLM releases that shipped it, found again or out of reach.

``kvoffload catalogue`` prints which forms each bug has (docs/catalogue.md). The details of
a form (the invariant a fault breaks, how a variant reproduces a release, how the history
isolates a bug) stay with the form; this table holds what the forms share: the id, one line
of what goes wrong, and where it comes from.

Invariants kept (tests/test_catalogue.py): ids are unique and no id is an old name of
another; each history number S1 to S29 belongs to exactly one bug; every fault and every
variant that models a bug is named by an id of this table, and every history row by its
number; an old name (:data:`RENAMED`) maps to an id of the table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    id: str
    title: str  # what goes wrong, in one line
    ref: str  # where it comes from: vLLM's issue or PR (``PR ?``: not yet traced), or a contract
    history: str | None = None  # its row of vLLM's history (S1 to S29), if vLLM shipped it


BUGS: tuple[Bug, ...] = (
    Bug(
        "no-hit-pins",
        "CPU hits not pinned between lookup and allocation (TOCTOU)",
        "#39702, PR #42289",
        "S1",
    ),
    Bug(
        "step-dedup",
        "in-flight stores deduplicated within a step only: a block stored twice",
        "PR #41289",
        "S2",
    ),
    Bug(
        "scan-breaks-unhashed",
        "scheduler vs hash block size; masked sliding-window blocks",
        "PR #42296",
        "S3",
    ),
    Bug(
        "store-skips-compute-wait",
        "store copy not fenced after the step's compute",
        "#45704, PR #46278",
        "S4",
    ),
    Bug(
        "metadata-by-reference",
        "load_event_to_reqs handed to the metadata by reference",
        "PR ?",
        "S5",
    ),
    Bug("dcp-per-rank-blocks", "DCP/PCP global-token conversions", "PR #46394", "S6"),
    Bug("pcp-block-sizes", "PCP no longer scales block sizes", "PR ?", "S7"),
    Bug("eagle-lookup", "EAGLE mode not propagated to the CPU lookup", "PR #49071", "S8"),
    Bug("no-final-flush", "no final flush at request finish", "#53498 (bug 2), PR #53532", "S9"),
    Bug(
        "primary-only",
        "stores registered without _insert_block_hash: stamped primary, no secondary keys",
        "#53498 (bug 1), PR #53532",
        "S10",
    ),
    Bug("cpu-stored-events", "BlockStored events of the CPU tier", "PR #54325", "S11"),
    Bug(
        "serves-skip-reading",
        "skip_reading_prefix_cache not respected: a CPU hit served to a prompt-logprobs request",
        "PR #54998",
        "S12",
    ),
    Bug(
        "no-partial-tail",
        "fine-grained hybrid hits, FA partial tail at finish",
        "PR #54736",
        "S13",
    ),
    Bug(
        "window-tail-not-recovered",
        "sliding-window retained tail nulled in the block table, never stored",
        "PR ?",
        "S14",
    ),
    Bug("dcp-hybrid-groups", "DCP scales only full-attention groups", "PR ?", "S15"),
    Bug("no-forward-stores", "CPU stores on steps without a forward pass", "PR #56621", "S16"),
    Bug("mixed-page-sizes", "per-tensor block regions for mixed page sizes", "PR ?", "S17"),
    Bug("disk-dma-events", "disk backend DMA events", "PR ?", "S18"),
    Bug("uncacheable-groups", "non-prefix-cacheable groups skipped", "PR #55033", "S19"),
    Bug(
        "preempt-keeps-table",
        "eager-store placement reset on preemption (MRV2)",
        "PR #57816",
        "S20",
    ),
    Bug(
        "reset-keeps-hit-pins",
        "reset() keeps the pins of CPU hits not yet allocated",
        "PR ?",
        "S21",
    ),
    Bug("coordinator-prefix", "cacheable prefix from the coordinator", "PR ?", "S22"),
    Bug(
        "pool-size-across-workers",
        "CPU pool size across PP and draft workers",
        "#50821, PR #52921",
        "S23",
    ),
    Bug(
        "chunk-unaligned-hits",
        "chunked-local hits start on a chunk boundary",
        "PR ?",
        "S24",
    ),
    Bug(
        "cpu-lru-not-refreshed",
        "CPU copy of a GPU-hot prefix never refreshed in the CPU LRU",
        "#39972",
        "S25",
    ),
    Bug(
        "lazy-returns-to-tail",
        "lazy mode returns offloaded blocks to the MRU end",
        "#40332",
        "S26",
    ),
    Bug(
        "lazy-stale-cursor",
        "lazy mode's stale scan cursor: blocks behind it never stored",
        "PR ?",
        "S27",
    ),
    Bug(
        "tail-at-prompt-end",
        "the final flush looks for the FA prompt tail at the prompt's end, not where the GPU "
        "keys it (before the last token): a prompt ending on a hash boundary leaves it behind",
        "PR ?",
        "S28",
    ),
    Bug("host-buffer-chunks", "host buffer pinned in bounded chunks", "PR ?", "S29"),
    # Live in vLLM 0.34.0 (docs/upstream.md): no fix, so no history row yet.
    Bug(
        "window-stale-ids",
        "the store scan takes a sliding-window block freed and reused by another position",
        "vLLM 0.24.0 to 0.34.0, found by the machine",
    ),
    Bug(
        "reset-gpu-only",
        "a prefix-cache reset without the connector's reports success",
        "#57727",
    ),
    # #53498 as the issue describes it (0.29.0 itself registers as primary-only, S10).
    Bug(
        "phantom-primary",
        "CPU blocks stamped at allocation, so _insert_block_hash returns early on the primary",
        "#53498 (bug 1), PR #53532",
    ),
    # The bug classes of the fault catalogue beyond the history: what vLLM's code guards
    # against (its comments and PRs), and kvoffload's own contracts.
    Bug(
        "secondary-keys-not-copied",
        "a completed store registers the primary key only, not the secondary keys",
        "#53498, PR #53532",
    ),
    Bug(
        "secondary-keys-unannounced",
        "a completed store registers its secondary keys but publishes a stored event for the "
        "primary only",
        "kvoffload's event contract (the CPU tier's events, PR #54325)",
    ),
    Bug(
        "flush-stores-present",
        "a final flush stores blocks the CPU already holds",
        "PR #53532",
    ),
    Bug(
        "flush-ignores-capacity",
        "a final flush asks the CPU pool for more blocks than it has free",
        "PR #53532",
    ),
    Bug(
        "pending-ignores-flush",
        "has_pending_stores() ignores queued final flushes",
        "PR #53532",
    ),
    Bug("reset-leaks-flush", "unsubmitted final flushes survive reset()", "PR #53532"),
    Bug(
        "abandoned-store-registers",
        "a store abandoned at reset is registered when it completes",
        "PR #39726",
    ),
    Bug(
        "pin-dropped-early",
        "a store's source GPU blocks unpinned at submission, before the copy",
        "vLLM's eager store path",
    ),
    Bug(
        "partial-completions-dropped",
        "partial store completions across steps are not added up",
        "vLLM's _store_event_pending_counts",
    ),
    Bug(
        "handoff-stores-cached",
        "a boundary-state hand-off stored though the CPU holds its key",
        "kvoffload (Mamba hand-offs)",
    ),
    Bug(
        "tail-stored-twice",
        "the final flush stores the prompt tail's block twice in one store",
        "vLLM 0.34.0's partial_tail guard",
    ),
    Bug(
        "stats-pending-skips-abandoned",
        "the pending-store gauge leaves out stores a reset abandoned",
        "vLLM's get_stats()",
    ),
    Bug(
        "stats-load-count-kept",
        "the load count is kept across stats drains instead of restarted",
        "vLLM's get_stats()",
    ),
    Bug(
        "integrity-spot-check",
        "an integrity check of the first block of a hit only",
        "kvoffload's integrity contract",
    ),
    Bug(
        "failed-store-registers",
        "a store whose copy failed on a worker is registered",
        "kvoffload's failure contract",
    ),
    Bug(
        "duplicate-report-counted",
        "a worker's report delivered twice counted twice",
        "kvoffload's driver contract",
    ),
    Bug(
        "fit-counts-cpu-pool",
        "a request checked against the GPU and CPU pools together",
        "kvoffload's driver contract (vLLM's max_model_len)",
    ),
)

# Names the forms had before they shared the bug's id (issue 37), read from older commands
# and failure files; nothing writes them.
RENAMED: dict[str, str] = {
    "bug-53498-phantom-primary": "phantom-primary",
    "bug-53498-no-final-flush": "no-final-flush",
    "bug-53498-primary-only": "primary-only",
    "lazy-tail": "lazy-returns-to-tail",
    "lazy-cursor": "lazy-stale-cursor",
    "window-no-recover": "window-tail-not-recovered",
    "reset-reports-gpu-only": "reset-gpu-only",
    "lookup-pin-missing": "no-hit-pins",
    "window-scan-breaks": "scan-breaks-unhashed",
}

BY_ID: dict[str, Bug] = {b.id: b for b in BUGS}
BY_HISTORY: dict[str, Bug] = {b.history: b for b in BUGS if b.history is not None}


def canonical(name: str) -> str:
    """``name``, or the id it was renamed to."""
    return RENAMED.get(name, name)
