"""``kvoffload bench``: copy bandwidth, scheduler cost and lockstep throughput, each against
the limit or the reference its target is stated for, written as a markdown report and, with
``--json FILE``, as JSON.

Copy bandwidth: for each block size and batch, the worker's copy path (a
:class:`~kvoffload.impl.copy.CopyPlan` built for the batch and run over one tensor: what one
group of a transfer costs) against the limit. Without a GPU both memories are host memory and
the limit is a ``memmove`` of the same number of bytes (one call of the C library's, through
``ctypes``); on CUDA it is the peak of one large ``cudaMemcpyAsync`` (a contiguous
``copy_(non_blocking=True)`` of 256 MiB) between the same two memories, pinned or pageable.
Each figure is the best of interleaved runs (limit, path, and for reference one contiguous
torch copy and a loop of one copy per block, taken in turn). Source ids are sequential (a
long prompt stored into fresh blocks) or scattered (a fixed permutation, as blocks freed in
LRU order); destinations are consecutive. Directions device->host and host->device.

Scheduler cost: a 40K-token prompt through compute, eager stores, finish and final flush,
lookup and load, with the scheduler alone (no tensors), per block, at pool sizes 10^3 to 10^6
blocks, in 64- and 16-token blocks; the same trace through vLLM's own
``SimpleCPUOffloadScheduler`` when a caller passes a way to run it
(:func:`kvoffload.upstream.schedbench.vllm_scheduler_cost`). Speed is measured here, never
asserted in tests.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvoffload.impl.copy import CopyPlan, mapped_pays, mapped_view, rows
from kvoffload.impl.driver import OffloadImpl, default_device
from kvoffload.model.config import OffloadConfig
from kvoffload.model.types import NO_EVENT, StepResult

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB]
BATCHES = [1, 8, 64, 256, 1024]
MAX_BYTES = 1024 * MIB  # per tensor: larger batches of large blocks are not run (memory)
PEAK_BYTES = 256 * MIB  # the one large copy whose rate is the CUDA limit
SCHEDULER_BLOCK_SIZES = [64, 16]
POOL_SIZES = [10**3, 10**4, 10**5, 10**6]
PROMPT_TOKENS = 40_000
STEP_TOKENS = 8192  # token budget of each step of the scheduler trace
PHASES = (  # of the scheduler trace, in order; vLLM's side times the same ones
    "compute, store selection, finish",
    "store completion",
    "flush submission",
    "CPU lookup",
    "lookup, pin, load setup",
    "load completion",
)

# The targets of issue 15 (docs/performance.md).
COPY_TARGET = 0.9  # batched / memmove, 16 KiB to 4 MiB blocks, batches 8 to 1024, scattered
CUDA_COPY_TARGET = 0.85  # pinned host<->device, batched / one large cudaMemcpyAsync
SCHEDULER_TARGET = 0.5  # implementation / vLLM 0.34.0, per block
FLAT_TARGET = 1.5  # largest / smallest per-block cost over the pool sizes


@dataclass(frozen=True)
class CopyResult:
    direction: str
    host: str
    block_bytes: int
    batch: int
    pattern: str
    limit_gbps: float
    batched_gbps: float
    contiguous_gbps: float
    naive_gbps: float
    block_memmove_gbps: float | None  # the C library's memmove, block by block (host only)
    # CUDA, page-locked host memory: the plan forced to one DMA per host run, and forced to
    # kernels over the mapped host memory; ``batched`` is the one the worker picks.
    dma_gbps: float | None = None
    mapped_gbps: float | None = None

    @property
    def ratio(self) -> float:
        """The worker's path against the limit."""
        return self.batched_gbps / self.limit_gbps

    def in_target(self) -> bool:
        """Whether the issue's copy target covers this case."""
        return self.pattern == "scattered" and self.batch >= 8 and self.host != "pageable"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(
    fns: Sequence[Callable[[], None]], device: torch.device, budget_s: float
) -> list[float]:
    """Best time of each function, run in turn (so that the machine's load falls on all
    alike) until ``budget_s`` has passed, at least three rounds, at most 50."""
    best = [float("inf")] * len(fns)
    for fn in fns:  # warm-up: first touches, allocator, caches
        fn()
    _sync(device)
    deadline = time.perf_counter() + budget_s
    for round_ in range(50):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            _sync(device)
            best[i] = min(best[i], time.perf_counter() - start)
        if round_ >= 2 and time.perf_counter() > deadline:
            break
    return best


def cuda_peak(device: torch.device, pinned: bool, to_device: bool, budget_s: float) -> float:
    """GB/s of one large contiguous copy between host (pinned or not) and device memory."""
    host = torch.ones(PEAK_BYTES, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(PEAK_BYTES, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if to_device else (dev, host)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    (seconds,) = best_seconds([copy], device, budget_s)
    return PEAK_BYTES / seconds / 1e9


def copy_case(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: list[int],
    device: torch.device,
    budget_s: float,
    peak_gbps: float | None,
) -> tuple[float, float, float, float, float | None, float | None, float | None]:
    """GB/s of the limit, the worker's batched path, one contiguous torch copy, a loop of one
    torch copy per block and (host memory only) a loop of one memmove per block, copying
    blocks ``src_ids`` of ``src`` into ``dst``'s first rows; on CUDA with page-locked host
    memory, then the plan forced to DMAs and forced to kernels over mapped host memory."""
    n = len(src_ids)
    row = dst[0].numel() * dst.element_size()
    nbytes = n * row
    dst_ids = list(range(n))
    src_rows, dst_rows = rows(src), rows(dst)  # the worker keeps these views beside its KV
    to_device = src.device.type == "cpu"
    host_rows = src_rows if to_device else dst_rows
    view = mapped_view(host_rows, device) if peak_gbps is not None else None
    src_view, dst_view = (view, dst_rows) if to_device else (src_rows, view)

    def plan(mapped: bool) -> Callable[[], None]:
        s, d = (src_view, dst_view) if mapped else (src_rows, dst_rows)
        assert s is not None and d is not None

        def run() -> None:
            CopyPlan(src_ids, dst_ids, src.device, dst.device, mapped=mapped).run_rows(s, d)

        return run

    def batched() -> None:  # what the worker does: mapped where that pays
        host_ids = src_ids if to_device else dst_ids
        plan(view is not None and mapped_pays(host_ids, row))()

    def contiguous() -> None:
        dst[:n].copy_(src[:n], non_blocking=True)

    def naive() -> None:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[d].copy_(src[s], non_blocking=True)

    fns: list[Callable[[], None]] = [batched, contiguous, naive]
    if peak_gbps is None:  # both in host memory: the C library's memmove is the limit
        src_ptr, dst_ptr = src.data_ptr(), dst.data_ptr()
        sources = [src_ptr + i * row for i in src_ids]
        targets = [dst_ptr + i * row for i in dst_ids]

        def limit() -> None:
            ctypes.memmove(dst_ptr, src_ptr, nbytes)

        def block_memmove() -> None:
            for target, source in zip(targets, sources, strict=True):
                ctypes.memmove(target, source, row)

        fns += [limit, block_memmove]
    elif view is not None:
        fns += [plan(False), plan(True)]
    seconds = best_seconds(fns, device, budget_s)
    rates = [nbytes / s / 1e9 for s in seconds]
    if peak_gbps is None:
        return rates[3], rates[0], rates[1], rates[2], rates[4], None, None
    dma, mapped = (rates[3], rates[4]) if view is not None else (None, None)
    return peak_gbps, rates[0], rates[1], rates[2], None, dma, mapped


def copy_bandwidth(
    device: torch.device,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    batches: Sequence[int] = BATCHES,
    max_bytes: int = MAX_BYTES,
    budget_s: float = 0.3,
) -> list[CopyResult]:
    # One intra-op thread, as the memmove it is held to: on a small shared machine a copy
    # split over every core waits for the busiest of them (milliseconds, not microseconds).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _copy_bandwidth(device, block_sizes, batches, max_bytes, budget_s)
    finally:
        torch.set_num_threads(threads)


def _copy_bandwidth(
    device: torch.device,
    block_sizes: Sequence[int],
    batches: Sequence[int],
    max_bytes: int,
    budget_s: float,
) -> list[CopyResult]:
    results: list[CopyResult] = []
    cuda = device.type == "cuda"
    hosts = ["pinned", "pageable"] if cuda else ["host"]
    peaks = {
        (host, to_device): cuda_peak(device, host == "pinned", to_device, budget_s)
        for host in hosts
        for to_device in (False, True)
        if cuda
    }
    for block_bytes in block_sizes:
        for batch in batches:
            if block_bytes * batch > max_bytes:
                continue
            dev = torch.empty(batch, block_bytes, dtype=torch.uint8, device=device).fill_(7)
            for host_kind in hosts:
                host = torch.zeros(batch, block_bytes, dtype=torch.uint8)
                if host_kind == "pinned":
                    host = host.pin_memory()
                for direction, src, dst in (
                    ("device->host", dev, host),
                    ("host->device", host, dev),
                ):
                    for pattern in ("sequential", "scattered"):
                        src_ids = list(range(batch))
                        if pattern == "scattered":
                            random.Random(batch).shuffle(src_ids)
                        peak = peaks.get((host_kind, direction == "host->device"))
                        rates = copy_case(src, dst, src_ids, device, budget_s, peak)
                        results.append(
                            CopyResult(direction, host_kind, block_bytes, batch, pattern, *rates)
                        )
                del host
            del dev
            gc.collect()
    return results


@dataclass(frozen=True)
class SchedulerResult:
    block_size: int
    pool_blocks: int
    blocks: int
    us_per_block: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.us_per_block.values())


def trace_prompt(prompt_tokens: int) -> list[int]:
    """The prompt of the scheduler trace (vLLM's side runs the same one)."""
    return [(i * 7919) % 50_000 for i in range(prompt_tokens)]


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

    compute, completion, flush, cpu_lookup, load, load_completion = PHASES
    impl.add_request("a", prompt, max_tokens=1)
    while impl.live_requests():  # the last step finishes the request: final flush
        timed(compute, lambda: impl.step(STEP_TOKENS))
        timed(completion, complete_stores)
    timed(flush, lambda: impl.step(0))
    timed(completion, complete_stores)
    impl.engine.gpu.clear_cache()  # a GPU prefix-cache reset: the repeat must load
    impl.add_request("b", prompt, max_tokens=1)
    keys = impl.engine.requests["b"].block_keys()
    cpu = impl.connector.cpu
    timed(cpu_lookup, lambda: impl.connector.longest_hit(cpu, keys, 0, len(prompt) - 1))
    result = timed(load, lambda: impl.step(STEP_TOKENS))
    assert isinstance(result, StepResult) and result.metadata.load_event != NO_EVENT
    timed(load_completion, lambda: impl.complete_load(result.metadata.load_event))
    return timings


def pools_for(pool_sizes: Sequence[int], prompt_tokens: int, block_size: int) -> list[int]:
    """The pool sizes that hold the prompt (with its null block and decoded token)."""
    return [p for p in pool_sizes if p >= -(-prompt_tokens // block_size) + 2]


def scheduler_cost(
    pool_sizes: Sequence[int] = POOL_SIZES,
    prompt_tokens: int = PROMPT_TOKENS,
    block_sizes: Sequence[int] = SCHEDULER_BLOCK_SIZES,
    repeats: int = 5,
) -> list[SchedulerResult]:
    prompt = trace_prompt(prompt_tokens)
    results = []
    for block_size in block_sizes:
        n_blocks = prompt_tokens // block_size
        _scheduler_case(n_blocks + 2, prompt, block_size)  # warm-up, discarded
        for pool in pools_for(pool_sizes, prompt_tokens, block_size):
            # Best of `repeats` runs per phase, with the garbage collector held off while
            # timing, as on vLLM's side.
            best: dict[str, float] = {}
            for _ in range(repeats):
                gc.collect()
                gc.disable()
                try:
                    timings = _scheduler_case(pool, prompt, block_size)
                finally:
                    gc.enable()
                best = {k: min(v, best.get(k, v)) for k, v in timings.items()}
            per_block = {k: v / n_blocks * 1e6 for k, v in best.items()}
            results.append(SchedulerResult(block_size, pool, n_blocks, per_block))
    return results


# The vLLM side: (pool sizes, block sizes, prompt tokens, repeats) -> (results, a line).
VllmRunner = Callable[[Sequence[int], Sequence[int], int, int], tuple[dict[str, Any] | None, str]]


@dataclass
class Bench:
    """Everything one run measured."""

    command: str
    copies: list[CopyResult]
    scheduler: list[SchedulerResult]
    vllm: list[SchedulerResult] = field(default_factory=list)
    vllm_note: str = "the side by side with vLLM was not asked for"
    lockstep: dict[str, Any] | None = None
    lockstep_lines: tuple[list[str], list[str]] = ([], [])
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    def vllm_pairs(self) -> list[tuple[SchedulerResult, SchedulerResult]]:
        """(implementation, vLLM) for every case both ran."""
        theirs = {(r.block_size, r.pool_blocks): r for r in self.vllm}
        return [
            (r, theirs[(r.block_size, r.pool_blocks)])
            for r in self.scheduler
            if (r.block_size, r.pool_blocks) in theirs
        ]

    def copy_target(self) -> dict[str, Any]:
        cuda = any(r.host == "pinned" for r in self.copies)
        covered = [
            r for r in self.copies if r.in_target() and 16 * KIB <= r.block_bytes <= 4096 * KIB
        ]
        ratios = [r.ratio for r in covered]
        # The path's own overhead: against one contiguous copy of the same bytes, which on
        # a small batch is bound by a copy's fixed cost as the path is.
        own = sorted(r.batched_gbps / r.contiguous_gbps for r in covered)
        target = CUDA_COPY_TARGET if cuda else COPY_TARGET
        # Host memory: a loop of one memmove per block, its addresses computed beforehand,
        # is what copying block by block can reach at best (the C library's copy and a
        # call per block, nothing else); where it is under the target, so is every path
        # that copies scattered blocks one by one.
        loops = sorted(r.block_memmove_gbps / r.limit_gbps for r in covered if r.block_memmove_gbps)
        vs_loop = sorted(
            r.batched_gbps / r.block_memmove_gbps for r in covered if r.block_memmove_gbps
        )
        return {
            "limit": "one large cudaMemcpyAsync" if cuda else "memmove of the same bytes",
            "cases": len(covered),
            "min_ratio": min(ratios, default=None),
            "median_ratio": sorted(ratios)[len(ratios) // 2] if ratios else None,
            "cases_below_target": sum(r < target for r in ratios),
            "min_vs_contiguous": own[0] if own else None,
            "median_vs_contiguous": own[len(own) // 2] if own else None,
            "target": target,
            "met": bool(ratios) and min(ratios) >= target,
            "loop_cases_below_target": sum(x < target for x in loops) if loops else None,
            "median_loop_ratio": loops[len(loops) // 2] if loops else None,
            "min_vs_loop": vs_loop[0] if vs_loop else None,
            "median_vs_loop": vs_loop[len(vs_loop) // 2] if vs_loop else None,
        }

    def scheduler_target(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for size in sorted({r.block_size for r in self.scheduler}, reverse=True):
            totals = [r.total for r in self.scheduler if r.block_size == size]
            flat[str(size)] = max(totals) / min(totals)
        pairs = self.vllm_pairs()
        ratios = [mine.total / theirs.total for mine, theirs in pairs]
        return {
            "vllm": self.vllm_note,
            "cases": len(pairs),
            "max_ratio": max(ratios, default=None),
            "target": SCHEDULER_TARGET,
            "met": bool(ratios) and max(ratios) <= SCHEDULER_TARGET,
            "flatness": flat,
            "flat_target": FLAT_TARGET,
            "flat_met": bool(flat) and max(flat.values()) <= FLAT_TARGET,
        }

    def to_json(self) -> dict[str, Any]:
        device = default_device()
        return {
            "date": self.date,
            "command": self.command,
            "machine": machine(),
            "device": str(device),
            "targets": {
                "copies": self.copy_target(),
                "scheduler": self.scheduler_target(),
                "lockstep": None if self.lockstep is None else self.lockstep["target"],
            },
            "copies": [asdict(r) | {"ratio": r.ratio} for r in self.copies],
            "scheduler": {
                "prompt_tokens": PROMPT_TOKENS,
                "implementation": [asdict(r) | {"total": r.total} for r in self.scheduler],
                "vllm": [asdict(r) | {"total": r.total} for r in self.vllm],
                "vllm_note": self.vllm_note,
                "ratios": [
                    {
                        "block_size": mine.block_size,
                        "pool_blocks": mine.pool_blocks,
                        "ratio": mine.total / theirs.total,
                    }
                    for mine, theirs in self.vllm_pairs()
                ],
            },
            "lockstep": self.lockstep,
        }


def vllm_results(data: dict[str, Any]) -> list[SchedulerResult]:
    """vLLM's timings (seconds per phase) as per-block results."""
    prompt_tokens = int(data["prompt_tokens"])
    results = []
    for run in data["runs"]:
        size = int(run["block_size"])
        blocks = prompt_tokens // size
        per_block = {k: v / blocks * 1e6 for k, v in run["seconds"].items()}
        results.append(SchedulerResult(size, int(run["pool_blocks"]), blocks, per_block))
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


def _gbps(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def summary(bench: Bench) -> list[str]:
    lines = ["## Summary", ""]
    copies = bench.copy_target()
    if copies["cases"]:
        lines.append(
            f"- Block copies, 16 KiB to 4 MiB blocks, batches of 8 to 1024, scattered ids: "
            f"batched / {copies['limit']} {copies['min_ratio']:.2f} at least, median "
            f"{copies['median_ratio']:.2f}, {copies['cases_below_target']} of "
            f"{copies['cases']} cases under the target of {copies['target']}: "
            f"{_met(copies['met'])}. Against one contiguous torch copy of the same bytes "
            f"(bound, on small batches, by the same fixed cost of a copy): "
            f"{copies['min_vs_contiguous']:.2f} at least, median "
            f"{copies['median_vs_contiguous']:.2f}."
        )
        if copies["median_loop_ratio"] is not None:
            lines.append(
                f"- The same cases copied by a loop of one `memmove` per block (addresses "
                f"computed beforehand: the C library's copy and one call per block, nothing "
                f"else): under the target in {copies['loop_cases_below_target']} of "
                f"{copies['cases']} cases, median {copies['median_loop_ratio']:.2f} of the "
                f"limit, so no path that copies scattered blocks one by one reaches it there. "
                f"Batched / that loop: {copies['min_vs_loop']:.2f} at least, median "
                f"{copies['median_vs_loop']:.2f}."
            )
    sched = bench.scheduler_target()
    for size, spread in sched["flatness"].items():
        totals = [r.total for r in bench.scheduler if r.block_size == int(size)]
        lines.append(
            f"- Scheduler cost per block, {size}-token blocks, pools "
            f"{min(r.pool_blocks for r in bench.scheduler if r.block_size == int(size)):,} to "
            f"{max(r.pool_blocks for r in bench.scheduler if r.block_size == int(size)):,}: "
            f"{min(totals):.2f} to {max(totals):.2f} us, max / min {spread:.2f}; target at most "
            f"{FLAT_TARGET}: {_met(spread <= FLAT_TARGET)}."
        )
    if sched["cases"]:
        lines.append(
            f"- Scheduler against vLLM's on the same trace: implementation / vLLM at most "
            f"{sched['max_ratio']:.2f} over {sched['cases']} cases; target at most "
            f"{SCHEDULER_TARGET}: {_met(sched['met'])}."
        )
    else:
        lines.append(f"- Scheduler against vLLM's: not measured ({bench.vllm_note}).")
    return [*lines, *bench.lockstep_lines[0], ""]


def report(bench: Bench) -> str:
    """The markdown report."""
    device = default_device()
    lines = [
        "# Performance",
        "",
        f"Measured {bench.date} with `{bench.command}` on {machine()}, device `{device}`"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + ". Best of repeated runs; GB/s is 10^9 bytes per second.",
        "",
        *summary(bench),
        "## Block copy bandwidth",
        "",
        "`batched` is the worker's path (a copy plan built for the batch, then one batched",
        "operation per run of consecutive ids, on int64 views, or host to host for rows of",
        "256 KiB and more, one `memmove` per run consecutive on both sides); `limit` is "
        + (
            "one large `cudaMemcpyAsync` between the same memories"
            if device.type == "cuda"
            else "one `memmove` of the same bytes"
        )
        + ";",
        "`contiguous` is one torch copy of the same bytes and `naive` one copy per block, for",
        "reference"
        + (
            "; `memmove loop` one `memmove` per block, addresses computed beforehand."
            if any(r.block_memmove_gbps is not None for r in bench.copies)
            else "."
        ),
        "`ids`: source ids sequential or scattered.",
    ]
    mapped = any(r.mapped_gbps is not None for r in bench.copies)
    if mapped:
        lines += [
            "With page-locked host memory on CUDA, `dma` is the plan forced to one DMA per run",
            "consecutive on the host side and `mapped` the plan forced to kernels over the host",
            "memory mapped into the device; `batched` is the one the worker picks.",
        ]
    loop = any(r.block_memmove_gbps is not None for r in bench.copies)
    extra = " dma GB/s | mapped GB/s |" if mapped else ""
    extra += " memmove loop GB/s |" if loop else ""
    lines += [
        "",
        "| direction | host | block | batch | ids | limit GB/s | batched GB/s | contiguous GB/s"
        f" | naive GB/s |{extra} batched / limit |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * (1 + 2 * mapped + loop),
    ]
    for r in bench.copies:
        cells = f" {_gbps(r.dma_gbps)} | {_gbps(r.mapped_gbps)} |" if mapped else ""
        cells += f" {_gbps(r.block_memmove_gbps)} |" if loop else ""
        lines.append(
            f"| {r.direction} | {r.host} | {r.block_bytes // KIB} KiB | {r.batch} | {r.pattern}"
            f" | {r.limit_gbps:.2f} | {r.batched_gbps:.2f} | {r.contiguous_gbps:.2f}"
            f" | {r.naive_gbps:.2f} |{cells} {r.ratio:.2f} |"
        )
    lines += ["", *scheduler_section(bench), "", *bench.lockstep_lines[1]]
    return "\n".join(lines).rstrip() + "\n"


def scheduler_section(bench: Bench) -> list[str]:
    if not bench.scheduler:
        return []
    phases = list(bench.scheduler[0].us_per_block)
    lines = [
        "## Scheduler cost per block",
        "",
        f"A {PROMPT_TOKENS:,}-token prompt, scheduler alone, microseconds per block, best of",
        "repeated runs. Pools too small for the prompt are not run.",
        "",
        "| side | block tokens | pool blocks | " + " | ".join(phases) + " | total |",
        "|---|---|---|" + "---|" * (len(phases) + 1),
    ]
    for side, results in (("implementation", bench.scheduler), ("vLLM", bench.vllm)):
        for s in results:
            values = [s.us_per_block.get(p, 0.0) for p in phases]
            lines.append(
                f"| {side} | {s.block_size} | {s.pool_blocks:,} | "
                + " | ".join(f"{v:.2f}" for v in values)
                + f" | {s.total:.2f} |"
            )
    lines += ["", f"vLLM: {bench.vllm_note}."]
    pairs = bench.vllm_pairs()
    if pairs:
        lines += [
            "",
            "| block tokens | pool blocks | implementation us | vLLM us | implementation / vLLM |",
            "|---|---|---|---|---|",
        ]
        for mine, theirs in pairs:
            lines.append(
                f"| {mine.block_size} | {mine.pool_blocks:,} | {mine.total:.2f} | "
                f"{theirs.total:.2f} | {mine.total / theirs.total:.2f} |"
            )
    return lines


def run_bench(
    output: str | None,
    json_path: str | None,
    quick: bool,
    vllm: VllmRunner | None = None,
    lockstep: Callable[[], tuple[list[str], list[str], dict[str, Any]]] | None = None,
) -> int:
    """Measure, print the report, write it (markdown to ``output``, JSON to
    ``json_path``). ``vllm`` runs the scheduler trace through vLLM; ``lockstep`` measures
    lockstep throughput (summary lines, section lines, JSON)."""
    device = default_device()
    copies = copy_bandwidth(
        device,
        block_sizes=[16 * KIB, 1024 * KIB] if quick else BLOCK_SIZES,
        batches=[8, 64] if quick else BATCHES,
        budget_s=0.05 if quick else 0.3,
    )
    pools = [10**3, 10**4] if quick else POOL_SIZES
    repeats = 2 if quick else 5
    bench = Bench(
        "kvoffload bench" + (" --quick" if quick else ""),
        copies,
        scheduler_cost(pools, repeats=repeats),
    )
    if vllm is not None:
        data, bench.vllm_note = vllm(pools, SCHEDULER_BLOCK_SIZES, PROMPT_TOKENS, repeats)
        bench.vllm = [] if data is None else vllm_results(data)
    if lockstep is not None:
        summary_lines, section, bench.lockstep = lockstep()
        bench.lockstep_lines = (summary_lines, section)
    text = report(bench)
    if output:
        with open(output, "w") as f:
            f.write(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(bench.to_json(), f, indent=1)
            f.write("\n")
    print(text)
    return 0
