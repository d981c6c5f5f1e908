"""vLLM's scheduler-side offload objects, built without an engine, a GPU or a model download.

Run only in a release's environment (``kvoffload.upstream.install.Cache.environment``): it
imports vLLM. Every difference between releases that the adapter meets lives in this module.

``build(config)`` returns a :class:`World`: vLLM's GPU ``BlockPool`` and its
``SimpleCPUOffloadScheduler`` bound to it, sized like ``config`` (GPU and CPU pools counting
their null block, one full-attention group per KV group, hash blocks of
``config.hash_block_size`` tokens), plus what requests need (the block hasher, sampling
parameters).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

from kvoffload.model.config import MAX_NUM_BATCHED_TOKENS, OffloadConfig

# Layer shape of every group: the scheduler never looks at bytes, only at block counts.
NUM_KV_HEADS, HEAD_SIZE, MAX_MODEL_LEN = 1, 8, 2048


def version() -> str:
    import vllm

    return str(vllm.__version__)


def keywords(cls: Any, **candidates: Any) -> dict[str, Any]:
    """The candidates ``cls`` accepts: fields appear and vanish between releases."""
    accepted = _parameters(cls)
    return {k: v for k, v in candidates.items() if k in accepted}


@functools.cache
def _parameters(cls: Any) -> frozenset[str]:
    # Read once per class: the engine builds requests and scheduler outputs every step.
    return frozenset(inspect.signature(cls).parameters)


@dataclass
class World:
    kv_cache_config: Any
    gpu_pool: Any
    scheduler: Any
    block_hasher: Any


def version_numbers() -> tuple[int, int, int]:
    """The running vLLM's release as numbers (a tree's ``dev`` version counts as 0.0.0)."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version())
    return (0, 0, 0) if found is None else (int(found[1]), int(found[2]), int(found[3]))


def preemption_drawn() -> bool:
    """Whether the engine preempts against the running vLLM: not before 0.24.0, whose
    ``BlockPool.free_blocks`` appends a block once per mention in its list, corrupting the
    linked free queue when a store names a block twice (docs/upstream.md), as the table a
    preempted request keeps up to 0.31.0 makes it do (S20)."""
    return not (0, 0, 0) < version_numbers() < (0, 24, 0)


def supported(config: OffloadConfig) -> str | None:
    """Why vLLM rejects ``config``, or None. One group must hash whole blocks (vLLM's
    ``UnitaryKVCacheCoordinator`` asserts ``hash_block_size == block_size``)."""
    sizes = config.group_block_sizes
    if len(sizes) == 1 and config.hash_block_size != sizes[0]:
        return "a single KV group needs hash blocks of its block size"
    if (0, 0, 0) < version_numbers() < (0, 24, 0) and set(sizes) != {config.hash_block_size}:
        # Before PR #42296 (0.22.0) the offload scheduler hashed in blocks of the cache
        # config's block size, which its coordinator asserts every group divides; before
        # 0.24.0 no block held a key of a prefix shorter than itself (cache_partial_block).
        return "before vLLM 0.24.0 every group's block size is the hash block size"
    if config.sliding_windows and (0, 0, 0) < version_numbers() < (0, 24, 0):
        # Before 0.22.0 the eager scan broke on an unkeyed window position (S3), and before
        # 0.24.0 every group hashed whole blocks: not modelled.
        return "sliding-window groups are modelled from vLLM 0.24.0 on"
    if config.attention_chunks and (0, 0, 0) < version_numbers() < (0, 30, 0):
        # Up to 0.29.0 the eager scan passed over the nulls of a table (S14's class) and
        # before 0.24.0 every group hashed whole blocks: not modelled for chunked groups.
        return "chunked local attention groups are modelled from vLLM 0.30.0 on"
    if config.dcp_world_size > 1 and (0, 0, 0) < version_numbers() < (0, 24, 0):
        # PR #39831 (0.24.0) lifted the offload scheduler's assertion against DCP.
        return "decode context parallelism is asserted off before vLLM 0.24.0"
    if config.dcp_world_size > 1 and len(sizes) > 1 and (0, 0, 0) < version_numbers() < (0, 26, 0):
        # resolve_kv_cache_block_sizes raises for several groups with DCP up to 0.25.x.
        return "several KV groups with decode context parallelism are rejected before vLLM 0.26.0"
    if config.kv_events and (0, 0, 0) < version_numbers() < (0, 30, 0):
        # Up to 0.29.0 the CPU tier's BlockStored events had no tokens, no parent, the GPU's
        # medium and no secondary keys (S11, PR #54325): not modelled.
        return "kv-cache events are modelled from vLLM 0.30.0 on"
    if config.mamba and (0, 0, 0) < version_numbers() < (0, 30, 0):
        # Up to 0.29.0 the offload scheduler scanned an align-mode Mamba table positionally
        # and took no boundary-state hand-off (S13, PR #54736): not modelled.
        return "Mamba groups are modelled from vLLM 0.30.0 on"
    if config.fine_grained_hits and (0, 0, 0) < version_numbers() < (0, 33, 0):
        # Before 0.33.0 the coordinator turned fine-grained hits on by another rule, and
        # the GPU side registered the prompt tail at the prompt's end: not modelled.
        return "fine-grained hits are modelled from vLLM 0.33.0 on"
    if config.lazy and (0, 0, 0) < version_numbers() < (0, 30, 0):
        # Up to 0.29.0 the lazy scan also stamped the CPU blocks it reserved (S10's bug in
        # lazy mode), and before it differed again: not modelled.
        return "lazy mode is modelled from vLLM 0.30.0 on"
    return None


def takes_reset() -> bool:
    """Whether the offload scheduler has ``reset()`` (PR #39726, vLLM 0.24.0 on)."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return hasattr(SimpleCPUOffloadScheduler, "reset")


def takes_stats() -> bool:
    """Whether the offload scheduler reports stats (``get_stats``, vLLM 0.31.0 on)."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return hasattr(SimpleCPUOffloadScheduler, "get_stats")


def state(manager: Any, name: str, default: Any) -> Any:
    """A field of the manager, or what its absence means in the releases before it (no
    abandoned transfers before reset existed, no pins before PR #42289, ...)."""
    return getattr(manager, name, default)


def build(config: OffloadConfig) -> World:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    model = ModelConfig(
        model=os.environ["KVOFFLOAD_VLLM_MODEL"],
        trust_remote_code=True,
        dtype="float16",
        max_model_len=MAX_MODEL_LEN,
    )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            **keywords(
                SchedulerConfig,
                # sizes the lazy scan: the model's constant (OffloadConfig.lazy_target_free)
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=MAX_MODEL_LEN,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            )
        ),
        cache_config=CacheConfig(
            **keywords(
                CacheConfig,
                block_size=max(config.group_block_sizes),
                enable_prefix_caching=True,
                mamba_cache_mode="align" if config.mamba else "none",
            )
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both"
        ),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if config.kv_events
            else None
        ),
        device_config=DeviceConfig("cpu"),
    )

    def spec(group: int, size: int) -> Any:
        shape = {
            "block_size": size,
            "num_kv_heads": NUM_KV_HEADS,
            "head_size": HEAD_SIZE,
            "dtype": torch.float16,
        }
        if config.is_mamba(group):
            # Align mode without speculative or prefill-checkpoint blocks: one state per
            # block, at its end.
            return MambaSpec(
                **keywords(
                    MambaSpec,
                    block_size=size,
                    shapes=((NUM_KV_HEADS, HEAD_SIZE),),
                    dtypes=(torch.float16,),
                    mamba_cache_mode="align",
                )
            )
        if (window := config.window(group)) is not None:
            return SlidingWindowSpec(**shape, sliding_window=window)
        if (chunk := config.chunk(group)) is not None:
            return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=chunk)
        # Decode context parallelism: a rank holds 1 / dcp of a full-attention block's tokens
        # (the coordinator scales the spec's size back up).
        return FullAttentionSpec(**{**shape, "block_size": size // config.dcp_world_size})

    specs = [spec(g, size) for g, size in enumerate(config.group_block_sizes)]
    groups = [KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)]
    page = specs[0].page_size_bytes
    tensors = [
        KVCacheTensor(
            **keywords(
                KVCacheTensor,
                size=page * config.gpu_blocks,
                layers=[f"layer.{g}"],
                shared_by=[f"layer.{g}"],
                layer_stride=page * config.gpu_blocks,
                block_stride=page,
            )
        )
        for g in range(len(specs))
    ]
    kv_cache_config = KVCacheConfig(
        **keywords(
            KVCacheConfig,
            num_blocks=config.gpu_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=groups,
            hash_block_size=config.hash_block_size,
        )
    )
    gpu_pool = BlockPool(config.gpu_blocks, True, config.hash_block_size)
    # The scheduler side reads the DCP size only; the ranks' own check (tensor parallelism a
    # multiple of it) is the model's configuration check (dcp_world_size divides world_size).
    vllm_config.parallel_config.decode_context_parallel_size = config.dcp_world_size

    def scheduler_with(capacity: int) -> Any:
        return SimpleCPUOffloadScheduler(
            **keywords(
                SimpleCPUOffloadScheduler,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                cpu_capacity_bytes=capacity,
                # vLLM sizes the CPU pool from an explicit count (0.33.0 on, checked against
                # the capacity) or, without one, from the capacity in bytes: each on half
                # the configurations, by the parity of the count (the pool's size is
                # asserted below either way).
                num_cpu_blocks=config.cpu_blocks if config.cpu_blocks % 2 else None,
                scheduler_block_size=config.scheduler_block_size,
                hash_block_size=config.hash_block_size,
                lazy_offload=config.lazy,
            )
        )

    # 0.24.0 to 0.32.0 size the CPU pool as gpu_blocks * capacity // (the first tensor's
    # size), which is cpu_blocks; 0.33.0 on take num_cpu_blocks and check it fits; up to
    # 0.23.0 the divisor is the sum of every tensor's size, one per group here.
    scheduler = scheduler_with(page * config.cpu_blocks)
    if scheduler.num_cpu_blocks != config.cpu_blocks:
        scheduler = scheduler_with(page * config.cpu_blocks * len(tensors))
    assert scheduler.num_cpu_blocks == config.cpu_blocks, "the CPU pool is not the size asked"
    scheduler.bind_gpu_block_pool(gpu_pool)
    # The manager counts store reports up to the world size it read from the parallel
    # config; a world of several workers needs no devices on the scheduler side.
    scheduler._expected_worker_count = config.world_size
    init_none_hash(sha256)
    return World(
        kv_cache_config,
        gpu_pool,
        scheduler,
        get_request_block_hasher(config.hash_block_size, sha256),
    )


def cached_entries(pool: Any) -> list[tuple[bytes, tuple[int, ...]]]:
    """A pool's key map as (key, block ids in insertion order). Up to 0.33 a key maps to a
    block or to a dict of blocks; 0.34 keeps one block id per key and the ids of keys
    cached by several blocks apart (``_dup_ids``)."""
    cache = pool.cached_block_hash_to_block
    entries = []
    if hasattr(cache, "_dup_ids"):
        for key, block_id in cache._cache.items():
            duplicates = cache._dup_ids.get(key)
            entries.append((key, tuple(duplicates) if duplicates else (block_id,)))
        return entries
    for key, value in cache._cache.items():
        entries.append((key, tuple(value) if isinstance(value, dict) else (value.block_id,)))
    return entries


def queued_final_flushes(manager: Any) -> list[Any]:
    """The manager's queue of final flushes; 0.29.0 has none (it has no final flush)."""
    return list(state(manager, "_pending_finished_stores", []))


def describe(world: World) -> dict[str, Any]:
    """Sizes as vLLM sees them, for checking that ``build`` matched the configuration."""
    return {
        "version": version(),
        "gpu_blocks": len(world.gpu_pool.blocks),
        "cpu_blocks": world.scheduler.num_cpu_blocks,
        "cpu_groups": len(world.scheduler.cpu_kv_cache_config.kv_cache_groups),
    }
