"""The classes of interleaving (testing/interleavings.py): each read from a crafted sequence of
owed reports and the reports a call made, and none from completions in issue order."""

from __future__ import annotations

from kvoffload.testing.interleavings import (
    LOAD_PASSES_STORE,
    LOADS_OUT_OF_ORDER,
    STORE_PASSES_LOAD,
    STORES_OUT_OF_ORDER,
    WORKERS_APART,
    WORKERS_REVERSED,
    Interleavings,
    reports_of,
)


def _reached(
    *calls: tuple[dict[str, list[tuple[int, int]]], list[tuple[str, int, int]]],
) -> set[str]:
    seen = Interleavings()
    for owed, reports in calls:
        seen.observe(owed, reports)
    return seen.reached


def test_completions_in_issue_order_every_worker_at_once_reach_nothing() -> None:
    owed = {"store": [(0, 0), (1, 0)], "load": []}
    assert _reached((owed, [("store", 0, 0), ("store", 1, 0)])) == set()


def test_a_later_event_completed_first_is_out_of_order() -> None:
    stores = {"store": [(0, 0), (1, 0)], "load": []}
    assert _reached((stores, [("store", 1, 0)])) == {STORES_OUT_OF_ORDER}
    loads = {"store": [], "load": [(3, 0), (4, 0)]}
    assert _reached((loads, [("load", 4, 0), ("load", 3, 0)])) == {LOADS_OUT_OF_ORDER}


def test_across_kinds_issue_order_is_the_steps_and_a_steps_load_goes_first() -> None:
    # a store owed from an earlier call, then a load issued: the load completes first
    before = {"store": [(0, 0)], "load": []}
    after = {"store": [(0, 0)], "load": [(0, 0)]}
    assert _reached((before, []), (after, [("load", 0, 0)])) == {LOAD_PASSES_STORE}
    # one step's load and store: the load is first, so the store completing first passes it
    both = {"store": [(0, 0)], "load": [(0, 0)]}
    assert _reached((both, [("store", 0, 0)])) == {STORE_PASSES_LOAD}
    assert _reached((both, [("load", 0, 0)])) == set()


def test_an_events_workers_apart_and_out_of_rank() -> None:
    owed = {"store": [(0, 0), (0, 1)], "load": []}
    assert _reached((owed, [("store", 0, 1)])) == {WORKERS_APART, WORKERS_REVERSED}
    assert _reached((owed, [("store", 0, 0)])) == {WORKERS_APART}
    assert _reached((owed, [("store", 0, 0), ("store", 0, 1)])) == set()


def test_a_report_not_owed_counts_nothing() -> None:
    owed = {"store": [(0, 0), (1, 0)], "load": []}
    assert _reached((owed, [("store", 1, 5), ("store", 7, 0)])) == set()


def test_the_reports_of_each_call() -> None:
    owed = {"store": [(0, 0)], "load": [(2, 1)]}
    assert reports_of(("store", 0, 0), owed) == [("store", 0, 0)]
    assert reports_of(("fail_store", 0, 0), owed) == [("store", 0, 0)]
    assert reports_of(("load", 2, 1), owed) == [("load", 2, 1)]
    # a drain reports every load owed, then every store (the lockstep's order)
    assert reports_of(("drain",), owed) == [("load", 2, 1), ("store", 0, 0)]
    assert reports_of(("step", 8), owed) == []


def test_the_issue_order_is_the_calls_a_steps_load_first_then_the_ids() -> None:
    seen = Interleavings()
    seen.observe({"store": [(1, 0), (0, 0)], "load": []}, [])
    seen.observe({"store": [(1, 0), (0, 0), (2, 0)], "load": [(0, 0), (0, 1)]}, [])
    assert seen.in_issue_order() == [("store", 0), ("store", 1), ("load", 0), ("store", 2)]
