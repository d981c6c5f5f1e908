"""Batched block copies between two ``[num_blocks, bytes_per_block]`` tensors.

Pairs ``(src_ids[i], dst_ids[i])`` are grouped into runs that are consecutive on the host
side (the destination when both sides are in the same memory). A run consecutive on both
sides is one slice copy; otherwise the scattered side is gathered or scattered on its own
device in one indexed operation, and the crossing is still one contiguous copy. So a copy
costs one or two operations per run, however fragmented the other side is.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


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


def _consecutive(ids: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(ids))


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst``."""
    if not src_ids:
        return
    to_host = dst.device.type == "cpu"
    host_ids, other_ids = (dst_ids, src_ids) if to_host else (src_ids, dst_ids)
    other = src if to_host else dst
    for start, ids in host_runs(host_ids, other_ids):
        n = len(ids)
        host_slice = slice(start, start + n)
        if _consecutive(ids):
            other_slice = slice(ids[0], ids[0] + n)
            if to_host:
                dst[host_slice].copy_(src[other_slice], non_blocking=True)
            else:
                dst[other_slice].copy_(src[host_slice], non_blocking=True)
            continue
        index = torch.tensor(ids, dtype=torch.long, device=other.device)
        if to_host and src.device == dst.device:
            torch.index_select(src, 0, index, out=dst[host_slice])
        elif to_host:
            dst[host_slice].copy_(src.index_select(0, index), non_blocking=True)
        else:
            staged = src[host_slice].to(dst.device, non_blocking=True)
            dst.index_copy_(0, index, staged)
