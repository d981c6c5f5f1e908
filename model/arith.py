"""The pure arithmetic and selection rules of the offload scheduler, with contracts.

The model calls these helpers, and ``crosshair check --analysis_kind=PEP316`` checks their
``pre:``/``post:`` conditions symbolically (``tests/test_contracts.py``). Each is a rule
vLLM applies inline; here it has one definition and a stated contract.
"""

from __future__ import annotations


def align_down(tokens: int, alignment: int) -> int:
    """The largest multiple of ``alignment`` not above ``tokens``.

    pre: tokens >= 0
    pre: alignment > 0
    post: 0 <= __return__ <= tokens
    post: __return__ % alignment == 0
    post: tokens - __return__ < alignment
    """
    return tokens // alignment * alignment


def ready_blocks(
    num_computed: int, scheduler_block_size: int, group_block_size: int, table_len: int
) -> int:
    """How many of a group's blocks ``num_computed`` confirmed tokens fill completely, counted
    at the scheduler's alignment and capped at the block table's length.

    pre: num_computed >= 0 and table_len >= 0
    pre: scheduler_block_size > 0 and group_block_size > 0
    pre: scheduler_block_size % group_block_size == 0
    post: 0 <= __return__ <= table_len
    post: __return__ * group_block_size <= num_computed
    """
    return min(table_len, align_down(num_computed, scheduler_block_size) // group_block_size)


def lookup_limit(num_tokens: int, num_computed: int) -> int:
    """The most tokens a lookup may hit: the last token is always recomputed.

    pre: 0 <= num_computed <= num_tokens
    post: num_computed + __return__ < num_tokens
    """
    return num_tokens - 1 - num_computed


def plan_selection(
    storable: list[list[bool]], num_free: int
) -> tuple[list[list[int]], list[int], bool]:
    """The eager store selection over each group's candidates (from its cursor to its
    confirmed blocks): the positions to store, how far each cursor advances, and whether
    the CPU pool ran out. A candidate that may not be stored is passed over; a storable one
    is taken while the CPU pool has room; at the first one without room, the selection
    stops, and that block is retried later (or dropped, at the final flush).

    pre: num_free >= 0
    post: sum(len(picks) for picks in __return__[0]) <= num_free
    post: len(__return__[0]) == len(storable) == len(__return__[1])
    post: all(0 <= __return__[1][g] <= len(storable[g]) for g in range(len(storable)))
    post: _picks_are_storable_and_reached(storable, __return__[0], __return__[1])
    post: _reached_storable_are_picked(storable, __return__[0], __return__[1])
    post: __return__[2] or all(__return__[1][g] == len(storable[g]) for g in range(len(storable)))
    """
    picks: list[list[int]] = [[] for _ in storable]
    advanced = [0] * len(storable)
    taken = 0
    for g, flags in enumerate(storable):
        if taken >= num_free:
            return picks, advanced, True
        for i, ok in enumerate(flags):
            if ok:
                if taken >= num_free:
                    return picks, advanced, True
                picks[g].append(i)
                taken += 1
            advanced[g] += 1
    return picks, advanced, False


def _picks_are_storable_and_reached(
    storable: list[list[bool]], picks: list[list[int]], advanced: list[int]
) -> bool:
    return all(storable[g][i] and i < advanced[g] for g, ps in enumerate(picks) for i in ps)


def _reached_storable_are_picked(
    storable: list[list[bool]], picks: list[list[int]], advanced: list[int]
) -> bool:
    return all(
        i in picks[g] for g, flags in enumerate(storable) for i in range(advanced[g]) if flags[i]
    )


def window_run(window: int, block_size: int) -> int:
    """How many cached blocks a sliding-window hit must end with: those holding the
    ``window - 1`` tokens a token right after the hit attends to.

    pre: window > 0 and block_size > 0
    post: __return__ * block_size >= window - 1
    post: __return__ == 0 or (__return__ - 1) * block_size < window - 1
    """
    return -(-(window - 1) // block_size)


def window_skipped_tokens(num_computed: int, window: int) -> int:
    """How many leading tokens of a sliding-window group no later token attends to, once
    ``num_computed`` tokens are computed (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``):
    a token attends to the ``window - 1`` tokens before it.

    pre: num_computed >= 0 and window > 0
    post: 0 <= __return__ <= num_computed
    post: __return__ == 0 or num_computed - __return__ == window - 1
    """
    return max(0, num_computed - window + 1)


def chunk_skipped_tokens(num_computed: int, chunk: int) -> int:
    """How many leading tokens of a chunked local attention group no later token attends
    to, once ``num_computed`` tokens are computed (vLLM's
    ``ChunkedLocalAttentionManager.get_num_skipped_tokens``): the next token attends to its
    own chunk only, so every chunk before it is skipped.

    pre: num_computed >= 0 and chunk > 0
    post: 0 <= __return__ <= num_computed
    post: __return__ % chunk == 0
    post: num_computed - __return__ < chunk
    """
    return num_computed // chunk * chunk


def reachable(index: int, window: int, block_size: int, scheduler_block_size: int) -> bool:
    """Whether block ``index`` of a sliding-window group gets a key: a hit ends on a
    scheduler-block boundary with ``window_run`` cached blocks, so when that run is shorter
    than a scheduler block only its last ``window_run`` blocks can serve one (vLLM 0.34.0's
    ``reachable_block_mask``); otherwise every block can.

    pre: index >= 0 and window > 0 and block_size > 0
    pre: scheduler_block_size % block_size == 0
    post: __return__ or (index + 1) * block_size % scheduler_block_size != 0 or window == 1
    """
    per_segment = scheduler_block_size // block_size
    run = window_run(window, block_size)
    return run >= per_segment or index % per_segment >= per_segment - run


def mamba_chunk(
    start: int,
    num_new: int,
    prefill_end: int,
    num_tokens: int,
    block_size: int,
    junction: int,
) -> int:
    """How many of ``num_new`` tokens from ``start`` a prefill chunk of a model with an
    align-mode Mamba group computes (vLLM's ``_mamba_block_aligned_split``, without
    speculative decoding, prefill checkpoints or fine-grained hits): a state is written
    where a chunk ends, so a chunk before the prompt's last ends on a block boundary; it
    stops at the next boundary when it starts inside a block, at the last boundary before
    the last token, and at the block-floored ``junction`` (a prefix another group caches
    past the common hit) when it crosses it. Decode steps are not split.

    pre: 0 <= start and 0 <= num_new and block_size > 0 and junction >= 0
    post: 0 <= __return__ <= num_new
    post: _chunk_ends_aligned(start, __return__, prefill_end, block_size)
    """
    if start >= prefill_end:
        return num_new
    end = start + num_new
    if end < prefill_end:
        end = end // block_size * block_size
    stops = (
        (start // block_size + 1) * block_size if start % block_size else 0,
        max(0, (num_tokens - 1) // block_size * block_size),
        start + (junction - start) // block_size * block_size if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def _chunk_ends_aligned(start: int, num: int, prefill_end: int, block_size: int) -> bool:
    """An empty chunk, one that reaches the prefill's end, or one ending on a block boundary."""
    return num == 0 or start + num >= prefill_end or (start + num) % block_size == 0
