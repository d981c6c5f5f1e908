"""The worker: KV bytes in device tensors, copies to and from host memory.

Per KV group, a device tensor ``[num_gpu_blocks, num_layers, bytes_per_block]`` and a host
tensor ``[num_cpu_blocks, num_layers, bytes_per_block]`` (page-locked when CUDA is present):
block-major, so that a block's KV in every layer is one row, as in a cross-layer KV layout.
``gpu_kv[group][layer]`` and ``cpu_kv[group][layer]`` are each layer's
``[num_blocks, bytes_per_block]`` view; ``gpu_rows``/``cpu_rows`` view the rows as int64
words. A transfer is planned once (:class:`kvoffload.impl.copy.CopyPlan`) and run over each
group's rows: one batched operation per run of consecutive ids, no temporary on the host.

On CUDA, copies run on a dedicated lowest-priority stream with one event per transfer; a
store first waits on an event recorded on the compute stream after the step's KV writes
(the race of vLLM #45704); loads wait too, standing in for vLLM's deferred block free.
Without CUDA, :mod:`kvoffload.impl.streams` emulates both streams deterministically.

Data integrity: the bytes are :mod:`kvoffload.impl.content`'s. With checksums on, a
checksum of each CPU block is recorded when it is registered and checked before a load
reads it: a corrupted host block raises :class:`DataIntegrityError` and is never served.

Invariant kept: the tensors a worker allocates are those :func:`block_shape` names, so that
:func:`kv_bytes` is what a world of workers allocates, and :func:`require_kv_fits` refuses a
configuration past ``MAX_KV_BYTES`` before any worker exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvoffload.impl.content import INITIAL_SEED, checksums, layer_bytes, token_seeds
from kvoffload.impl.copy import CopyPlan, mapped_pays, mapped_view, rows
from kvoffload.impl.streams import ComputeStream, CopyEngine, CopyJob, CopyThread, InlineCopies
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, DataIntegrityError
from kvoffload.model.limits import MAX_KV_BYTES, brief


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache: layers per group, bytes per token per layer."""

    num_layers: int = 2
    bytes_per_token: int = 8
    checksums: bool = True
    compute_lag: int = 1


def block_shape(layout: KVLayout, block_size: int) -> tuple[int, int]:
    """One block of a group of ``block_size`` tokens in a worker's tensors: a row per layer
    of ``block_size * bytes_per_token`` bytes (``torch.uint8``)."""
    return layout.num_layers, block_size * layout.bytes_per_token


def kv_bytes(config: OffloadConfig, layout: KVLayout) -> int:
    """The bytes of KV every worker of ``config``'s world allocates in all: per worker, a GPU
    and a CPU tensor per group, of every block of its pool (the null block included)."""
    per_block = sum(
        rows * width for rows, width in (block_shape(layout, s) for s in config.group_block_sizes)
    )
    return config.world_size * (config.gpu_blocks + config.cpu_blocks) * per_block


def require_kv_fits(config: OffloadConfig, layout: KVLayout) -> None:
    """A layout of positive sizes whose KV, in every worker's tensors, is at most
    ``MAX_KV_BYTES``: checked before any tensor is allocated or any copy thread started."""
    for name in ("num_layers", "bytes_per_token"):
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"KVLayout.{name} must be a positive int, got {brief(value)}")
    need = kv_bytes(config, layout)
    if need > MAX_KV_BYTES:
        raise ConfigError(
            f"the KV cache would take {brief(need)} bytes ({config.world_size} workers, each "
            f"with {config.gpu_blocks} GPU and {config.cpu_blocks} CPU blocks per group, "
            f"{brief(layout.num_layers)} layers of {brief(layout.bytes_per_token)} bytes per "
            f"token); at most {MAX_KV_BYTES} (MAX_KV_BYTES)"
        )


class Transfer:
    """One submitted copy: poll with ``done()``, block with ``wait()``."""

    def __init__(
        self,
        job: CopyJob | None = None,
        engine: CopyEngine | None = None,
        event: torch.cuda.Event | None = None,
    ) -> None:
        self._job = job
        self._engine = engine
        self._event = event

    def done(self) -> bool:
        if self._job is not None:
            return self._job.finished
        assert self._event is not None
        return bool(self._event.query())

    def wait(self) -> None:
        if self._job is not None:
            assert self._engine is not None
            self._engine.wait(self._job)
        else:
            assert self._event is not None
            self._event.synchronize()


class Worker:
    """One rank's KV cache and copy engine."""

    def __init__(
        self,
        config: OffloadConfig,
        layout: KVLayout,
        rank: int,
        device: torch.device,
        lockstep: bool = False,
    ) -> None:
        self.config = config
        self.lockstep = lockstep
        self.layout = layout
        self.rank = rank
        self.device = device
        self.cuda = device.type == "cuda"
        layers = layout.num_layers
        # Per group one tensor of every layer, block-major ([blocks, layers, bytes]): a
        # block's KV in every layer is one row, so a transfer is one batched copy per group.
        # (kv_bytes counts these very shapes.)
        shapes = [block_shape(layout, size) for size in config.group_block_sizes]
        self.gpu_blocks = [
            torch.zeros(config.gpu_blocks, *shape, dtype=torch.uint8, device=device)
            for shape in shapes
        ]
        self.cpu_blocks = [
            torch.zeros(config.cpu_blocks, *shape, dtype=torch.uint8) for shape in shapes
        ]
        if self.cuda:
            self.cpu_blocks = [t.pin_memory() for t in self.cpu_blocks]
        # The same rows as machine words (int64 when the row allows): what copies move.
        self.gpu_rows = [rows(t) for t in self.gpu_blocks]
        self.cpu_rows = [rows(t) for t in self.cpu_blocks]
        # On CUDA, the host rows as device tensors over the same page-locked memory, where the
        # device can address it: a transfer whose host blocks are scattered runs as kernels
        # over them instead of one DMA per block (kvoffload.impl.copy.mapped_pays).
        views = [mapped_view(t, device) for t in self.cpu_rows] if self.cuda else []
        self.host_row_bytes = sum(t.shape[1] * t.element_size() for t in self.cpu_rows)
        self.cpu_mapped: list[torch.Tensor] | None = (
            [v for v in views if v is not None] if views and None not in views else None
        )
        # Each layer of each group, [blocks, bytes per block]: views of the rows above.
        self.gpu_kv = [[t[:, layer] for layer in range(layers)] for t in self.gpu_blocks]
        self.cpu_kv = [[t[:, layer] for layer in range(layers)] for t in self.cpu_blocks]
        self.stores: dict[int, Transfer] = {}
        self.loads: dict[int, Transfer] = {}
        self.sums: dict[int, list[int]] = {}
        self._seeds: dict[str, list[int]] = {}
        if self.cuda:
            # Priority 0 is CUDA's lowest: copies yield to compute, as vLLM's do.
            self.copy_stream = torch.cuda.Stream(device=device, priority=0)
        else:
            self.compute = ComputeStream(layout.compute_lag)
            self.copier: CopyEngine = InlineCopies() if lockstep else CopyThread()
            # The thread holds no reference to the worker: a worker dropped without close()
            # still stops its thread when it is collected (issue 16: threads leaked, ~276
            # per 100 programs, and slowed every later example).
            self._stop_copier = weakref.finalize(self, self.copier.stop)

    def close(self) -> None:
        """Stop the copy engine (idempotent): its thread ends once the copies submitted so
        far have run; the worker takes no more transfers."""
        if not self.cuda:
            self._stop_copier()

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, its device and host block tensors (every layer of a block in a row)."""
        return list(zip(self.gpu_blocks, self.cpu_blocks, strict=True))

    # -- compute --------------------------------------------------------------------------

    def begin_step(self) -> None:
        if not self.cuda:
            self.copier.drain()
            self.compute.next_step()

    def end_step(self) -> None:
        """The step has submitted its copies. In lockstep mode they complete now, in the
        copy engine's order (loads first), so that every report is due when it returns."""
        if not self.lockstep:
            return
        if self.cuda:
            self.copy_stream.synchronize()
        else:
            self.copier.drain()

    def seeds(self, request_id: str, tokens: Sequence[int]) -> list[int]:
        known = self._seeds.setdefault(request_id, [])
        if len(known) < len(tokens):
            start = len(known)
            known.extend(token_seeds(tokens[start:], start, known[-1] if known else INITIAL_SEED))
        return known

    def write_tokens(
        self,
        request_id: str,
        tokens: Sequence[int],
        table: Sequence[Sequence[int]],
        start: int,
        end: int,
    ) -> None:
        """Write the KV of tokens ``[start, end)`` into the request's device blocks. A Mamba
        group's state after ``end`` tokens goes into its running state's block alone, whose
        bytes are those of the tokens from that block's start (so that a full state's bytes
        are a function of its key, as a full attention block's)."""
        all_seeds = self.seeds(request_id, tokens)
        bpt = self.layout.bytes_per_token
        for g, size in enumerate(self.config.group_block_sizes):
            tensor = self.gpu_blocks[g]
            first = start
            if self.config.is_mamba(g) and end > start:
                first = (end - 1) // size * size
            seeds = all_seeds[first:end]
            data = layer_bytes(seeds, g, self.layout.num_layers, bpt)
            pos = first
            while pos < end:
                stop = min(end, (pos // size + 1) * size)
                a, b = (pos % size) * bpt, (pos % size + stop - pos) * bpt
                chunk = data[:, (pos - first) * bpt : (stop - first) * bpt]
                self._compute(tensor, table[g][pos // size], a, b, chunk)
                pos = stop

    def _compute(
        self, tensor: torch.Tensor, block: int, a: int, b: int, data: torch.Tensor
    ) -> None:
        if self.cuda:
            tensor[block, :, a:b].copy_(data.to(self.device, non_blocking=True))
        else:

            def write() -> None:
                tensor[block, :, a:b].copy_(data)

            self.compute.enqueue(block, write)

    # -- transfers ------------------------------------------------------------------------

    def submit_load(self, event: int, gpu_ids: Sequence[int], cpu_ids: Sequence[int]) -> None:
        if self.layout.checksums:
            self.check_sums(cpu_ids)
        self.loads[event] = self._launch(cpu_ids, gpu_ids, to_device=True, wait_compute=True)

    def submit_store(self, event: int, gpu_ids: Sequence[int], cpu_ids: Sequence[int]) -> None:
        for cpu_id in cpu_ids:
            self.sums.pop(cpu_id, None)
        self.stores[event] = self._launch(
            gpu_ids, cpu_ids, to_device=False, wait_compute=self.store_waits()
        )

    def store_waits(self) -> bool:
        """A store reads KV only after the step's compute (vLLM #45704)."""
        return True

    def _launch(
        self, src_ids: Sequence[int], dst_ids: Sequence[int], to_device: bool, wait_compute: bool
    ) -> Transfer:
        if self.cuda:
            after_compute = torch.cuda.Event()
            after_compute.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                if wait_compute:
                    self.copy_stream.wait_event(after_compute)
                plan = self._cuda_plan(src_ids, dst_ids, to_device)
                host_rows = self.cpu_rows
                if plan.mapped:
                    assert self.cpu_mapped is not None
                    host_rows = self.cpu_mapped
                for src, dst in self._pairs(host_rows, to_device):
                    plan.run_rows(src, dst)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            return Transfer(event=done)
        compute = self.compute
        marker = compute.record()
        # The CPU emulation: the "device" blocks are host memory too.
        plan = CopyPlan(src_ids, dst_ids, self.device, self.device)
        pairs = self._pairs(self.cpu_rows, to_device)

        # The job holds the streams and tensors, never the worker: a queued job must not keep
        # a dropped worker (and so its copy thread) alive.
        def run() -> None:
            if wait_compute:
                compute.run_until(marker)
            for src, dst in pairs:
                plan.run_rows(src, dst)

        priority = self.copier.LOAD if to_device else self.copier.STORE
        return Transfer(job=self.copier.submit(priority, run), engine=self.copier)

    def _pairs(
        self, host_rows: Sequence[torch.Tensor], to_device: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, the (source, destination) rows of a transfer."""
        return [
            (cpu, gpu) if to_device else (gpu, cpu)
            for gpu, cpu in zip(self.gpu_rows, host_rows, strict=True)
        ]

    def _cuda_plan(
        self, src_ids: Sequence[int], dst_ids: Sequence[int], to_device: bool
    ) -> CopyPlan:
        """The plan of a CUDA transfer: over mapped host memory where that pays."""
        host, device = torch.device("cpu"), self.device
        src_device, dst_device = (host, device) if to_device else (device, host)
        host_ids = src_ids if to_device else dst_ids
        mapped = self.cpu_mapped is not None and mapped_pays(host_ids, self.host_row_bytes)
        return CopyPlan(src_ids, dst_ids, src_device, dst_device, mapped=mapped)

    def wait_store(self, event: int) -> None:
        """Block until this worker's copy of store ``event`` is done (at once if it was
        waited for already)."""
        copy = self.stores.pop(event, None)
        if copy is not None:
            copy.wait()

    def wait_load(self, event: int) -> None:
        copy = self.loads.pop(event, None)
        if copy is not None:
            copy.wait()

    def settle(self) -> set[int]:
        """Finish every copy; return the device blocks whose KV writes are still queued.
        Compute is not forced, so checking bytes does not change what a copy would see."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return set()
        self.copier.drain()
        return self.compute.pending_targets()

    # -- integrity ------------------------------------------------------------------------

    def block_sums(self, cpu_ids: Sequence[int]) -> list[list[int]]:
        """The checksums of each host block of ``cpu_ids``, in every group and layer in that
        order: one gather and one checksum pass per group for the whole batch, not per
        block (a store seals all its blocks at once)."""
        sums: list[list[int]] = [[] for _ in cpu_ids]
        if not sums:
            return sums
        for cpu in self.cpu_blocks:
            layers = cpu.shape[1]
            flat = checksums(cpu[list(cpu_ids)].reshape(len(sums) * layers, -1))
            for k, block in enumerate(sums):
                block += flat[k * layers : (k + 1) * layers]
        return sums

    def seal(self, cpu_ids: Sequence[int]) -> None:
        """Record the checksums of newly registered CPU blocks."""
        if self.layout.checksums:
            self.sums.update(zip(cpu_ids, self.block_sums(cpu_ids), strict=True))

    def _sealed_sums(self, cpu_ids: Sequence[int]) -> list[tuple[int, list[int]]]:
        """The sealed blocks among ``cpu_ids``, in order, each with its checksums now."""
        sealed = [i for i in cpu_ids if i in self.sums]
        return list(zip(sealed, self.block_sums(sealed), strict=True))

    def damaged(self, cpu_ids: Sequence[int]) -> set[int]:
        """The sealed CPU blocks among ``cpu_ids`` whose bytes no longer match their
        checksum (none can be told without checksums)."""
        return {i for i, now in self._sealed_sums(cpu_ids) if now != self.sums[i]}

    def corrupt(self, cpu_id: int) -> None:
        """Damage one sealed host block (an injected fault): flip its bytes in every group's
        first layer, unless they are flipped already (twice would restore them)."""
        if self.damaged([cpu_id]):
            return
        for layers in self.cpu_kv:
            layers[0][cpu_id] ^= 0xFF

    def check_sums(self, cpu_ids: Sequence[int]) -> None:
        for cpu_id, now in self._sealed_sums(cpu_ids):
            if now != self.sums[cpu_id]:
                raise DataIntegrityError(
                    f"worker {self.rank}: cpu block {cpu_id} does not match the checksum "
                    "recorded at its registration; refusing to load it"
                )
