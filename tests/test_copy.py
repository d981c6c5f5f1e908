"""The copy path: plans that move exactly the paired blocks, on word views of the rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.impl.copy import (
    MAPPED_MAX_RUN,
    CopyPlan,
    consecutive,
    copy_blocks,
    host_runs,
    mapped_pays,
    mapped_view,
    rows,
)

CPU = torch.device("cpu")


@st.composite
def transfers(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    """(blocks per side, bytes per block, source ids, destination ids): distinct ids on each
    side, consecutive runs and scattered ones."""
    blocks = draw(st.integers(1, 24))
    width = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 40]))
    n = draw(st.integers(0, blocks))
    src = draw(st.permutations(range(blocks)))[:n]
    dst = draw(st.permutations(range(blocks)))[:n]
    if draw(st.booleans()):  # fresh destinations, as a store's: consecutive
        start = draw(st.integers(0, blocks - n))
        dst = list(range(start, start + n))
    return blocks, width, list(src), list(dst)


@given(transfers())
def test_a_plan_moves_exactly_the_paired_blocks(
    case: tuple[int, int, list[int], list[int]],
) -> None:
    blocks, width, src_ids, dst_ids = case
    src = torch.arange(blocks * width, dtype=torch.int64).remainder(251).add(1).to(torch.uint8)
    src = src.reshape(blocks, width)
    dst = torch.zeros(blocks, width, dtype=torch.uint8)
    CopyPlan(src_ids, dst_ids, CPU, CPU).run(src, dst)
    expected = torch.zeros_like(dst)
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = src[s]
    assert torch.equal(dst, expected)


def test_rows_are_the_widest_words_the_row_allows() -> None:
    assert rows(torch.zeros(4, 64, dtype=torch.uint8)).dtype == torch.int64
    assert rows(torch.zeros(4, 12, dtype=torch.uint8)).dtype == torch.int32
    assert rows(torch.zeros(4, 6, dtype=torch.uint8)).dtype == torch.int16
    assert rows(torch.zeros(4, 3, dtype=torch.uint8)).dtype == torch.uint8
    # a layer's view inside a block-major tensor: rows 2 * 16 bytes apart, 16 wide
    layers = torch.zeros(4, 2, 16, dtype=torch.uint8)
    view = rows(layers[:, 1])
    assert view.dtype == torch.int64 and view.shape == (4, 2)
    view[3, 1] = -1
    assert layers[3, 1, 8:].eq(255).all() and not layers[3, 0].any()  # the same memory


def test_a_batch_consecutive_on_one_side_is_one_operation() -> None:
    store = CopyPlan([7, 2, 9, 4], [0, 1, 2, 3], CPU, CPU)  # scattered blocks, fresh targets
    assert len(store.steps) == 1 and store.gather and store.steps[0].ids is not None
    load = CopyPlan([0, 1, 2, 3], [7, 2, 9, 4], CPU, CPU)
    assert len(load.steps) == 1 and not load.gather
    prompt = CopyPlan([5, 6, 7], [1, 2, 3], CPU, CPU)
    assert len(prompt.steps) == 1 and prompt.steps[0].ids is None  # one slice copy
    runs = CopyPlan([1, 2, 3, 6, 8], [4, 5, 6, 0, 9], CPU, CPU)
    assert [step.n for step in runs.steps] == [3, 1, 1]


def test_consecutive_ids() -> None:
    assert consecutive([3, 4, 5]) and consecutive([0])
    assert not consecutive([]) and not consecutive([3, 5, 4]) and not consecutive([1, 3, 3])


def test_a_plan_needs_as_many_sources_as_destinations() -> None:
    with pytest.raises(ValueError, match="2 source blocks for 1 destinations"):
        CopyPlan([1, 2], [3], CPU, CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("to_device", [True, False])
def test_plans_across_devices(to_device: bool, pinned: bool) -> None:
    host = torch.arange(8 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 64)
    if pinned:
        host = host.pin_memory()
    dev = torch.zeros(8, 64, dtype=torch.uint8, device="cuda")
    back = torch.zeros_like(host)
    src, dst = (host, dev) if to_device else (dev.copy_(host.flip(0)), back)
    if pinned:
        dst = dst.pin_memory() if dst.device.type == "cpu" else dst
    src_ids, dst_ids = [7, 1, 5, 2, 3], [0, 1, 2, 6, 4]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        copy_blocks(src, dst, src_ids, dst_ids)
    stream.synchronize()
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[d].cpu(), src[s].cpu())


def test_mapped_memory_pays_for_a_host_side_cut_into_short_runs_only() -> None:
    small = 16 * 1024
    assert mapped_pays([7, 2, 9, 4], small)  # scattered host blocks: one DMA each otherwise
    assert not mapped_pays([4, 5, 6, 7], small)  # one run: one DMA
    assert not mapped_pays([], small)
    # Two long runs of large blocks: two DMAs cost no more than kernels would.
    assert not mapped_pays([*range(64), *range(100, 164)], MAPPED_MAX_RUN)
    assert mapped_pays([*range(64), *range(100, 164)], MAPPED_MAX_RUN // 128)


@given(st.lists(st.integers(0, 40), max_size=30), st.sampled_from([1, 4096, 2 * MAPPED_MAX_RUN]))
def test_mapped_memory_pays_where_host_runs_average_under_the_limit(
    host_ids: list[int], row_bytes: int
) -> None:
    runs = len(host_runs(host_ids, host_ids))
    mean_under = bool(host_ids) and len(host_ids) * row_bytes < runs * MAPPED_MAX_RUN
    assert mapped_pays(host_ids, row_bytes) == (mean_under and not consecutive(host_ids))


def test_without_cuda_and_page_locked_memory_there_is_no_mapped_view() -> None:
    host = rows(torch.zeros(4, 64, dtype=torch.uint8))
    assert mapped_view(host, CPU) is None
    if torch.cuda.is_available():  # memory that is not page-locked cannot be mapped
        assert mapped_view(host, torch.device("cuda")) is None


def test_a_mapped_plan_must_cross_devices() -> None:
    with pytest.raises(ValueError, match="a mapped plan crosses devices"):
        CopyPlan([1], [2], CPU, CPU, mapped=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_mapped_view_is_the_page_locked_host_memory_itself() -> None:
    host = rows(torch.zeros(4, 64, dtype=torch.uint8).pin_memory())
    view = mapped_view(host, torch.device("cuda"))
    assert view is not None and view.is_cuda and view.shape == host.shape
    view[2, 3] = -1
    torch.cuda.synchronize()
    assert host[2, 3] == -1 and host.count_nonzero() == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=40, deadline=None)
@given(transfers(), st.booleans())
def test_a_mapped_plan_moves_exactly_the_paired_blocks(
    case: tuple[int, int, list[int], list[int]], to_device: bool
) -> None:
    blocks, width, src_ids, dst_ids = case
    cuda = torch.device("cuda")
    data = torch.arange(blocks * width, dtype=torch.int64).remainder(251).add(1)
    host = data.to(torch.uint8).reshape(blocks, width).pin_memory()
    dev = torch.zeros(blocks, width, dtype=torch.uint8, device=cuda)
    if not to_device:
        dev.copy_(host)
        host.zero_()
    view = mapped_view(rows(host), cuda)
    assert view is not None
    src, dst = (view, rows(dev)) if to_device else (rows(dev), view)
    src_device, dst_device = (CPU, cuda) if to_device else (cuda, CPU)
    CopyPlan(src_ids, dst_ids, src_device, dst_device, mapped=True).run_rows(src, dst)
    torch.cuda.synchronize()
    source = data.to(torch.uint8).reshape(blocks, width)
    target = dev.cpu() if to_device else host
    expected = torch.zeros_like(target)
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = source[s]
    assert torch.equal(target, expected)


def test_host_runs_group_pairs_by_consecutive_host_ids() -> None:
    assert host_runs([1, 2, 3, 7, 9], [5, 9, 6, 0, 1]) == [(1, [5, 9, 6]), (7, [0]), (9, [1])]
    assert host_runs([], []) == []


WIDE = 256 * 1024 // 8  # int64 words in a row of 256 KiB: where host copies take memmove


def _wide(rows: int, fill: bool = True) -> torch.Tensor:
    out = torch.zeros(rows, WIDE, dtype=torch.int64)
    if fill:
        out[:, 0] = torch.arange(1, rows + 1)
        out[:, -1] = -out[:, 0]
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.permutations(range(n)), st.just(n))))
def test_memmove_plans_move_exactly_the_paired_blocks(case: tuple[list[int], int]) -> None:
    order, n = case
    src, dst = _wide(n), _wide(n, fill=False)
    plan = CopyPlan(order, list(range(n)), CPU, CPU)
    assert plan._memmove(src, dst)
    assert torch.equal(dst, src[order])


def test_host_copies_take_memmove_for_wide_packed_rows_only() -> None:
    plan = CopyPlan([4, 5, 0], [0, 1, 5], CPU, CPU)
    assert plan.moves == [(4, 0, 2), (0, 5, 1)]  # runs consecutive on both sides
    src, dst = _wide(6), _wide(6, fill=False)
    assert plan._memmove(src, dst)
    assert torch.equal(dst[[0, 1, 5]], src[[4, 5, 0]]) and not dst[2:5].any()
    # Rows that are not packed one after the other (a layer of a block-major tensor): torch.
    layer = torch.zeros(6, 2, WIDE, dtype=torch.int64)[:, 1]
    assert not plan._memmove(src, layer)
    plan.run_rows(src, layer)
    assert torch.equal(layer[[0, 1, 5]], src[[4, 5, 0]])
    # Narrow rows: torch's indexed operations, one per run.
    assert not plan._memmove(torch.ones(6, 4), torch.zeros(6, 4))
    # Across devices there is nothing to memmove.
    if torch.cuda.is_available():
        assert not CopyPlan([1], [2], CPU, torch.device("cuda")).host_to_host


@pytest.mark.parametrize(("src_ids", "dst_ids"), [([0, 6], [0, 1]), ([0, 1], [1, 9]), ([-1], [0])])
def test_an_id_out_of_range_is_an_index_error_and_copies_nothing(
    src_ids: list[int], dst_ids: list[int]
) -> None:
    src, dst = _wide(6), _wide(6, fill=False)
    with pytest.raises(IndexError, match="out of range of 6 blocks"):
        CopyPlan(src_ids, dst_ids, CPU, CPU).run_rows(src, dst)
    assert not dst.any()
