"""Named programs of driver calls, each with the configuration it runs under."""

from __future__ import annotations

from kvoffload.model import OffloadConfig
from kvoffload.testing.lockstep import Call

from helpers import config as cfg
from helpers import prompt

P33, P40, P64 = prompt(33), prompt(40), prompt(64)
STORE_THEN_EVICT: list[Call] = [
    ("add", "a", P40, 1),
    ("step", 64),
    ("step", 0),
    ("drain",),
    ("add", "filler", prompt(64, 5), 1),
    ("step", 64),
    ("step", 0),
    ("drain",),
    ("add", "b", P40, 1),
    ("step", 64),
]

SCENARIOS: dict[str, tuple[OffloadConfig, list[Call]]] = {
    "final-flush-33": (
        cfg(),
        [("add", "r", P33, 1), ("step", 64), ("step", 0), ("drain",), ("lookup", P33)],
    ),
    "chunks-decode-secondary-keys": (
        cfg(16, 12, (4,), 2),
        [
            ("add", "r", prompt(10), 3),
            *[("step", 4)] * 5,
            ("step", 0),
            ("drain",),
            ("lookup", prompt(10)),
        ],
    ),
    # The same with kv-cache events: a stored event for each key the stores register, the
    # secondary (hash-block) keys of the decode's blocks too.
    "secondary-keys-announced": (
        cfg(16, 12, (4,), 2, kv_events=True),
        [
            ("add", "r", prompt(10), 3),
            *[("step", 4)] * 5,
            ("step", 0),
            ("drain",),
            ("lookup", prompt(10)),
        ],
    ),
    "load-after-gpu-eviction": (
        cfg(5),
        [*STORE_THEN_EVICT, ("lookup", P40), ("drain",), ("step", 64), ("step", 0), ("drain",)],
    ),
    "finish-during-load": (cfg(5), [*STORE_THEN_EVICT, ("finish", "b"), ("drain",)]),
    "reset-during-load": (
        cfg(5),
        [*STORE_THEN_EVICT, ("reset",), ("drain",), ("step", 64), ("reset",)],
    ),
    "capacity-retry": (
        cfg(cpu_blocks=3),
        [
            ("add", "r", P64, 8),
            *[("step", 16)] * 4,
            ("drain",),
            ("step", 16),
            ("step", 16),
            ("finish", "r"),
            ("step", 0),
            ("drain",),
        ],
    ),
    "final-flush-capacity": (
        cfg(cpu_blocks=3),
        [("add", "r", prompt(65), 1), ("step", 80), ("step", 0), ("drain",)],
    ),
    "two-workers-report-apart": (
        cfg(world_size=2),
        [
            ("add", "r", P33, 1),
            ("step", 64),
            ("step", 0),
            ("store", 0, 1),
            ("step", 8),
            ("store", 0, 0),
            ("lookup", P33),
        ],
    ),
    "reset-releases-queued-flush": (
        cfg(),
        [("add", "r", P33, 1), ("step", 64), ("reset",), ("step", 0), ("drain",), ("lookup", P33)],
    ),
    "reset-abandons-store": (
        cfg(),
        [
            ("add", "r", P33, 1),
            ("step", 64),
            ("step", 0),
            ("reset",),
            ("drain",),
            ("lookup", P33),
            ("reset",),
        ],
    ),
    "shared-prefix-in-flight": (
        cfg(group_block_sizes=(4,)),
        [
            ("add", "a", prompt(8), 5),
            ("step", 8),
            ("add", "b", prompt(8), 2),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
        ],
    ),
    "failed-allocation-keeps-lookup-pin": (
        cfg(5),
        [
            ("add", "a", P40, 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("add", "hog", prompt(48, 5), 10),
            ("step", 64),
            ("add", "b", P40, 1),
            ("step", 2),
            ("step", 2),
            ("drain",),
            ("step", 2),
            ("finish", "b"),
            ("finish", "hog"),
            ("step", 0),
            ("drain",),
        ],
    ),
    # b's GPU hit stops one block short of its 32-token prompt (the last token is always
    # recomputed), so b computes its own copy of a's second block, whose key a has already
    # stored: b's final flush must skip it.
    "final-flush-skips-present": (
        cfg(),
        [
            ("add", "a", prompt(32), 5),
            ("step", 64),
            ("step", 8),
            ("drain",),
            ("add", "b", prompt(32), 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("lookup", prompt(33)),
        ],
    ),
    "two-groups": (
        cfg(16, 16, (4, 8), 4),
        [
            ("add", "r", prompt(17), 1),
            ("step", 32),
            ("step", 0),
            ("drain",),
            ("lookup", prompt(17)),
            ("lookup", prompt(13)),
        ],
    ),
    # The integrity contract: the second block of a stored prompt damaged, then looked up.
    "damaged-block-passed-over": (
        cfg(8, 16),
        [
            ("add", "a", P40, 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("corrupt", 2, 0),
            ("lookup", P40),
        ],
    ),
    "failed-store-dropped": (
        cfg(8, 16, world_size=2),
        [
            ("add", "a", P40, 1),
            ("step", 64),
            ("step", 0),
            ("fail_store", 0, 1),
            ("store", 0, 0),
            ("lookup", P40),
        ],
    ),
    # Bad input: a worker's report delivered twice, a request longer than the GPU pool.
    "report-delivered-twice": (
        cfg(8, 16, world_size=2),
        [("add", "a", P40, 1), ("step", 64), ("step", 0), ("store", 0, 0), ("store", 0, 0)],
    ),
    "request-longer-than-gpu-pool": (cfg(4, 16), [("add", "a", P64, 1), ("step", 64)]),
    # A request that skips reading the prefix cache (prompt logprobs): its prompt is on the
    # CPU only, then on the GPU too; it is computed whole both times, and stored as usual.
    "skip-reading-after-eviction": (
        cfg(5),
        [*STORE_THEN_EVICT[:-2], ("add", "b", P40, 1, True), ("step", 64), ("step", 0)],
    ),
    # Lazy mode: a prompt computed and finished, its blocks stored from the GPU queue's
    # eviction end and returned there; a second prompt takes them; the first comes back
    # from the CPU.
    "lazy-store-return-and-load": (
        cfg(6, 8, lazy=True),
        [
            ("add", "a", P40, 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("add", "b", prompt(64, 5), 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("add", "c", P40, 1),
            ("step", 64),
            ("drain",),
            ("step", 64),
        ],
    ),
    # A prompt stored on the CPU and finished: a prefix-cache reset without the connector's
    # clears the GPU but reports failure, since the CPU still serves the prompt (#57727);
    # with the connector's reset both tiers are cleared and it reports success.
    "prefix-reset-keeps-cpu": (
        cfg(),
        [
            ("add", "r", P33, 1),
            ("step", 64),
            ("step", 0),
            ("drain",),
            ("reset_prefix_cache", False),
            ("lookup", P33),
            ("reset_prefix_cache", True),
            ("lookup", P33),
        ],
    ),
    # Stats drained as a metrics logger does: the CPU blocks of a store in flight are
    # pending, and stay pending once a reset abandons it, until its copy completes.
    "stats-across-reset": (
        cfg(),
        [
            ("add", "r", P33, 1),
            ("step", 64),
            ("step", 0),
            ("stats",),
            ("reset",),
            ("stats",),
            ("drain",),
            ("stats",),
        ],
    ),
    # A prompt stored, evicted from the GPU and loaded back: the first drain after the
    # load counts its blocks, the next one counts nothing.
    "stats-count-a-load-once": (
        cfg(5),
        [*STORE_THEN_EVICT, ("stats",), ("drain",), ("stats",), ("stats",)],
    ),
    # Lazy mode: blocks stored and returned to the front of the GPU queue, then their CPU
    # copies evicted by later stores into a small CPU pool: the next scan must store them
    # again, though they lie before the block the previous scan visited last (found by the
    # machine: S27's class).
    "lazy-scan-after-cpu-eviction": (
        cfg(8, 3, (4,), lazy=True),
        [
            ("add", "r0", [0, 1, 2, 3], 2),
            ("add", "r1", [0, 1, 2, 3], 2),
            ("add", "r3", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 1),
            ("step", 9),
            ("step", 9),
            ("step", 9),
            ("drain",),
            ("step", 9),
            ("drain",),
            ("step", 9),
        ],
    ),
    # Lazy mode: a block stored and returned to the front of the GPU queue, then the CPU
    # cache cleared by a reset: the next scan stores it again, and a repeat loads it.
    "lazy-scan-after-reset": (
        cfg(4, 2, (4,), lazy=True),
        [
            ("add", "r0", [0, 1, 2, 3], 2),
            ("add", "r1", [0, 1, 2, 3], 1),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("reset",),
            ("step", 0),
            ("drain",),
            ("add", "r2", [0, 1, 2, 3, 0], 1),
            ("step", 8),
            ("drain",),
            ("step", 8),
        ],
    ),
    # A prompt stored by the eager scan while its request decodes, then asked for again by a
    # request that skips reading the prefix cache (S12): neither tier may serve it.
    "skip-reading-stored-prompt": (
        cfg(4, 12, (4,), 4),
        [
            ("add", "r0", list(range(9)), 3),
            ("step", 16),
            ("step", 16),
            ("drain",),
            ("step", 16),
            ("step", 16),
            ("drain",),
            ("add", "r1", list(range(9)), 1, True),
            ("step", 16),
            ("step", 16),
            ("drain",),
        ],
    ),
    "skip-reading-on-gpu-hit": (
        cfg(),
        [("add", "a", P40, 4), ("step", 64), ("add", "b", P40, 1, True), ("step", 64)],
    ),
    # A sliding-window group (window 3, blocks of 4) beside full attention (blocks of 8):
    # one 10-token step computes both window blocks, the next allocation frees the first
    # (it left the window) and the scan, reading the confirmed blocks, stores it from the GPU
    # prefix cache where it is still cached (found by the machine: S14's class).
    "window-block-recovered": (
        cfg(6, 3, (8, 4), 4, sliding_windows=(None, 3)),
        [("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], 1), ("step", 10)],
    ),
    # The same layout: the window group's first block gets no key (no hit can end on it), and
    # the scan passes over it to store the second (found by the machine: S3's class).
    "window-scan-passes-unkeyed": (
        cfg(5, 12, (8, 4), 4, sliding_windows=(None, 3)),
        [("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 2), ("step", 8), ("step", 8)],
    ),
    # A window of 6 over blocks of 4 (a hit needs two window blocks): a prompt stored to
    # the CPU, evicted from the GPU by another (computed in chunks: the window frees its
    # blocks as it goes), comes back and loads the full-attention blocks and the window's
    # last two, with nulls before them.
    "window-hit-loads-run": (
        cfg(12, 16, (4, 4), 4, sliding_windows=(None, 6)),
        [
            ("add", "a", prompt(16), 1),
            ("step", 16),
            ("step", 0),
            ("drain",),
            ("add", "b", prompt(24, 3), 1),
            ("step", 8),
            ("step", 8),
            ("step", 8),
            ("step", 0),
            ("drain",),
            ("add", "c", [*prompt(16), 1], 1),
            ("step", 32),
            ("drain",),
            ("step", 32),
            ("drain",),
            ("step", 32),
        ],
    ),
    # Decode context parallelism over two ranks: a block of 4 tokens is 2 on each rank. The
    # scan of the second step may reach the first block only (4 confirmed tokens); counted in
    # per-rank blocks it reaches the second too, not computed yet and without a key, and
    # passes over it for good (found by the machine in vLLM 0.24.0: S6). The finish then
    # flushes it only where the cursor did not pass it.
    "dcp-scan-reaches-confirmed-only": (
        cfg(4, 4, (4,), 4, 2, attention_chunks=(), dcp_world_size=2),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0], 1),
            ("step", 4),
            ("drain",),
            ("step", 4),
            ("drain",),
            ("step", 0),
            ("drain",),
            ("lookup", [0, 1, 2, 3, 4, 5, 6, 0, 1]),
        ],
    ),
    # A chunked local group (chunks of 8 tokens, blocks of 4) beside full attention (found by
    # the machine in vLLM 0.32.0: S24). A prompt stored to the CPU, the GPU's prefix cache
    # reset, its first block computed again on its own: the prompt then hits the GPU for 4
    # tokens, inside the first chunk, and no CPU hit may follow. Up to 0.32.0 one does, and
    # its load writes the chunked group's block into the null block the table holds for the
    # chunk already left.
    # A Mamba group (align mode) beside full attention: a prompt of 12 tokens computed in
    # chunks of 8 and 4 hands off its states at 8 and 12, which are stored; the GPU's prefix
    # cache reset, the prompt with one more token loads 12 tokens from the CPU (the Mamba
    # state at 12, nulls before it). When the load completes, the loaded state is cached
    # and handed off again, and skipped: the CPU holds its key.
    "mamba-state-handoff-and-load": (
        cfg(12, 12, (4, 4), 4, mamba=(False, True)),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 1),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
            ("step", 0),  # sends the final flush
            ("drain",),
            ("stats",),
            ("reset_prefix_cache", False),
            ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 1], 1),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
            ("stats",),
        ],
    ),
    # Two requests with one prompt admitted together: the second's Mamba hit is the state
    # the first keys in this very step, so it waits a step (tests/test_mamba.py).
    "mamba-hit-cached-this-step": (
        cfg(16, 16, (4, 4), 4, mamba=(False, True)),
        [
            ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
            ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
            ("step", 32),
            ("step", 32),
            ("drain",),
        ],
    ),
    # Full attention caches 12 tokens of b's prompt, Mamba only 8: b's first chunk stops at
    # the junction, 12 (tests/test_mamba.py).
    "mamba-chunk-stops-at-junction": (
        cfg(16, 16, (4, 4), 4, mamba=(False, True)),
        [
            ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2], 1),
            *[("step", 8), ("drain",)] * 3,
            ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9], 1),
            ("step", 8),
            ("step", 8),
            ("drain",),
        ],
    ),
    "chunk-hit-after-unaligned-prefix": (
        cfg(10, 12, (4, 4), 4, attention_chunks=(None, 8)),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 0], 2),
            *[("step", 8), ("drain",)] * 3,
            ("reset_prefix_cache", False),
            ("add", "r1", [0, 1, 2, 3], 1),
            ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 0, 0], 1),
            *[("step", 8), ("drain",)],
            ("step", 8),
        ],
    ),
    # The window group's first block (unkeyed: no hit ends there) leaves the window at the
    # second step, is freed and reused at once by the full-attention group for the prompt's
    # tail (a partial key); the scan's copy of the window table still names it at position
    # 0, and the third step's scan must pass over it (found by the machine: vLLM 0.34.0
    # stores it, with position 0's tokens in its BlockStored event).
    "window-block-reused": (
        cfg(5, 2, (8, 4), 4, sliding_windows=(None, 3)),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 2),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
        ],
    ),
    # Preemption (S20 of docs/history.md): two prompts of two blocks each in a pool of three,
    # prefilled three tokens a step. r0's second chunk needs a block r1 took: r1 is preempted
    # (blocks freed, computed tokens 0) and resumes as a new request once r0 has finished,
    # with its whole new table; the connector's copy of its table starts over with it.
    "preempt-and-resume": (
        cfg(4, 2, (4,)),
        [
            ("add", "r0", [0, 1, 2, 3, 4], 3),
            ("add", "r1", [5, 6, 0, 1, 2], 3),
            ("step", 3),
            ("step", 3),
            ("step", 3),
            ("step", 3),
            ("drain",),
            ("step", 8),
            ("step", 8),
            ("step", 8),
            ("step", 8),
            ("drain",),
            ("lookup", [5, 6, 0, 1, 2]),
        ],
    ),
    # Fine-grained hits (Mamba blocks of 8 hashed in blocks of 4, beside full attention of 8).
    # A prompt of 5 tokens registers its tail at 4 inside its first full-attention block; it
    # finishes in the step that computes it, the block not full: its final flush stores the
    # tail's block, which the CPU then holds under the key of 4 tokens (vLLM 0.30.0 on, S13).
    "fine-grained-tail-at-finish": (
        cfg(8, 2, (8, 8), 4, mamba=(False, True)),
        [
            ("add", "r0", [0, 1, 2, 3], 2),
            ("add", "r1", [0, 1, 2, 3, 0], 1),
            ("step", 8),
            ("drain",),
            ("stats",),
            ("step", 8),
            ("drain",),
        ],
    ),
    # The same layout. r1's prompt of 8 tokens ends on a hash boundary: its tail is the
    # boundary before its last token, 4, registered on the block it shares with r0's longer
    # prompt as a secondary key. That block is on the CPU already, without the key of 4: r1's
    # final flush stores the block again for its tail. vLLM 0.33.0 looks for the tail at 8, a
    # block boundary, and stores nothing (S28, found by the machine).
    "fine-grained-tail-of-shared-block": (
        cfg(8, 3, (8, 8), 4, mamba=(False, True)),
        [
            ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], 1),
            ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0], 1),
            ("step", 8),
            ("drain",),
            ("stats",),
            ("step", 8),
            ("drain",),
            ("stats",),
            ("step", 8),
            ("drain",),
        ],
    ),
    # The same layout. r1's tail at 4 is inside its first block, which decoding fills: the
    # final flush's scan selects the block, and the tail lookup finds the same block, which is
    # stored once (vLLM 0.34.0's guard against two CPU blocks for one GPU block).
    "fine-grained-tail-filled-by-decode": (
        cfg(8, 12, (8, 8), 4, mamba=(False, True)),
        [
            ("add", "r0", [0, 1, 2, 3], 2),
            ("add", "r1", [0, 1, 2, 3, 0, 0], 3),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
            ("step", 8),
            ("drain",),
        ],
    ),
}
