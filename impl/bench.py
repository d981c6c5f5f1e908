"""``kvoffload bench``: copy bandwidth and scheduler cost, written as a markdown report.

Copy bandwidth: for each block size and batch, the worker's copy path
(:func:`~kvoffload.impl.copy.copy_blocks`) against one contiguous copy of the same bytes
between the same two memories (the limit) and a naive loop of one copy per block. Source
ids are sequential (a long prompt stored into fresh blocks) or scattered (a deterministic
permutation, as blocks freed in LRU order); destinations are consecutive. Directions
device->host and host->device; on CUDA both pinned and pageable host memory.

Scheduler cost: a 40K-token prompt through compute, eager stores, finish and final flush,
lookup and load, with the scheduler alone (no tensors), per block, at pool sizes 10^3 to
10^6 blocks. Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvoffload.impl.copy import copy_blocks
from kvoffload.impl.driver import OffloadImpl, default_device
from kvoffload.model.config import OffloadConfig
from kvoffload.model.types import NO_EVENT, StepResult

KIB = 1024
BLOCK_SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB]
BATCHES = [1, 8, 64, 256, 1024]
POOL_SIZES = [10**3, 10**4, 10**5, 10**6]


@dataclass(frozen=True)
class CopyResult:
    direction: str
    host: str
    block_bytes: int
    batch: int
    pattern: str
    contiguous_gbps: float
    batched_gbps: float
    naive_gbps: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], None], device: torch.device, budget_s: float) -> float:
    fn()
    _sync(device)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(50):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def _rates(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: list[int],
    dst_ids: list[int],
    device: torch.device,
    budget_s: float,
) -> tuple[float, float, float]:
    """GB/s of the contiguous limit, the worker's batched path, and a per-block loop."""
    n = len(src_ids)
    nbytes = n * src.shape[1]

    def contiguous() -> None:
        dst[n : 2 * n].copy_(src[:n], non_blocking=True)

    def batched() -> None:
        copy_blocks(src, dst, src_ids, dst_ids)

    def naive() -> None:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[d].copy_(src[s], non_blocking=True)

    c, b, v = (
        nbytes / _best_seconds(fn, device, budget_s) / 1e9 for fn in (contiguous, batched, naive)
    )
    return c, b, v


def copy_bandwidth(
    device: torch.device,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    batches: Sequence[int] = BATCHES,
    max_bytes: int = 256 * 1024 * KIB,
    budget_s: float = 0.3,
) -> list[CopyResult]:
    results: list[CopyResult] = []
    hosts = ["pinned", "pageable"] if device.type == "cuda" else ["host"]
    for block_bytes in block_sizes:
        for batch in batches:
            if block_bytes * batch > max_bytes:
                continue
            dev = torch.randint(0, 255, (2 * batch, block_bytes), dtype=torch.uint8, device=device)
            for host_kind in hosts:
                host = torch.zeros(
                    2 * batch, block_bytes, dtype=torch.uint8, pin_memory=host_kind == "pinned"
                )
                for direction, src, dst in (
                    ("device->host", dev, host),
                    ("host->device", host, dev),
                ):
                    for pattern in ("sequential", "scattered"):
                        src_ids = list(range(batch))
                        if pattern == "scattered":
                            random.Random(batch).shuffle(src_ids)
                        rates = _rates(
                            src, dst, src_ids, list(range(batch, 2 * batch)), device, budget_s
                        )
                        results.append(
                            CopyResult(direction, host_kind, block_bytes, batch, pattern, *rates)
                        )
    return results


@dataclass(frozen=True)
class SchedulerResult:
    pool_blocks: int
    blocks: int
    us_per_block: dict[str, float]


def _scheduler_case(pool: int, prompt: list[int], block_size: int) -> dict[str, float]:
    """Seconds per phase for one prompt through one engine with ``pool`` blocks per pool."""
    impl = OffloadImpl(OffloadConfig(pool, pool, (block_size,), block_size), layout=None)
    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        out = fn()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        return out

    def complete_stores() -> None:
        for event, worker in impl.outstanding("store"):
            impl.complete_store(event, worker)

    impl.add_request("a", prompt, max_tokens=1)
    while impl.live_requests():  # the last step finishes the request: final flush
        timed("compute, store selection, finish", lambda: impl.step(8192))
        timed("store completion", complete_stores)
    timed("flush submission", lambda: impl.step(0))
    timed("store completion", complete_stores)
    impl.engine.gpu.clear_cache()  # a GPU prefix-cache reset: the repeat must load
    impl.add_request("b", prompt, max_tokens=1)
    keys = impl.engine.requests["b"].block_keys()
    cpu = impl.connector.cpu
    timed("CPU lookup", lambda: impl.connector.longest_hit(cpu, keys, 0, len(prompt) - 1))
    result = timed("lookup, pin, load setup", lambda: impl.step(8192))
    assert isinstance(result, StepResult) and result.metadata.load_event != NO_EVENT
    timed("load completion", lambda: impl.complete_load(result.metadata.load_event))
    return timings


def scheduler_cost(
    pool_sizes: Sequence[int] = POOL_SIZES,
    prompt_tokens: int = 40_000,
    block_size: int = 64,
    repeats: int = 5,
) -> list[SchedulerResult]:
    prompt = [(i * 7919) % 50_000 for i in range(prompt_tokens)]
    n_blocks = prompt_tokens // block_size
    _scheduler_case(n_blocks + 2, prompt, block_size)  # warm-up, discarded
    results = []
    for pool in pool_sizes:
        # Best of `repeats` runs per phase, with the garbage collector held off while timing.
        best: dict[str, float] = {}
        for _ in range(repeats):
            gc.collect()
            gc.disable()
            try:
                timings = _scheduler_case(pool, prompt, block_size)
            finally:
                gc.enable()
            best = {k: min(v, best.get(k, v)) for k, v in timings.items()}
        results.append(
            SchedulerResult(pool, n_blocks, {k: v / n_blocks * 1e6 for k, v in best.items()})
        )
    return results


def machine() -> str:
    """The processor, its cores and the torch build, as this machine reports them."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                name,
            )
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


def summary(
    copies: list[CopyResult], scheduler: list[SchedulerResult], extra: Sequence[str] = ()
) -> list[str]:
    lines = ["## Summary", ""]
    for pattern in ("sequential", "scattered"):
        ratios = [
            r.batched_gbps / r.contiguous_gbps
            for r in copies
            if r.pattern == pattern and r.block_bytes >= 64 * KIB
        ]
        if ratios:
            lines.append(
                f"- Blocks of 64 KiB and more, {pattern} ids: batched / contiguous between "
                f"{min(ratios):.2f} and {max(ratios):.2f} (median "
                f"{sorted(ratios)[len(ratios) // 2]:.2f}); target at least 0.8."
            )
    if scheduler:
        totals = [sum(s.us_per_block.values()) for s in scheduler]
        lines.append(
            f"- Scheduler cost per block from {scheduler[0].pool_blocks:,} to "
            f"{scheduler[-1].pool_blocks:,} pool blocks: {min(totals):.1f} to {max(totals):.1f} "
            f"us, max / min {max(totals) / min(totals):.2f}; target at most 1.5."
        )
    return [*lines, *extra, "", *NOTE.splitlines(), ""]


NOTE = """\
Reading the figures: without a GPU both memories are host DRAM, the "device" included. Where
the ratio falls short of 0.8, it is the cost of one torch operation (one to four microseconds)
against the few microseconds a single 64 KiB block takes to copy, and the gather bandwidth of
`index_select` for scattered ids; both shrink as blocks or runs grow. The CUDA path (copy
stream, events, pinned and pageable host memory) has not been measured: no device was lent.
"""


def report(
    copies: list[CopyResult],
    scheduler: list[SchedulerResult],
    command: str,
    extra: tuple[Sequence[str], Sequence[str]] = ((), ()),
) -> str:
    """The markdown report; ``extra`` is (summary lines, a section) measured elsewhere."""
    device = default_device()
    lines = [
        "# Performance",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} with `{command}` on {machine()}, device "
        f"`{device}`"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + ". Best of repeated runs; GB/s is 10^9 bytes per second.",
        "",
        *summary(copies, scheduler, extra[0]),
        "## Block copy bandwidth",
        "",
        "`batched` is the worker's path (one slice copy or indexed gather per run of",
        "consecutive destination ids); `contiguous` is one copy of the same bytes (the limit);",
        "`naive` is one copy per block. `ids`: source ids sequential or scattered.",
        "",
        "| direction | host | block | batch | ids | contiguous GB/s | batched GB/s | naive GB/s"
        " | batched / contiguous |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in copies:
        lines.append(
            f"| {r.direction} | {r.host} | {r.block_bytes // KIB} KiB | {r.batch} | {r.pattern}"
            f" | {r.contiguous_gbps:.2f} | {r.batched_gbps:.2f} | {r.naive_gbps:.2f}"
            f" | {r.batched_gbps / r.contiguous_gbps:.2f} |"
        )
    phases = list(scheduler[0].us_per_block) if scheduler else []
    lines += [
        "",
        "## Scheduler cost per block",
        "",
        f"A {scheduler[0].blocks * 64 if scheduler else 0}-token prompt in 64-token blocks "
        "({} blocks), scheduler alone, microseconds per block, best of 5 runs.".format(
            scheduler[0].blocks if scheduler else 0
        ),
        "",
        "| pool blocks | " + " | ".join(phases) + " | total |",
        "|---|" + "---|" * (len(phases) + 1),
    ]
    for s in scheduler:
        values = [s.us_per_block[p] for p in phases]
        lines.append(
            f"| {s.pool_blocks:,} | "
            + " | ".join(f"{v:.1f}" for v in values)
            + f" | {sum(values):.1f} |"
        )
    return "\n".join([*lines, "", *extra[1]]).rstrip() + "\n"


def run_bench(
    output: str | None, quick: bool, extra: tuple[Sequence[str], Sequence[str]] = ((), ())
) -> int:
    device = default_device()
    copies = copy_bandwidth(
        device,
        block_sizes=[16 * KIB, 64 * KIB, 1024 * KIB] if quick else BLOCK_SIZES,
        batches=[1, 64] if quick else BATCHES,
        budget_s=0.05 if quick else 0.3,
    )
    scheduler = scheduler_cost([10**3, 10**4] if quick else POOL_SIZES)
    command = "kvoffload bench" + (" --quick" if quick else "")
    text = report(copies, scheduler, command, extra)
    if output:
        with open(output, "w") as f:
            f.write(text)
    print(text)
    return 0
