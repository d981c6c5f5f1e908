"""vLLM's own offload worker under the machine (issue 33): the worker half of the
SimpleCPUOffload connector, unmodified, driven by the metadata vLLM's own scheduler builds.

:class:`VllmWorkers` is a world of ``world_size`` ranks. Each rank has its emulated device
(:mod:`kvoffload.vllm_target.device`), KV caches planned by vLLM's own planner
(``get_kv_cache_config_from_groups``, the layout a :class:`WorkerLayout` names) and allocated
as vLLM's model runner allocates them (``allocate_kv_cache``), and the connector vLLM's
factory builds in the worker role, registered through ``register_kv_caches`` by vLLM's model
runner glue (``ActiveKVConnector``, which also makes every per-step call in the runner's
order: ``handle_preemptions`` and ``bind_connector_metadata`` before the forward, the load
started after it, ``wait_for_save``, ``get_finished``, ``build_connector_worker_meta``,
``clear_connector_metadata``; ``no_forward`` for a step that computes nothing). The ranks'
outputs are aggregated by vLLM's own ``KVOutputAggregator`` and go back to the scheduler, so
the loop is vLLM's own.

The offloaded blocks live in pinned host memory (vLLM's ``DmaCopyBackend``) or, with the
layout's ``backend="disk"``, in a file of each rank's in a temporary folder of the world's
own (vLLM's ``DiskBackend``, its IO threads run by the host like the copy thread), removed
with the world (:meth:`VllmWorkers.close`).

The forward is emulated on each rank's compute stream: for every request the step computes,
it reads the KV of the context before the step's tokens (every layer of every group, from
the blocks of the request's table) and writes the KV of the step's tokens, both when the
compute stream runs. Bytes are :mod:`kvoffload.model.content`'s, per rank (each rank holds
its own heads). A forward that reads a position whose bytes are not its token's KV is wrong
KV served; it is reported with the step (:meth:`VllmWorkers.served_wrong`).

The device progresses as a step's plan (:class:`Plan`) says: the copy thread launches what
was queued, then, just before the worker polls its events (``get_finished``), the device
completes the planned transfers (each rank's streams run in order, a stream's work after
its waits); the compute stream runs at the end of the step (the host reads the forward's
output). Work a plan leaves stays queued to later steps.

Invariants kept: the emulation is the process's for good once a world is built (vLLM's
worker runs in a release environment's process that does nothing else); each rank's calls
run with its device current and its connector the process's connector agent.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import os
import shutil
import tempfile
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvoffload.model.config import OffloadConfig
from kvoffload.model.content import token_kv, token_seeds
from kvoffload.model.errors import InvalidArgumentError
from kvoffload.vllm_target.device import (
    Device,
    EmulatedQueue,
    EmulatedThread,
    Host,
    Work,
    activate,
    install,
)

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM's KVCacheLayout
BACKENDS = ("cpu", "disk")  # where the offloaded blocks live (vLLM's kv_offload_backend)


# The layouts vLLM's planner takes for groups of several page sizes (blocks of another token
# count): block-outer and block-compact ones only ("cannot express this model's mixed page
# sizes", from its validate_kv_cache_layout).
MIXED_PAGE_LAYOUTS = ("BLHNC", "BLNHC")
# The bounds of a layout (a failure file or an argument can ask for no more)
MAX_LAYERS, MAX_HEADS, MAX_HEAD_SIZE = 4, 4, 64


class WorkerLayout(NamedTuple):
    """How each rank's KV caches are laid out: layers per KV group, KV heads per layer,
    head size (fp16 elements), vLLM's physical layout by name (layer- or block-outer, heads
    inside or outside a block), and where the offloaded blocks live."""

    layers: int = 2
    heads: int = 1
    head_size: int = 4
    layout: str = "LBHNC"
    # "cpu": blocks in pinned host memory (DmaCopyBackend); "disk": in a file of each rank's,
    # in a temporary folder, through pinned staging buffers (DiskBackend, page cache on)
    backend: str = "cpu"

    def problem(self) -> str | None:
        """What is wrong with this layout, or None."""
        for name, value, most in (
            ("layers", self.layers, MAX_LAYERS),
            ("heads", self.heads, MAX_HEADS),
            ("head_size", self.head_size, MAX_HEAD_SIZE),
        ):
            if type(value) is not int or not 1 <= value <= most:
                return f"{name} must be an int from 1 to {most}, got {value!r}"
        if self.layout not in LAYOUTS:
            return f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}"
        if self.backend not in BACKENDS:
            return f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
        return None


def completes_at_once(layout: WorkerLayout | None) -> bool:
    """Whether every transfer completes in the step that issues it: the disk backend's IO
    threads wait for each staging copy and write or read the file themselves, all before
    the worker polls (the threads keep up with the host)."""
    return layout is not None and layout.backend == "disk"


def layouts_for(config: OffloadConfig) -> tuple[str, ...]:
    """The layouts vLLM's planner lays ``config``'s groups out in."""
    return MIXED_PAGE_LAYOUTS if len(set(config.group_block_sizes)) > 1 else LAYOUTS


@dataclass(frozen=True)
class Plan:
    """What the device completes in a step before the worker polls: everything, or each
    rank's transfers up to the events named (the load events of every rank, the store
    events per rank); a stream runs in order, so an event completes those before it."""

    everything: bool = True
    loads: frozenset[int] = frozenset()
    stores: Mapping[int, frozenset[int]] = field(default_factory=dict)


@dataclass
class _Slot:
    """Where one token position of a block lives in one layer: the layer's byte view
    ``[B, H, N, C]`` (its address arithmetic), per head the byte offset from the block's
    start, and the worker's block region that holds it (name, offset in its row)."""

    base: int
    block_stride: int
    head_offsets: tuple[int, ...]
    content: int  # bytes per head
    regions: tuple[tuple[str, int] | None, ...]  # per head


@dataclass
class Rank:
    """One rank of the world: its device, vLLM's connector in the worker role and the
    model runner's glue around it, and where each position of a block lives."""

    rank: int
    device: Device
    connector: Any
    glue: Any
    # per group, per layer, per position in a block: where it lives
    slots: list[list[list[_Slot]]]

    @property
    def handler(self) -> Any:
        return self.connector.worker_handler


def _emulation_patches() -> list[tuple[Any, str, Any]]:
    """What vLLM's worker modules take from the machine, pointed at the emulation: pinned
    memory available, the copy and disk backends' threads and queues run by the host, the
    batch copy resolved anew, the device set by the emulated thread itself."""
    import vllm.v1.simple_kv_offload.copy_backend as copy_backend
    import vllm.v1.simple_kv_offload.cuda_mem_ops as cuda_mem_ops
    import vllm.v1.simple_kv_offload.disk_backend as disk_backend
    import vllm.v1.simple_kv_offload.worker as worker_module
    from vllm.platforms import current_platform

    return [
        (worker_module, "PIN_MEMORY", True),
        (copy_backend, "queue", types.SimpleNamespace(SimpleQueue=EmulatedQueue)),
        (copy_backend, "threading", types.SimpleNamespace(Thread=EmulatedThread)),
        (disk_backend, "queue", types.SimpleNamespace(SimpleQueue=EmulatedQueue)),
        (disk_backend, "threading", types.SimpleNamespace(Thread=EmulatedThread)),
        (cuda_mem_ops, "_batch_memcpy", None),
        (current_platform, "set_device", lambda device: None),
    ]


class VllmWorkers:
    """vLLM's offload worker on every rank of ``config``'s world, over KV caches laid out as
    ``layout`` says, beside the scheduler whose ``vllm_config`` it shares."""

    def __init__(self, config: OffloadConfig, vllm_config: Any, layout: WorkerLayout) -> None:
        if (problem := layout.problem()) is not None:
            raise InvalidArgumentError(f"bad worker layout: {problem}")
        import torch
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
            SimpleCPUOffloadConnector,
        )
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.utils import allocate_kv_cache

        install(_emulation_patches())
        self.config, self.layout = config, layout
        # the disk backend's files, one a rank, in a folder of the world's own
        self.folder = (
            tempfile.mkdtemp(prefix="kvoffload-disk-") if layout.backend == "disk" else None
        )
        self._cleanup = weakref.finalize(self, _remove, self.folder)
        self.host = Host()
        activate(self.host)
        self.plan = Plan()
        self._wrong: list[str] = []
        cache = vllm_config.cache_config
        cache.kv_cache_layout = layout.layout
        cache.num_gpu_blocks_override = config.gpu_blocks
        groups = [
            KVCacheGroupSpec(
                [f"layer.{g}.{n}" for n in range(layout.layers)],
                FullAttentionSpec(
                    block_size=size,
                    num_kv_heads=layout.heads,
                    head_size=layout.head_size,
                    dtype=torch.float16,
                ),
            )
            for g, size in enumerate(config.group_block_sizes)
        ]
        self.aggregator = KVOutputAggregator(config.world_size)
        self.ranks: list[Rank] = []
        for rank in range(config.world_size):
            device = self.host.device(rank)
            device.make_current()
            try:
                kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)
            except (AssertionError, ValueError) as error:
                raise InvalidArgumentError(
                    f"vLLM's planner refuses the layout {layout}: {error}"
                ) from error

            caches = allocate_kv_cache(
                kv_cache_config, torch.device("cpu"), KVCacheLayout[layout.layout], None
            )
            # (the backing allocations, the device's memory)
            storages = {
                (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                for t in caches.values()
            }
            for start, size in sorted(storages):
                device.allocate(start, size)
            with self._backend_config(vllm_config, rank):
                connector = SimpleCPUOffloadConnector(
                    vllm_config, KVConnectorRole.WORKER, kv_cache_config
                )
            self._as_agent(connector)
            glue = ActiveKVConnector(vllm_config, caches)
            self._hook(connector.worker_handler, rank)
            slots = self._slots(caches, connector.worker_handler, groups)
            self.ranks.append(Rank(rank, device, connector, glue, slots))
            self.host.run_threads()

    # -- the step ---------------------------------------------------------------------------

    def step(
        self,
        output: Any,
        requests: Mapping[str, Any],
        tables: Mapping[str, Sequence[Sequence[int]]],
        plan: Plan,
    ) -> Any:
        """Every rank's part of the step vLLM's scheduler scheduled (``output``): the
        connector's calls in the model runner's order around the emulated forward of the
        ``requests`` it computes over their block ``tables`` (as scheduled), the device
        progressing as ``plan`` says; the ranks' connector outputs, aggregated."""
        from vllm.v1.outputs import ModelRunnerOutput

        activate(self.host)
        self.plan = plan
        outputs = []
        for rank in self.ranks:
            rank.device.make_current()
            self._as_agent(rank.connector)
            if output.total_num_scheduled_tokens == 0:
                outputs.append(rank.glue.no_forward(output))
            else:
                batch = types.SimpleNamespace(
                    idx_mapping=None,
                    req_ids=list(output.num_scheduled_tokens),
                    num_tokens=output.total_num_scheduled_tokens,
                )
                rank.glue.pre_forward(output, batch)
                self._forward(rank, output, requests, tables)
                rank.glue.finish_forward()
                connector_output = rank.glue.post_forward(output.finished_req_ids)
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(connector_output))
        # Each rank's output reaches vLLM's executor as a copy (over IPC from the worker's
        # process): the aggregator writes its result into rank 0's, which here could be the
        # model runner's shared EMPTY_MODEL_RUNNER_OUTPUT (an empty connector output) and
        # would carry this step's reports into every later step's.
        merged = self.aggregator.aggregate([copy.deepcopy(o) for o in outputs])
        return None if merged is None else merged.kv_connector_output

    def end_step(self) -> None:
        """The step's output taken: the host read the forward's sampled tokens, so every
        forward has run (vLLM's engine schedules the next step after it takes this one's
        output; the copy streams are not waited for, and keep what they have queued)."""
        for rank in self.ranks:
            compute = rank.device.current_stream
            rank.device.run_until(compute, compute.issued)

    def served_wrong(self) -> list[str]:
        """The wrong KV the forwards read since the last call (then forgotten)."""
        wrong, self._wrong = self._wrong, []
        return wrong

    def _forward(
        self,
        rank: Rank,
        output: Any,
        requests: Mapping[str, Any],
        tables: Mapping[str, Sequence[Sequence[int]]],
    ) -> None:
        """Queue on ``rank``'s compute stream, per request the step computes, the reads of
        its context and the writes of its new tokens, every layer of every group."""
        for rid, count in output.num_scheduled_tokens.items():
            request = requests[rid]
            end = request.num_computed_tokens
            start = end - count
            tokens = list(request.all_token_ids)[:end]
            seeds = token_seeds(tokens)
            table = [list(ids) for ids in tables[rid]]
            work = functools.partial(self._compute, rank, rid, seeds, start, end, table)
            written = frozenset(
                ids[pos // size]
                for ids, size in zip(table, self.config.group_block_sizes, strict=True)
                for pos in range(start, end)
                if pos // size < len(ids)
            )
            rank.device.current_stream.enqueue(
                Work(f"forward of {rid} on rank {rank.rank}", work, blocks=written)
            )

    def _compute(
        self,
        rank: Rank,
        rid: str,
        seeds: list[int],
        start: int,
        end: int,
        table: list[list[int]],
    ) -> None:
        """The forward of one request, when the compute stream runs it: its first wrong
        read is reported, and every write lands."""
        reported = False
        for group, ids in enumerate(table):
            size = self.config.group_block_sizes[group]
            for layer, by_position in enumerate(rank.slots[group]):
                for pos in range(end):
                    index = pos // size
                    if index >= len(ids):
                        break
                    block, slot = ids[index], by_position[pos % size]
                    want = _token(seeds[pos], group, layer, slot, rank.rank)
                    if pos >= start:
                        _write(slot, block, want)
                    elif not reported and _read(slot, block) != want:
                        self._wrong.append(
                            f"worker {rank.rank}: the forward of {rid} reads position {pos} "
                            f"of group {group} layer {layer} in GPU block {block}, which does "
                            "not hold its KV"
                        )
                        reported = True

    # -- the bytes at rest ------------------------------------------------------------------

    def mismatches(
        self,
        gpu: Sequence[tuple[int, int, list[int]]],
        cpu: Sequence[tuple[int, int, list[int]]],
    ) -> list[str]:
        """Every block of ``gpu`` and ``cpu`` ((block, group, the tokens of its key)) whose
        bytes on some rank are not its key's KV; GPU blocks a queued write is still to fill
        are passed over, as are CPU blocks of a copy not yet run."""
        problems: list[str] = []
        for rank in self.ranks:
            busy, held = self._busy(rank), self._cpu_side(rank)
            for side, blocks in (("gpu", gpu), ("cpu", cpu)):
                for block, group, tokens in blocks:
                    if block in busy[side]:
                        continue
                    found = self._block_mismatch(rank, side, block, group, tokens, held)
                    if found is not None:
                        problems.append(found)
        return problems

    @staticmethod
    def _busy(rank: Rank) -> dict[str, set[int]]:
        """Per side, the blocks queued work is still to write: the forwards' GPU blocks, and
        the blocks of every region a queued copy writes in."""
        busy = {"gpu": rank.device.pending_blocks(), "cpu": set()}
        handler = rank.handler
        writes = rank.device.pending_writes()
        if not writes:
            return busy
        # (the disk backend's blocks are in its file, written by its threads, never queued)
        sides = (("gpu", handler.gpu_kv_caches), ("cpu", handler.cpu_kv_caches or {}))
        for side, regions in sides:
            for region in regions.values():
                base, row = region.data_ptr(), region.stride(0) * region.element_size()
                for address, size in writes:
                    first = max(0, (address - base) // row)
                    last = min(region.shape[0] - 1, (address + size - 1 - base) // row)
                    busy[side].update(range(first, last + 1))
        return busy

    def _block_mismatch(
        self,
        rank: Rank,
        side: str,
        block: int,
        group: int,
        tokens: list[int],
        cpu: Callable[[str, int, int, int], bytes],
    ) -> str | None:
        """Where ``block`` of ``side`` on ``rank`` does not hold the KV of the key of
        ``tokens`` in ``group`` (its first wrong layer and position), or None; ``cpu`` reads
        the CPU side's blocks."""
        size = self.config.group_block_sizes[group]
        seeds = token_seeds(tokens)[-size:]
        for layer, by_position in enumerate(rank.slots[group]):
            for pos, (seed, slot) in enumerate(zip(seeds, by_position, strict=True)):
                want = _token(seed, group, layer, slot, rank.rank)
                have = _read(slot, block) if side == "gpu" else _read_cpu(slot, cpu, block)
                if have != want:
                    return (
                        f"worker {rank.rank} {side} block {block} layer {layer} does not hold "
                        f"the KV of its key (position {pos} of the block)"
                    )
        return None

    def _cpu_side(self, rank: Rank) -> Callable[[str, int, int, int], bytes]:
        """How to read ``size`` bytes at ``offset`` of region ``name``'s row of CPU block
        ``block`` on ``rank``: from the pinned host tensors, or with the disk backend from
        its file as it is now, read once (a block's slot holds each region's row, one after
        the other, in the order of the worker's regions)."""
        handler = rank.handler
        if handler.cpu_kv_caches is not None:
            tensors = handler.cpu_kv_caches

            def from_memory(name: str, block: int, offset: int, size: int) -> bytes:
                tensor = tensors[name]
                row = tensor.stride(0) * tensor.element_size()
                return ctypes.string_at(tensor.data_ptr() + block * row + offset, size)

            return from_memory
        assert self.folder is not None
        (path,) = (
            entry.path for entry in os.scandir(os.path.join(self.folder, f"rank{rank.rank}"))
        )
        starts, at = {}, 0
        for name, region in handler.gpu_kv_caches.items():
            starts[name] = at
            at += region.stride(0) * region.element_size()
        with open(path, "rb") as file:
            held = file.read()  # (one read a check: the file is the CPU pool's blocks)

        def from_disk(name: str, block: int, offset: int, size: int) -> bytes:
            start = block * at + starts[name] + offset
            return held[start : start + size]

        return from_disk

    # -- building ---------------------------------------------------------------------------

    def _slots(self, caches: Mapping[str, Any], handler: Any, groups: Sequence[Any]) -> Any:
        """Per group, layer and position in a block, where the runner's view places its
        bytes, and the region of the worker's (``gpu_kv_caches``) whose row holds them."""
        import torch

        regions = [
            (name, region.data_ptr(), region.stride(0) * region.element_size())
            for name, region in handler.gpu_kv_caches.items()
        ]
        out = []
        for group in groups:
            per_layer = []
            for name in group.layer_names:
                view = caches[name].view(torch.uint8)  # [B, H, N, C] in bytes
                strides = view.stride()
                content = view.shape[3]
                by_position = []
                for n in range(view.shape[2]):
                    offsets = tuple(h * strides[1] + n * strides[2] for h in range(view.shape[1]))
                    at = tuple(_region_of(regions, view.data_ptr() + o, content) for o in offsets)
                    by_position.append(_Slot(view.data_ptr(), strides[0], offsets, content, at))
                per_layer.append(by_position)
            out.append(per_layer)
        return out

    def _hook(self, handler: Any, rank: int) -> None:
        """Just before the worker polls its events: the copy thread launches what was
        queued, and the device completes what the step's plan says (time passing between
        two of the host's calls)."""
        poll = handler.get_finished

        def get_finished(finished_req_ids: set[str]) -> Any:
            self.host.run_threads()
            self._progress(self.host.device(rank), handler)
            return poll(finished_req_ids)

        handler.get_finished = get_finished

    def _progress(self, device: Device, handler: Any) -> None:
        if self.plan.everything:
            device.run_copies()
            return
        planned = (
            (handler._load_events, self.plan.loads),
            (handler._store_events, self.plan.stores.get(device.index, frozenset())),
        )
        for events, wanted in planned:
            last = [event for idx, event in events if idx in wanted]
            if last:
                last[-1].synchronize()

    @contextlib.contextmanager
    def _backend_config(self, vllm_config: Any, rank: int) -> Iterator[None]:
        """The worker-role connector of ``rank`` built with the backend of the layout: the
        disk backend's file in the world's folder (a path per rank: vLLM names it by the
        device's index, which CPU tensors lack), the page cache on (O_DIRECT wants 4 KiB
        blocks)."""
        if self.folder is None:
            yield
            return
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        vllm_config.kv_transfer_config = dataclasses.replace(
            transfer,
            kv_connector_extra_config=extra
            | {
                "kv_offload_backend": "disk",
                "disk_path": os.path.join(self.folder, f"rank{rank}", "kv"),
                "use_page_cache": True,
            },
        )
        try:
            yield
        finally:
            vllm_config.kv_transfer_config = transfer

    def close(self) -> None:
        """Shut every rank's backend down (its threads stop, the disk files go) and remove
        the world's folder."""
        for rank in self.ranks:
            backend = rank.handler._backend
            if backend is not None:
                backend.shutdown()
        self._cleanup()

    @staticmethod
    def _as_agent(connector: Any) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        kv_transfer_state._KV_CONNECTOR_AGENT = connector


def _remove(folder: str | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _region_of(
    regions: Sequence[tuple[str, int, int]], address: int, size: int
) -> tuple[str, int] | None:
    """The worker's region whose row of block 0 holds ``[address, address + size)``, and
    the offset in that row; None where no region's row holds it."""
    for name, base, row in regions:
        if base <= address and address + size <= base + row:
            return name, address - base
    return None


@functools.lru_cache(maxsize=1 << 16)
def _token_kv(seed: int, group: int, layer: int, size: int, rank: int) -> bytes:
    return token_kv(seed, group, layer, size, rank)


def _token(seed: int, group: int, layer: int, slot: _Slot, rank: int) -> bytes:
    """The token's KV in one layer of one rank: every head's part, one after the other."""
    return _token_kv(seed, group, layer, slot.content * len(slot.head_offsets), rank)


def _read(slot: _Slot, block: int) -> bytes:
    start = slot.base + block * slot.block_stride
    return b"".join(ctypes.string_at(start + o, slot.content) for o in slot.head_offsets)


def _write(slot: _Slot, block: int, data: bytes) -> None:
    start = slot.base + block * slot.block_stride
    for h, o in enumerate(slot.head_offsets):
        part = data[h * slot.content : (h + 1) * slot.content]
        ctypes.memmove(start + o, part, slot.content)


def _read_cpu(slot: _Slot, cpu: Callable[[str, int, int, int], bytes], block: int) -> bytes:
    """The bytes of ``slot`` in CPU ``block``, each head from its region's row (nothing for
    a head no region holds: never copied, never its KV)."""
    parts = []
    for region in slot.regions:
        if region is None:
            return b""
        name, offset = region
        parts.append(cpu(name, block, offset, slot.content))
    return b"".join(parts)
