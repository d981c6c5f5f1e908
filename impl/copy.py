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

Index tensors are built once per plan from the id lists (``torch.frombuffer`` over an
``array``: a copy of the ids, not a Python-level conversion of each one).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

# The integer types a row may be viewed as, widest first, with their sizes in bytes.
_WIDEST = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


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
    return n > 0 and ids[-1] - ids[0] == n - 1 and list(ids) == list(range(ids[0], ids[0] + n))


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


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    index = torch.frombuffer(array.array("q", ids), dtype=torch.int64)
    return index if device.type == "cpu" else index.to(device, non_blocking=True)


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
    prompt's blocks) is planned without looking at its pairs one by one."""

    def __init__(
        self,
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
        src_device: torch.device,
        dst_device: torch.device,
    ) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
        self.crossing = src_device != dst_device
        whole = False  # the consecutive side is consecutive as a whole: one run
        if self.crossing:
            # The host side is consecutive in each run: one contiguous DMA per run.
            self.gather = dst_device.type == "cpu"
            whole = consecutive(dst_ids if self.gather else src_ids)
        elif consecutive(dst_ids):
            self.gather = whole = True
        elif consecutive(src_ids):
            self.gather, whole = False, True
        else:
            self.gather = len(host_runs(dst_ids, src_ids)) <= len(host_runs(src_ids, dst_ids))
        here, there = (dst_ids, src_ids) if self.gather else (src_ids, dst_ids)
        there_device = src_device if self.gather else dst_device
        runs = [(here[0], list(there))] if whole else host_runs(here, there)
        self.steps = [
            _Step(start, len(ids), ids[0], None)
            if consecutive(ids)
            else _Step(start, len(ids), 0, _index(ids, there_device))
            for start, ids in runs
        ]

    def run(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the planned blocks of ``src`` into ``dst`` (``[num_blocks, ...]`` each, the
        same row shape), on the current stream; non-blocking where the memory allows."""
        self.run_rows(rows(src), rows(dst))

    def run_rows(self, s: torch.Tensor, d: torch.Tensor) -> None:
        """:meth:`run` on tensors already viewed by :func:`rows`."""
        for step in self.steps:
            here = slice(step.start, step.start + step.n)
            if step.ids is None:
                there = slice(step.other_start, step.other_start + step.n)
                if self.gather:
                    d[here].copy_(s[there], non_blocking=True)
                else:
                    d[there].copy_(s[here], non_blocking=True)
            elif not self.crossing:
                if self.gather:
                    torch.index_select(s, 0, step.ids, out=d[here])
                else:
                    d.index_copy_(0, step.ids, s[here])
            elif self.gather:  # device -> host: gather on the device, one DMA out
                d[here].copy_(s.index_select(0, step.ids), non_blocking=True)
            else:  # host -> device: one DMA in, scatter on the device
                d.index_copy_(0, step.ids, s[here].to(d.device, non_blocking=True))


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst``."""
    if src_ids:
        CopyPlan(src_ids, dst_ids, src.device, dst.device).run(src, dst)
