"""Configuration of an offloading setup, shared by the model and every implementation.

Invariants kept here (checked once, at construction):

- every size is a positive integer;
- ``hash_block_size`` divides every group's block size (vLLM resolves a group's block keys
  from the fine-grained chain, one key per ``block_size // hash_block_size`` hash blocks);
- the scheduler block size is the least common multiple of the group block sizes, so every
  group block size divides it;
- ``lazy`` and ``kv_events`` are bools;
- ``sliding_windows`` is empty (every group is full attention) or names, per group, a
  sliding window in tokens (a positive int) or None (full attention), and at least one group
  is full attention (vLLM's offload scheduler matches prefixes on a full-attention group);
- ``attention_chunks`` is empty or names, per group, the chunk size of a chunked local
  attention group (a positive multiple of its block size, the group's block size the scheduler
  block size, as vLLM's chunked-local lookup asserts) or None; no group has both a window and
  a chunk size;
- ``dcp_world_size`` (decode context parallelism) is a positive int dividing ``world_size``
  and every group's block size, and above 1 only when every group is full attention (vLLM
  0.34.0's coordinator asserts it of sliding-window and chunked local groups);
- ``mamba`` is empty or names, per group, whether it is a Mamba group in align mode (a bool);
  a Mamba group has no window and no chunk; its block size is the hash block size, or larger
  (vLLM then serves fine-grained hits, ``fine_grained_hits``), in which case every group is
  full attention or Mamba and every Mamba block is the scheduler block (what is modelled of
  fine-grained hits: docs/fine-grained.md);
- at least one group is full attention (vLLM's offload scheduler matches prefixes on one);
- every size is within its bound (:mod:`kvoffload.model.limits`): each pool at most
  ``MAX_BLOCKS`` blocks, each block size (the scheduler's too), the hash block size, each
  window and chunk at most ``MAX_BLOCK_TOKENS`` tokens, at most ``MAX_GROUPS`` groups,
  ``world_size`` and ``dcp_world_size`` at most ``MAX_WORLD_SIZE``; the bounds are checked
  before anything is computed from the sizes (the least common multiple, a window's blocks);
- every per-group field is a tuple copied once (a tuple subclass that iterates otherwise
  each time is read once: what is checked is what is kept), and every message that shows a
  value passed shows it through :func:`~kvoffload.model.limits.brief`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from kvoffload.model.arith import chunk_skipped_tokens, window_skipped_tokens
from kvoffload.model.errors import ConfigError
from kvoffload.model.limits import (
    MAX_BLOCK_TOKENS,
    MAX_BLOCKS,
    MAX_GROUPS,
    MAX_WORLD_SIZE,
    brief,
)

# The scheduler's token budget per step (vLLM's ``max_num_batched_tokens``), which sizes the
# lazy mode's scan; vLLM's world in the adapter is configured with the same.
MAX_NUM_BATCHED_TOKENS = 2048
# vLLM's lazy mode keeps twice the blocks one step can take free or offloaded.
LAZY_WATERMARK = 2


# The per-group fields: each a tuple, empty or of one entry per group.
_PER_GROUP = ("group_block_sizes", "sliding_windows", "attention_chunks", "mamba")


def _require_positive_int(name: str, value: object, maximum: int, bound: str) -> None:
    """``value`` is an int in ``[1, maximum]``; ``bound`` names the limit ``maximum`` is."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {brief(value)}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {brief(value)}")
    if value > maximum:
        raise ConfigError(f"{name} must be <= {maximum} ({bound}), got {brief(value)}")


@dataclass(frozen=True)
class OffloadConfig:
    """One engine with one GPU block pool, one CPU block pool and CPU offloading.

    ``gpu_blocks`` and ``cpu_blocks`` count every block of the pool, the null block 0
    included, so the usable capacity of each pool is one less. ``group_block_sizes`` holds
    one block size per full-attention KV group; the groups share both pools, as vLLM's
    groups share one ``BlockPool``. ``world_size`` is the number of workers that must
    report a store before it counts as complete. ``lazy``: offload lazily (each step, the
    cached blocks nearest eviction in the GPU free queue) instead of eagerly (each request's
    blocks as they are computed). ``sliding_windows``: per group, the sliding window of a
    sliding-window attention group (vLLM's ``SlidingWindowSpec``: a token attends to the
    ``window - 1`` tokens before it, so blocks wholly before that leave the request's block
    table), or None for full attention; empty when every group is full attention.
    ``attention_chunks``: per group, the chunk size of a chunked local attention group
    (vLLM's ``ChunkedLocalAttentionSpec``, Llama 4: a token attends to the tokens of its own
    chunk only, so the blocks of earlier chunks leave the table), or None.
    ``dcp_world_size``: decode context parallelism, the tensor-parallel ranks one block's
    tokens are spread over (vLLM's ``decode_context_parallel_size``): a full-attention group's
    block of ``block_size`` tokens is ``block_size // dcp_world_size`` tokens on each rank
    (vLLM's spec size, scaled back by ``resolve_dcp_kv_block_size``). Every size here is a
    block's tokens across the ranks, as vLLM's scheduler side counts them.
    ``kv_events``: the connector publishes kv-cache events of the CPU tier (vLLM's
    ``kv_events_config.enable_kv_cache_events``), drained by ``take_events()``.
    ``mamba``: per group, whether it is a Mamba group in vLLM's align mode (``MambaSpec``
    with ``mamba_cache_mode="align"``): a block holds the recurrent state after the tokens
    up to its end, so a request needs only its running state's block (and the one before,
    to copy from); the blocks of full states are cached, and handed to the connector as the
    scheduler caches them (boundary hand-offs), since they leave the table at once.
    """

    gpu_blocks: int
    cpu_blocks: int
    group_block_sizes: tuple[int, ...] = (16,)
    hash_block_size: int = 16
    world_size: int = 1
    lazy: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    kv_events: bool = False
    attention_chunks: tuple[int | None, ...] = ()
    dcp_world_size: int = 1
    mamba: tuple[bool, ...] = ()
    scheduler_block_size: int = field(init=False)

    def __post_init__(self) -> None:
        # The bounds first: nothing below is computed from a size past them.
        _require_positive_int("gpu_blocks", self.gpu_blocks, MAX_BLOCKS, "MAX_BLOCKS")
        _require_positive_int("cpu_blocks", self.cpu_blocks, MAX_BLOCKS, "MAX_BLOCKS")
        _require_positive_int(
            "hash_block_size", self.hash_block_size, MAX_BLOCK_TOKENS, "MAX_BLOCK_TOKENS"
        )
        _require_positive_int("world_size", self.world_size, MAX_WORLD_SIZE, "MAX_WORLD_SIZE")
        _require_positive_int(
            "dcp_world_size", self.dcp_world_size, MAX_WORLD_SIZE, "MAX_WORLD_SIZE"
        )
        if not isinstance(self.lazy, bool):
            raise ConfigError(f"lazy must be a bool, got {brief(self.lazy)}")
        if not isinstance(self.kv_events, bool):
            raise ConfigError(f"kv_events must be a bool, got {brief(self.kv_events)}")
        self._copy_per_group()
        sizes = self.group_block_sizes
        if not isinstance(sizes, tuple) or not sizes:
            raise ConfigError(f"group_block_sizes must be a non-empty tuple, got {brief(sizes)}")
        if len(sizes) > MAX_GROUPS:
            raise ConfigError(
                f"group_block_sizes names {len(sizes)} groups; at most {MAX_GROUPS} (MAX_GROUPS)"
            )
        for g, size in enumerate(sizes):
            _require_positive_int(
                f"group_block_sizes[{g}]", size, MAX_BLOCK_TOKENS, "MAX_BLOCK_TOKENS"
            )
            if size % self.hash_block_size != 0:
                raise ConfigError(
                    f"hash_block_size {self.hash_block_size} does not divide "
                    f"group {g}'s block size {size}"
                )
        self._check_windows()
        # At most MAX_GROUPS sizes of at most MAX_BLOCK_TOKENS each: a cheap lcm.
        scheduler_block_size = math.lcm(*sizes)
        if scheduler_block_size > MAX_BLOCK_TOKENS:
            raise ConfigError(
                f"the scheduler block size {scheduler_block_size} (the least common multiple "
                f"of group_block_sizes {sizes}) must be <= {MAX_BLOCK_TOKENS} (MAX_BLOCK_TOKENS)"
            )
        object.__setattr__(self, "scheduler_block_size", scheduler_block_size)
        self._check_chunks()
        self._check_mamba()
        if not any(self.full_attention(g) for g in range(self.num_groups)):
            raise ConfigError(
                "no full-attention group: the offload scheduler matches prefixes on one"
            )
        self._check_dcp()

    def _copy_per_group(self) -> None:
        """Each per-group field that is a tuple, replaced by a plain tuple of its items taken
        in one pass, so that the checks below and every later reader see the same items (a
        tuple subclass may iterate otherwise each time). No more than one past
        ``MAX_GROUPS`` items are taken, a copy cut there being refused as too many groups. A
        field that is no tuple is left for its check to refuse."""
        for name in _PER_GROUP:
            values = getattr(self, name)
            if isinstance(values, tuple) and type(values) is not tuple:
                object.__setattr__(self, name, tuple(itertools.islice(values, MAX_GROUPS + 1)))

    def _check_per_group(self, name: str) -> tuple[int | None, ...]:
        """``name`` (a field naming an int or None per group) is a tuple, empty or of one
        entry per group, each a positive int or None."""
        values = getattr(self, name)
        if not isinstance(values, tuple):
            raise ConfigError(f"{name} must be a tuple, got {brief(values)}")
        if values and len(values) != len(self.group_block_sizes):
            raise ConfigError(
                f"{name} names {len(values)} groups, group_block_sizes "
                f"{len(self.group_block_sizes)}"
            )
        for g, value in enumerate(values):
            if value is not None:
                _require_positive_int(f"{name}[{g}]", value, MAX_BLOCK_TOKENS, "MAX_BLOCK_TOKENS")
        return values

    def _check_windows(self) -> None:
        self._check_per_group("sliding_windows")

    def _check_chunks(self) -> None:
        chunks = self._check_per_group("attention_chunks")
        if not chunks:
            return
        for g, chunk in enumerate(chunks):
            if chunk is None:
                continue
            size = self.group_block_sizes[g]
            if self.window(g) is not None:
                raise ConfigError(f"group {g} has both a sliding window and an attention chunk")
            if chunk % size:
                raise ConfigError(
                    f"attention_chunks[{g}] = {chunk} is not a multiple of the group's block "
                    f"size {size}"
                )
            if size != self.scheduler_block_size:
                # vLLM's ChunkedLocalAttentionManager.find_longest_cache_hit asserts it.
                raise ConfigError(
                    f"chunked local group {g}'s block size {size} is not the scheduler block "
                    f"size {self.scheduler_block_size}"
                )

    def _check_mamba(self) -> None:
        mamba = self.mamba
        if not isinstance(mamba, tuple):
            raise ConfigError(f"mamba must be a tuple, got {brief(mamba)}")
        if mamba and len(mamba) != self.num_groups:
            raise ConfigError(
                f"mamba names {len(mamba)} groups, group_block_sizes {self.num_groups}"
            )
        for g, flag in enumerate(mamba):
            if not isinstance(flag, bool):
                raise ConfigError(f"mamba[{g}] must be a bool, got {brief(flag)}")
            if not flag:
                continue
            if self.window(g) is not None or self.chunk(g) is not None:
                raise ConfigError(f"Mamba group {g} has a sliding window or an attention chunk")
        if not self.fine_grained_hits:
            return
        # vLLM's partial_hash_hits_enabled: an align-mode Mamba group larger than the hash
        # block turns on hits that end on any hash boundary. Modelled where they cannot end
        # inside a scheduler block (no Mamba state keyed there, no copy-on-write of a
        # partially hit block): docs/fine-grained.md, section 7.
        for g in range(self.num_groups):
            if self.window(g) is not None or self.chunk(g) is not None:
                raise ConfigError(
                    f"group {g} is a sliding-window or chunked local group beside a Mamba "
                    f"group larger than the hash block {self.hash_block_size} (fine-grained "
                    "hits beside them are not modelled; docs/fine-grained.md)"
                )
            size = self.group_block_sizes[g]
            if self.is_mamba(g) and size != self.scheduler_block_size:
                raise ConfigError(
                    f"Mamba group {g}'s block size {size} is neither the hash block size "
                    f"{self.hash_block_size} nor the scheduler block size "
                    f"{self.scheduler_block_size} (fine-grained hits inside a scheduler "
                    "block need copy-on-write, not modelled; docs/fine-grained.md)"
                )

    def _check_dcp(self) -> None:
        dcp = self.dcp_world_size  # an int in range: checked first
        if dcp == 1:
            return
        if self.world_size % dcp:
            raise ConfigError(
                f"dcp_world_size {dcp} does not divide world_size {self.world_size} (decode "
                "context parallelism splits the tensor-parallel ranks)"
            )
        for g, size in enumerate(self.group_block_sizes):
            if not self.full_attention(g):
                raise ConfigError(
                    f"dcp_world_size {dcp} with group {g}, which is not full attention (vLLM's "
                    "coordinator supports decode context parallelism for full attention only)"
                )
            if size % dcp:
                raise ConfigError(
                    f"dcp_world_size {dcp} does not divide group {g}'s block size {size}"
                )

    @property
    def num_groups(self) -> int:
        return len(self.group_block_sizes)

    def window(self, group: int) -> int | None:
        """The sliding window of ``group``, or None for a full-attention group."""
        return self.sliding_windows[group] if self.sliding_windows else None

    def chunk(self, group: int) -> int | None:
        """The attention chunk of ``group``, or None unless it is chunked local attention."""
        return self.attention_chunks[group] if self.attention_chunks else None

    def is_mamba(self, group: int) -> bool:
        """Whether ``group`` is a Mamba group (align mode)."""
        return bool(self.mamba) and self.mamba[group]

    @property
    def fine_grained_hits(self) -> bool:
        """Whether lookups may end on any hash boundary, not only on scheduler blocks (vLLM's
        ``partial_hash_hits_enabled``: a Mamba group in align mode larger than the hash
        block, and every other group able to look up at hash granularity). vLLM's GPU side
        has them whenever this holds; its offload connector's CPU side only in eager mode
        (``cpu_fine_grained_hits``)."""
        return any(
            self.is_mamba(g) and size > self.hash_block_size
            for g, size in enumerate(self.group_block_sizes)
        )

    @property
    def cpu_fine_grained_hits(self) -> bool:
        """Whether the offload connector's CPU lookups are fine-grained (vLLM builds its CPU
        coordinator with ``allow_partial_hash_hits=not lazy_offload``)."""
        return self.fine_grained_hits and not self.lazy

    @property
    def first_full_attention_group(self) -> int:
        """The first full-attention group: the one vLLM's offload scheduler matches prefixes
        and stores prompt tails on (its ``fa_gidx``)."""
        return next(g for g in range(self.num_groups) if self.full_attention(g))

    def full_attention(self, group: int) -> bool:
        """Whether ``group`` is full attention: no window, no chunk, not Mamba."""
        return self.window(group) is None and self.chunk(group) is None and not self.is_mamba(group)

    def skipped_tokens(self, group: int, num_computed: int) -> int:
        """The leading tokens of ``group`` no token after ``num_computed`` attends to (vLLM's
        ``get_num_skipped_tokens``): none for full attention, those before the window for a
        sliding window, those before the current chunk for chunked local attention, all but
        the last for Mamba."""
        window, chunk = self.window(group), self.chunk(group)
        if self.is_mamba(group):
            # Only the state after the last computed token is needed.
            return max(0, num_computed - 1)
        if window is not None:
            return window_skipped_tokens(num_computed, window)
        if chunk is not None:
            return chunk_skipped_tokens(num_computed, chunk)
        return 0

    def blocks_for(self, num_tokens: int) -> int:
        """The GPU blocks a request of ``num_tokens`` computed tokens holds at most, in all
        groups, when it computes one token per step: each full-attention group holds a
        block per ``block_size`` tokens; a sliding-window group frees the blocks wholly
        before its window, so it never holds more than at one of the first
        ``window - 1 + block_size`` tokens (from there on the count repeats)."""
        total = 0
        for g, size in enumerate(self.group_block_sizes):
            window, chunk = self.window(g), self.chunk(g)
            if self.is_mamba(g):
                # The running state's block and the one it is copied from.
                total += min(2, -(-num_tokens // size))
                continue
            if chunk is not None:
                # The current chunk's blocks only: at most a whole chunk's.
                total += -(-min(num_tokens, chunk) // size)
                continue
            if window is None:
                total += -(-num_tokens // size)
                continue
            total += max(
                (
                    -(-(t + 1) // size) - max(0, t - window + 1) // size
                    for t in range(min(num_tokens, window - 1 + size))
                ),
                default=0,
            )
        return total

    @property
    def lazy_target_free(self) -> int:
        """GPU blocks the lazy scan covers per step, from the head of the free queue: twice
        what one step's token budget can take in every full-attention group, a window's
        blocks and one more in every sliding-window group, two in a Mamba group (vLLM's
        ``_estimate_lazy_target_blocks``)."""
        total = 0
        for g, size in enumerate(self.group_block_sizes):
            window = self.window(g)
            if self.is_mamba(g):
                total += 2
            elif window is None:
                # Chunked local attention counts as full attention here: its spec is not a
                # sliding window's.
                total += -(-MAX_NUM_BATCHED_TOKENS // size)
            else:
                total += -(-window // size) + 1
        return LAZY_WATERMARK * total
