"""Small helpers shared by the scenario tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.testing.targets import TargetSpec, register, unregister


@contextlib.contextmanager
def registered(row: TargetSpec) -> Iterator[TargetSpec]:
    """``row`` in the target registry while the block runs, as a user's own target is."""
    register(row)
    try:
        yield row
    finally:
        unregister(row.name)


def config(
    gpu_blocks: int = 32,
    cpu_blocks: int = 16,
    group_block_sizes: tuple[int, ...] = (16,),
    hash_block_size: int | None = None,
    world_size: int = 1,
    lazy: bool = False,
    sliding_windows: tuple[int | None, ...] = (),
    attention_chunks: tuple[int | None, ...] = (),
    dcp_world_size: int = 1,
    mamba: tuple[bool, ...] = (),
    kv_events: bool = False,
) -> OffloadConfig:
    """A configuration; the hash block size defaults to the smallest group block size."""
    return OffloadConfig(
        gpu_blocks,
        cpu_blocks,
        group_block_sizes,
        hash_block_size or min(group_block_sizes),
        world_size,
        lazy,
        sliding_windows,
        attention_chunks=attention_chunks,
        dcp_world_size=dcp_world_size,
        mamba=mamba,
        kv_events=kv_events,
    )


def make(
    gpu_blocks: int = 32,
    cpu_blocks: int = 16,
    group_block_sizes: tuple[int, ...] = (16,),
    hash_block_size: int | None = None,
    world_size: int = 1,
    variant: str = "fixed",
) -> OffloadModel:
    """A model that checks every invariant after every call."""
    cfg = config(gpu_blocks, cpu_blocks, group_block_sizes, hash_block_size, world_size)
    return OffloadModel(cfg, variant=variant, check=True)


def complete_all_stores(model: OffloadModel) -> list[int]:
    """Every worker completes every store event in flight; returns the events."""
    events = [v.event for v in model.snapshot().store_events if v.event is not None]
    for event in events:
        for worker in range(model.config.world_size):
            model.complete_store(event, worker)
    return events


def drain(model: OffloadModel) -> None:
    """Submit queued flushes and complete every store until none is pending."""
    for _ in range(10):
        if not model.has_pending_stores():
            return
        model.step(0)
        complete_all_stores(model)
    raise AssertionError("stores still pending after 10 steps")


def prompt(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``n`` tokens; different seeds give different prompts."""
    return [(seed * 7 + i * 3) % 11 + 1 for i in range(n)]


def waiting_on_a_pinned_hit(variant: str) -> OffloadModel:
    """A 12-token prompt stored on the CPU, a request holding the GPU, and the prompt again:
    its CPU hit is found and its allocation fails, so the hit waits (pinned, from 0.22.0)."""
    from kvoffload.model.variants import keeps_invariants

    model = make(gpu_blocks=5, cpu_blocks=12, group_block_sizes=(4,), variant=variant)
    model.checked = keeps_invariants(variant)
    tokens = prompt(12)
    model.add_request("a", tokens, max_tokens=1)
    for _ in range(4):
        model.step(16)
        complete_all_stores(model)
    model.add_request("hog", prompt(13, seed=1), max_tokens=3)  # holds 4 GPU blocks
    model.step(16)
    model.add_request("b", tokens, max_tokens=1)  # CPU hit of 8 tokens, no GPU room
    model.step(16)
    return model


def found_in_release(version: str, script: str) -> list[str | None]:
    """Run ``script`` in ``version``'s release environment and return the ``found`` of each
    JSON line it prints (a first difference, or None); the test is skipped where the release
    is not installed."""
    import json
    import subprocess

    import pytest

    from kvoffload.upstream.install import Cache, default_cache

    cache = Cache(default_cache())
    if not cache.installed(version):
        pytest.skip(f"vllm=={version} is not installed: kvoffload install vllm=={version}")
    run = subprocess.run(
        [str(cache.python), "-c", script],
        env=cache.environment(version),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    return [json.loads(line)["found"] for line in lines]
