"""Batched block copies between two ``[num_blocks, bytes_per_block]`` tensors.

A transfer's pairs ``(src_ids[i], dst_ids[i])`` are planned once (:class:`CopyPlan`) and the
plan runs over every tensor of the transfer. Rows are viewed as the widest integer type that
divides them (:func:`rows`: int64 for any multiple of 8 bytes), so that each element moved is
a machine word, and each step of the plan is one torch operation that writes straight into
the destination, with no temporary:

- both sides in the same memory (the CPU emulation): the pairs are cut into runs consecutive
  on the destination side (or, when that gives fewer runs, on the source side); a run
  consecutive on both sides is one slice copy, any other one ``index_select`` into the
  destination slice (a gather) or one ``index_copy_`` from the source slice (a scatter);
- across devices (CUDA, the host side pinned or pageable): runs are consecutive on the host
  side, so that each crossing is one contiguous DMA (``copy_(non_blocking=True)`` on the
  caller's stream); a run scattered on the device side is gathered into (or scattered from)
  a staging buffer on the device first, in device memory, where it costs a fraction of the
  crossing.

A crossing whose host side is page-locked may instead run as if both sides were on the device
(``mapped``): page-locked host memory is addressable from the device (unified addressing), so
:func:`mapped_view` gives the host rows as a device tensor over the same memory and the plan's
gathers and scatters are kernels that read or write the host over the bus, one per run
consecutive on either side, however scattered the host blocks are. :func:`mapped_pays` says
when (a host side cut into short runs: one DMA per run costs a DMA's fixed cost per block).

Host memory on both sides with rows of 256 KiB or more, or with the whole transfer one run
consecutive on both sides whatever its rows (fresh blocks of a long prompt, a whole prefix
loaded back), takes a third way: one ``memmove`` of the C library per run consecutive on both
sides (:attr:`CopyPlan.moves`), the limit the bench holds the path to. Measured on a
2-core machine (docs/performance.md): there a torch copy of host memory reaches 0.6 to 0.9
of one ``memmove`` of the same bytes, a loop of ``memmove`` calls 0.95 and more once each
call moves 256 KiB; on smaller rows cut into several runs the loop's per-call cost in Python
outweighs what it saves, and torch's one indexed operation per run is the faster. The ids
are checked against both tensors first, as torch's indexed operations check theirs: a bad id
is an ``IndexError``, never a stray write.

Index tensors are built once per plan from the id lists (``torch.frombuffer`` over an
``array``: a copy of the ids, not a Python-level conversion of each one).
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

# The integer types a row may be viewed as, widest first, with their sizes in bytes.
_WIDEST = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))
# Host to host, memmove is chosen for rows of at least this many bytes: a call's overhead is
# then a few percent of its copy (docs/performance.md).
MEMMOVE_MIN_ROW = 256 * 1024
# Across devices, host runs shorter than this on average (bytes) are copied by a device kernel
# over mapped host memory rather than one DMA each (docs/impl.md "On a GPU").
MAPPED_MAX_RUN = 2 * 1024 * 1024
# __cuda_array_interface__ type strings of the dtypes rows() gives.
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}


def rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``[n, bytes]`` or ``[n, ...]`` of bytes, each row contiguous) viewed as
    ``[n, words]`` of the widest integer type whose size divides the row and the rows'
    offsets. The view shares the tensor's memory."""
    flat = tensor.reshape(tensor.shape[0], -1)
    if flat.dtype != torch.uint8:
        return flat
    width, offset, stride = flat.shape[1], flat.storage_offset(), flat.stride(0)
    for dtype, size in _WIDEST:
        if width % size == 0 and offset % size == 0 and stride % size == 0:
            return flat.view(dtype)
    return flat


def consecutive(ids: Sequence[int]) -> bool:
    """Whether ``ids`` are ``a, a + 1, ..., a + n - 1``."""
    n = len(ids)
    if n == 0 or ids[-1] - ids[0] != n - 1:
        return False
    as_list = ids if isinstance(ids, list) else list(ids)
    return as_list == list(range(ids[0], ids[0] + n))


def host_runs(host_ids: Sequence[int], other_ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Runs ``(host_start, other_ids)`` of pairs whose host ids are consecutive."""
    runs: list[tuple[int, list[int]]] = []
    last = None
    for h, o in zip(host_ids, other_ids, strict=True):
        if runs and last is not None and h == last + 1:
            runs[-1][1].append(o)
        else:
            runs.append((h, [o]))
        last = h
    return runs


class _HostMemory:
    """Page-locked host rows described by ``__cuda_array_interface__``, so that torch makes
    a device tensor over them; it holds the host tensor, which the device tensor holds in
    turn: the memory lives as long as either view."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        size = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(stride * size for stride in host.stride()),
            "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False),
            "version": 2,  # no stream: the caller orders the kernels on its own stream
        }


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``host`` (page-locked rows from :func:`rows`) as a tensor of CUDA ``device`` over the
    same memory, or None where that cannot be: not CUDA, memory not page-locked, a dtype
    :func:`rows` does not give, or a device that cannot address host memory (checked once
    per device by a round trip)."""
    if device.type != "cuda" or not host.is_pinned() or host.dtype not in _TYPESTR:
        return None
    if not _maps_host_memory(device):
        return None
    with torch.cuda.device(device):
        return torch.as_tensor(_HostMemory(host), device=device)


@functools.cache
def _maps_host_memory(device: torch.device) -> bool:
    """Whether kernels on ``device`` read and write page-locked host memory through a
    mapped view: a kernel doubles host words in place and the host sees the result."""
    try:
        host = torch.arange(64, dtype=torch.int64).pin_memory()
        with torch.cuda.device(device):
            view = torch.as_tensor(_HostMemory(host), device=device)
            view.mul_(2)
            torch.cuda.synchronize(device)
        return bool(torch.equal(host, torch.arange(0, 128, 2, dtype=torch.int64)))
    except (RuntimeError, TypeError, ValueError):
        return False


def mapped_pays(host_ids: Sequence[int], row_bytes: int) -> bool:
    """Whether a crossing whose host side is ``host_ids`` runs faster as kernels over mapped
    host memory: the host side is cut into runs averaging under :data:`MAPPED_MAX_RUN`."""
    if not host_ids or consecutive(host_ids):
        return False
    total = len(host_ids) * row_bytes
    # The mean run is under the limit once runs * MAPPED_MAX_RUN > total: counted until
    # then only (a scattered batch answers after a few ids, not after all of them).
    runs = 1
    for a, b in itertools.pairwise(host_ids):
        if b != a + 1:
            runs += 1
            if runs * MAPPED_MAX_RUN > total:
                return True
    return False  # every run counted, and the mean run is not under the limit


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    index = torch.frombuffer(array.array("q", ids), dtype=torch.int64)
    if device.type == "cpu":
        return index
    # Through page-locked memory the copy is queued on the stream, not waited for; torch's
    # page-locked allocator keeps the buffer until the copy has run.
    return index.pin_memory().to(device, non_blocking=True)


class _Step(NamedTuple):
    """One operation: ``n`` pairs from ``start`` on the consecutive side; ``ids`` holds
    the other side's ids (None when they are consecutive too, from ``other_start``)."""

    start: int
    n: int
    other_start: int
    ids: torch.Tensor | None


class CopyPlan:
    """The operations that copy block ``src_ids[i]`` to block ``dst_ids[i]``, built once and
    run over any number of ``(src, dst)`` tensor pairs laid out alike.

    ``src_device``/``dst_device``: where the source and destination blocks live. When both
    are the same device the consecutive side is the destination (``index_select``) or the
    source (``index_copy_``), whichever needs fewer runs; across devices it is the host.
    A batch consecutive on the chosen side as a whole (fresh destination blocks, a long
    prompt's blocks) is planned without looking at its pairs one by one.

    ``mapped``: a crossing whose host side the caller passes to :meth:`run_rows` as a
    :func:`mapped_view`; it is planned and run as a copy within the device."""

    def __init__(
        self,
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
        src_device: torch.device,
        dst_device: torch.device,
        mapped: bool = False,
    ) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
        if mapped and src_device == dst_device:
            raise ValueError(
                f"a mapped plan crosses devices: source and destination are both on {src_device}"
            )
        self.mapped = mapped
        self.crossing = src_device != dst_device and not mapped
        self.host_to_host = src_device == dst_device and src_device.type == "cpu"
        if mapped:  # both sides are addressed on the device
            src_device = dst_device = src_device if src_device.type != "cpu" else dst_device
        self._pairs = (src_ids, dst_ids, src_device, dst_device)

    @functools.cached_property
    def moves(self) -> list[tuple[int, int, int]]:
        """Host to host: the pairs as ``(source start, destination start, blocks)`` runs
        consecutive on both sides, one memmove each (built when first needed)."""
        src_ids, dst_ids, _, _ = self._pairs
        return _moves(src_ids, dst_ids)

    @functools.cached_property
    def _torch_plan(self) -> tuple[bool, list[_Step]]:
        """Whether the steps gather (consecutive on the destination side, indexed on the
        source side) or scatter, and the steps: built when first needed, so that a plan
        that runs as memmoves never builds its index tensors."""
        src_ids, dst_ids, src_device, dst_device = self._pairs
        whole = False  # the consecutive side is consecutive as a whole: one run
        if self.crossing:
            # The host side is consecutive in each run: one contiguous DMA per run.
            gather = dst_device.type == "cpu"
            whole = consecutive(dst_ids if gather else src_ids)
        elif consecutive(dst_ids):
            gather = whole = True
        elif consecutive(src_ids):
            gather, whole = False, True
        else:
            gather = len(host_runs(dst_ids, src_ids)) <= len(host_runs(src_ids, dst_ids))
        here, there = (dst_ids, src_ids) if gather else (src_ids, dst_ids)
        there_device = src_device if gather else dst_device
        runs = [(here[0], list(there))] if whole else host_runs(here, there)
        steps = [
            _Step(start, len(ids), ids[0], None)
            if consecutive(ids)
            else _Step(start, len(ids), 0, _index(ids, there_device))
            for start, ids in runs
        ]
        return gather, steps

    @property
    def gather(self) -> bool:
        """Whether the torch steps gather (index on the source side) or scatter."""
        return self._torch_plan[0]

    @property
    def steps(self) -> list[_Step]:
        """The torch operations of the plan, one per run."""
        return self._torch_plan[1]

    @functools.cached_property
    def _bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The lowest and highest id on each side, source first (checked before memmove)."""
        src_ids, dst_ids, _, _ = self._pairs
        return (
            (min(src_ids, default=0), max(src_ids, default=-1)),
            (min(dst_ids, default=0), max(dst_ids, default=-1)),
        )

    def run(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the planned blocks of ``src`` into ``dst`` (``[num_blocks, ...]`` each, the
        same row shape), on the current stream; non-blocking where the memory allows."""
        self.run_rows(rows(src), rows(dst))

    def run_rows(self, s: torch.Tensor, d: torch.Tensor) -> None:
        """:meth:`run` on tensors already viewed by :func:`rows`."""
        if self.host_to_host and self._memmove(s, d):
            return
        gather, steps = self._torch_plan
        for step in steps:
            here = slice(step.start, step.start + step.n)
            if step.ids is None:
                there = slice(step.other_start, step.other_start + step.n)
                if gather:
                    d[here].copy_(s[there], non_blocking=True)
                else:
                    d[there].copy_(s[here], non_blocking=True)
            elif not self.crossing:
                if gather:
                    torch.index_select(s, 0, step.ids, out=d[here])
                else:
                    d.index_copy_(0, step.ids, s[here])
            elif gather:  # device -> host: gather on the device, one DMA out
                d[here].copy_(s.index_select(0, step.ids), non_blocking=True)
            else:  # host -> device: one DMA in, scatter on the device
                d.index_copy_(0, step.ids, s[here].to(d.device, non_blocking=True))

    def _memmove(self, s: torch.Tensor, d: torch.Tensor) -> bool:
        """Run the plan as memmoves where that is the faster way and the memory allows it
        (host tensors of the same row width, rows packed one after the other): a plan that
        is one run consecutive on both sides, whatever its rows (one call, where torch's
        slice copy costs several times a call's overhead), or rows of
        :data:`MEMMOVE_MIN_ROW` and more; False, having copied nothing, where it is not."""
        row = s.shape[1] * s.element_size()
        src_ids, dst_ids, _, _ = self._pairs
        one_run = consecutive(src_ids) and consecutive(dst_ids)
        if row < MEMMOVE_MIN_ROW and not one_run:
            return False
        if not (_packed(s, row) and _packed(d, row)):
            return False
        if one_run:
            # (checked by its ends, and moved in one call: no pass over the ids)
            bounds = ((src_ids[0], src_ids[-1]), (dst_ids[0], dst_ids[-1]))
            moves = [(src_ids[0], dst_ids[0], len(src_ids))]
        else:
            bounds, moves = self._bounds, self.moves
        sides = zip(("source", "destination"), (s, d), bounds, strict=True)
        for side, tensor, (low, high) in sides:
            if low < 0 or high >= tensor.shape[0]:
                bad = low if low < 0 else high
                raise IndexError(f"{side} block {bad} out of range of {tensor.shape[0]} blocks")
        src, dst = s.data_ptr(), d.data_ptr()
        for a, b, n in moves:
            ctypes.memmove(dst + b * row, src + a * row, n * row)
        return True


def _packed(tensor: torch.Tensor, row: int) -> bool:
    """Host memory, rows of ``row`` bytes each, one right after the other."""
    return (
        tensor.device.type == "cpu"
        and tensor.dim() == 2
        and tensor.shape[1] * tensor.element_size() == row
        and (tensor.shape[0] <= 1 or tensor.stride(0) * tensor.element_size() == row)
        and (tensor.shape[1] <= 1 or tensor.stride(1) == 1)
    )


def _moves(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """The pairs as runs consecutive on both sides: ``(source start, destination start, n)``."""
    moves: list[list[int]] = []
    for a, b in zip(src_ids, dst_ids, strict=True):
        last = moves[-1] if moves else None
        if last is not None and a == last[0] + last[2] and b == last[1] + last[2]:
            last[2] += 1
        else:
            moves.append([a, b, 1])
    return [(a, b, n) for a, b, n in moves]


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst``."""
    if src_ids:
        CopyPlan(src_ids, dst_ids, src.device, dst.device).run(src, dst)
