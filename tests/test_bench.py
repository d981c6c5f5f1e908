"""The bench's report: its figures come from what was measured, and the copy target's
verdict is the cases' own (``kvoffload.impl.bench``)."""

from __future__ import annotations

from kvoffload.impl.bench import KIB, Bench, CopyResult, report


def case(batch: int, limit: float, batched: float, loop: float) -> CopyResult:
    return CopyResult(
        "device->host", "host", 64 * KIB, batch, "scattered", limit, batched, limit, 1.0, loop
    )


def test_the_memmove_loop_bounds_what_block_by_block_copying_can_reach() -> None:
    bench = Bench(
        "kvoffload bench",
        [case(8, 10.0, 5.0, 6.0), case(64, 10.0, 9.5, 9.8), case(1, 10.0, 1.0, 1.0)],
        [],
    )
    target = bench.copy_target()
    # batch 1 is outside the target
    assert target["cases"] == 2 and target["cases_below_target"] == 1 and not target["met"]
    assert target["loop_cases_below_target"] == 1
    assert target["min_vs_loop"] == 5.0 / 6.0
    text = report(bench)
    assert "memmove loop GB/s" in text
    assert "| 64 KiB | 8 | scattered | 10.00 | 5.00 | 10.00 | 1.00 | 6.00 | 0.50 |" in text
    assert "under the target in 1 of 2 cases" in text
