"""The offload scheduler: eager stores, skip rules, capacity, final flush, completion,
multi-worker accumulation, reset, loads. Every model checks every invariant after every
call (``helpers.make``)."""

from __future__ import annotations

import pytest

from kvoffload.model import NO_EVENT, DuplicateCompletionError, OffloadConfig, OffloadModel
from kvoffload.model.keys import block_keys, fine_key, prefix_digests
from kvoffload.model.offload import Disposition
from kvoffload.model.types import CLEARED, REMOVED, STORED, KVEvent

from helpers import complete_all_stores, drain, make, prompt


def test_a_block_is_stored_one_step_after_it_is_computed() -> None:
    model = make()
    model.add_request("r", prompt(40), max_tokens=4)
    assert model.step(16).metadata.store_event == NO_EVENT
    second = model.step(16).metadata
    assert (second.store_event, second.store_gpu_blocks, second.store_cpu_blocks) == (0, (1,), (1,))
    third = model.step(16).metadata
    assert (third.store_event, third.store_gpu_blocks) == (1, (2,))


def test_final_flush_stores_what_no_scan_reached_33_token_repeat_hits_32() -> None:
    """The reference scenario of vLLM #53498: finish right after the prompt is computed."""
    model = make()
    tokens = prompt(33)
    model.add_request("r", tokens, max_tokens=1)
    result = model.step(64)
    assert result.finished == ("r",) and result.metadata.store_event == NO_EVENT
    snap = model.snapshot()
    assert [(t.gpu_block_ids, t.cpu_block_ids) for t in snap.pending_flushes] == [((1, 2), (1, 2))]
    assert snap.in_flight_gpu_blocks == (1, 2) and model.has_pending_stores()
    assert model.lookup(tokens) == 0  # nothing is reachable before the store completes
    submitted = model.step(0).metadata
    assert (submitted.store_event, submitted.store_gpu_blocks) == (0, (1, 2))
    assert model.snapshot().pending_flushes == () and model.has_pending_stores()
    assert model.complete_store(0) is True
    assert not model.has_pending_stores()
    assert model.lookup(tokens) == 32


def test_finish_returns_the_flush_it_queued() -> None:
    model = make()
    model.add_request("r", prompt(40), max_tokens=9)
    model.step(40)
    flush = model.finish("r")
    assert (flush.flush_gpu_blocks, flush.flush_cpu_blocks) == ((1, 2), (1, 2))


def test_queued_flushes_ride_on_the_next_steps_store_event() -> None:
    model = make()
    model.add_request("a", prompt(32, 1), max_tokens=1)
    model.add_request("b", prompt(40, 2), max_tokens=3)
    model.step(48)  # a computes 32 and finishes (flush of 2 blocks); b computes 16
    meta = model.step(48).metadata  # b's block 0 is confirmed now
    snap = model.snapshot()
    b_blocks = snap.requests[1].block_ids[0]
    # One event: this step's regular store first, then the queued flush.
    assert meta.store_event == 0
    assert meta.store_gpu_blocks == (b_blocks[0], 1, 2)
    assert snap.store_event_requests == ((0, ("b",)),)  # the flush has no request


def test_scan_skips_a_block_whose_key_is_already_in_the_cpu_map() -> None:
    model = make()
    tokens = prompt(40)
    model.add_request("a", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    cpu_before = model.snapshot().cpu
    model.add_request("b", tokens, max_tokens=4)
    for _ in range(3):
        assert model.step(64).metadata.store_event == NO_EVENT
    assert model.snapshot().cpu.cached == cpu_before.cached
    marks = model.engine.connector.dispositions["b"][0]
    assert marks == {0: Disposition.PRESENT, 1: Disposition.PRESENT}


def test_scan_skips_a_gpu_block_already_in_flight() -> None:
    model = make(group_block_sizes=(4,))
    tokens = prompt(8)
    model.add_request("a", tokens, max_tokens=5)
    model.step(8)
    model.add_request("b", tokens, max_tokens=2)
    # New requests are scanned before running ones: b selects the block it shares with a,
    # and a's scan then finds it in flight.
    model.step(8)
    marks = model.engine.connector.dispositions
    assert marks["b"][0] == {0: Disposition.STORED}
    assert marks["a"][0] == {0: Disposition.IN_FLIGHT, 1: Disposition.STORED}


def test_selection_stops_at_cpu_capacity_and_retries_later() -> None:
    model = make(cpu_blocks=3)  # two usable CPU blocks
    model.add_request("r", prompt(64), max_tokens=8)
    model.step(16)
    assert model.step(16).metadata.store_gpu_blocks == (1,)
    assert model.step(16).metadata.store_gpu_blocks == (2,)
    assert model.step(16).metadata.store_event == NO_EVENT  # block 3 is confirmed, no room
    assert model.snapshot().tracked[0].num_stored_blocks == (2,)
    complete_all_stores(model)
    retried = model.step(16).metadata  # blocks 3 and 4 are both confirmed by now
    assert retried.store_gpu_blocks == (3, 4) and retried.store_cpu_blocks == (1, 2)


def test_final_flush_respects_capacity_and_drops_the_rest() -> None:
    model = make(cpu_blocks=3)
    model.add_request("r", prompt(65), max_tokens=1)
    model.step(80)
    (flush,) = model.snapshot().pending_flushes
    assert flush.gpu_block_ids == (1, 2)
    record = model.engine.finish_records[-1]
    assert record.confirmed_blocks == (4,)
    assert record.dispositions[0] == {
        0: Disposition.STORED,
        1: Disposition.STORED,
        2: Disposition.DROPPED_CAPACITY,
        3: Disposition.DROPPED_CAPACITY,
    }


def test_final_flush_skips_blocks_already_in_the_cpu_map() -> None:
    model = make()
    tokens = prompt(48)
    model.add_request("a", [*tokens[:32], 1], max_tokens=1)
    model.step(64)
    drain(model)  # the first two blocks of tokens are in the CPU pool
    model.add_request("b", [*tokens, 1], max_tokens=1)
    model.step(64)
    (flush,) = model.snapshot().pending_flushes
    b_blocks = model.snapshot().requests[1].block_ids
    assert b_blocks == ()  # b finished; its third block is the only one flushed
    assert len(flush.gpu_block_ids) == 1
    marks = model.engine.finish_records[-1].dispositions[0]
    assert marks == {0: Disposition.PRESENT, 1: Disposition.PRESENT, 2: Disposition.STORED}


def test_completion_registers_primary_with_tokens_and_secondary_keys() -> None:
    model = make(group_block_sizes=(4,), hash_block_size=2)
    tokens = prompt(10)
    model.add_request("r", tokens, max_tokens=3)
    for _ in range(5):
        model.step(4)
    drain(model)
    req = model.engine.requests["r"]
    keys = block_keys(req.digests, 0, 4, 2)
    tail = fine_key(prefix_digests(tokens, 2), 4, 0, 2)
    cpu = model.snapshot().cpu
    stored = {b.primary: b for b in cpu.blocks if b.primary is not None}
    assert set(stored) == set(keys)
    assert [stored[k].primary_tokens for k in keys] == [4, 8, 12]
    assert stored[keys[2]].secondary == (tail,)
    assert all(b.ref_cnt == 0 for b in stored.values())
    assert dict(cpu.cached)[tail] == (stored[keys[2]].block_id,)


def test_store_completes_only_when_every_worker_reported() -> None:
    model = make(world_size=2)
    tokens = prompt(33)
    model.add_request("r", tokens, max_tokens=1)
    model.step(64)
    model.step(0)
    assert model.complete_store(0, worker=1) is False
    snap = model.snapshot()
    assert snap.store_event_pending_counts == ((0, 1),) and model.lookup(tokens) == 0
    with pytest.raises(DuplicateCompletionError, match="worker 1 already reported store event 0"):
        model.complete_store(0, worker=1)
    assert model.snapshot() == snap
    assert model.complete_store(0, worker=0) is True
    assert model.lookup(tokens) == 32
    with pytest.raises(DuplicateCompletionError):
        model.complete_store(0, worker=0)


def test_reset_abandons_in_flight_stores_which_then_never_register() -> None:
    model = make()
    tokens = prompt(33)
    model.add_request("r", tokens, max_tokens=1)
    model.step(64)
    model.step(0)
    assert model.reset() is False
    snap = model.snapshot()
    assert [v.event for v in snap.abandoned_store_events] == [0]
    assert snap.in_flight_gpu_blocks == () and model.has_pending_stores()
    model.complete_store(0)
    snap = model.snapshot()
    assert model.lookup(tokens) == 0 and snap.cpu.cached == ()
    assert snap.cpu.free_queue[:2] == (1, 2)  # released hashless blocks go to the head
    assert not model.has_pending_stores()
    assert model.reset() is True


def test_reset_releases_queued_flushes_and_clears_an_idle_cpu_pool() -> None:
    model = make()
    model.add_request("r", prompt(33), max_tokens=1)
    model.step(64)
    assert model.snapshot().pending_flushes
    assert model.reset() is True  # nothing was sent, so nothing is abandoned
    snap = model.snapshot()
    assert snap.pending_flushes == () and snap.in_flight_gpu_blocks == ()
    assert not model.has_pending_stores()
    assert all(b.ref_cnt == 0 for b in snap.gpu.blocks[1:])


def test_reset_returns_true_and_forgets_every_cpu_key_when_idle() -> None:
    model = make()
    tokens = prompt(33)
    model.add_request("r", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    assert model.lookup(tokens) == 32
    assert model.reset() is True
    assert model.lookup(tokens) == 0 and model.snapshot().cpu.cached == ()
    model.add_request("s", prompt(33, 3), max_tokens=1)
    model.step(64)
    assert model.step(0).metadata.store_event == 1  # counters are never reset


def test_load_path_pins_loads_and_refreshes_cpu_blocks() -> None:
    tokens = prompt(40)
    model = make(gpu_blocks=5)
    model.add_request("a", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    model.add_request("filler", prompt(64, 5), max_tokens=1)
    model.step(64)
    drain(model)  # the filler's blocks are stored too, and a's evicted from the GPU
    assert model.lookup(tokens) == 32
    model.add_request("b", tokens, max_tokens=1)
    result = model.step(64)
    assert result.loading == ("b",) and result.scheduled == {}
    meta = result.metadata
    assert meta.load_event == 0 and meta.load_event_to_reqs == {0: ("b",)}
    snap = model.snapshot()
    (load,) = snap.loads
    assert load.transfer.cpu_block_ids == meta.load_cpu_blocks
    assert all(snap.cpu.blocks[i].ref_cnt == 1 for i in meta.load_cpu_blocks)
    assert model.complete_load(0) == ("b",)
    snap = model.snapshot()
    assert snap.loads == () and snap.load_event_to_reqs == ()
    assert snap.cpu.free_queue[-2:] == meta.load_cpu_blocks  # refreshed to the LRU tail
    assert model.step(64).scheduled == {"b": (32, 40)}


def test_lookup_never_covers_the_last_token() -> None:
    model = make()
    tokens = prompt(32)
    model.add_request("a", [*tokens, 1], max_tokens=1)
    model.step(64)
    drain(model)
    assert model.lookup([*tokens, 1]) == 32
    assert model.lookup(tokens) == 16  # an exact multiple of the block size hits k - 1 blocks


def _loading_model() -> tuple[object, list[int]]:
    tokens = prompt(40)
    model = make(gpu_blocks=5)
    model.add_request("a", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    model.add_request("filler", prompt(64, 5), max_tokens=1)
    model.step(64)
    drain(model)
    model.add_request("b", tokens, max_tokens=1)
    model.step(64)
    return model, tokens


def test_finish_during_a_load_defers_cleanup_until_the_load_completes() -> None:
    model, _ = _loading_model()
    assert isinstance(model, type(make()))
    model.finish("b")
    snap = model.snapshot()
    (load,) = snap.loads
    assert load.finished and snap.requests[1].block_ids != ()  # blocks kept for the copy
    assert model.complete_load(0) == ("b",)
    snap = model.snapshot()
    assert snap.loads == () and snap.requests[1].block_ids == ()


def test_reset_during_a_load_abandons_it_until_it_completes() -> None:
    model, _ = _loading_model()
    assert isinstance(model, type(make()))
    assert model.reset() is False
    assert [v.request_id for v in model.snapshot().abandoned_loads] == ["b"]
    model.complete_load(0)
    assert model.snapshot().abandoned_loads == ()
    assert model.step(64).scheduled == {"b": (32, 40)}


def test_a_lookup_pin_outlives_a_failed_allocation_and_blocks_reset() -> None:
    tokens = prompt(40)
    model = make(gpu_blocks=5)
    model.add_request("a", tokens, max_tokens=1)
    model.step(64)
    drain(model)
    model.add_request("hog", prompt(48, 5), max_tokens=10)  # holds 3 of 4 GPU blocks
    model.step(64)
    model.add_request("b", tokens, max_tokens=1)
    model.step(2)  # hog decodes; b hits 32 tokens in the CPU pool but gets no GPU blocks
    snap = model.snapshot()
    assert [(req, hit) for req, _, hit in snap.pending_hits] == [("b", 32)]
    assert model.reset() is False  # the pin keeps the CPU pool busy
    model.finish("b")
    assert model.snapshot().pending_hits == ()


def test_several_groups_store_and_hit_at_the_scheduler_block_size() -> None:
    model = make(gpu_blocks=16, group_block_sizes=(4, 8), hash_block_size=4)
    tokens = prompt(17)
    model.add_request("r", tokens, max_tokens=1)
    model.step(32)
    (flush,) = model.snapshot().pending_flushes
    assert len(flush.gpu_block_ids) == 4 + 2  # 16 confirmed tokens in both groups
    drain(model)
    assert model.lookup(tokens) == 16
    assert model.lookup(tokens[:13]) == 8  # 12 tokens hit in group 0, aligned down to 8
    groups = {b.primary.group for b in model.snapshot().cpu.blocks if b.primary is not None}
    assert groups == {0, 1}


def test_a_stale_store_completion_is_ignored_by_the_scheduler() -> None:
    """vLLM ignores completions of events in neither map (from before a reset); the driver
    rejects them earlier, so this drives the scheduler directly."""
    model = make()
    model.add_request("r", prompt(33), max_tokens=1)
    model.step(64)
    model.step(0)
    model.complete_store(0)
    before = model.snapshot()
    model.engine.connector.update_connector_output(set(), {0: 1})
    assert model.snapshot() == before
    assert model.engine.connector.processed_store_events == [0]


def test_kv_events_name_each_stored_key_with_its_tokens_and_each_eviction() -> None:
    """With kv-cache events, a completed store publishes a ``stored`` event per key (its
    tokens past the key before, and that key's digest as the parent), a CPU eviction a
    ``removed`` event per key it drops, a reset that clears the cache ``cleared``; without
    them nothing is published."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    quiet = make(gpu_blocks=10, cpu_blocks=3, group_block_sizes=(4,))
    model = OffloadModel(OffloadConfig(10, 3, (4,), 4, kv_events=True), check=True)
    for m in (quiet, model):
        m.add_request("a", tokens, max_tokens=1)
        m.step(16)
        m.step(0)  # the final flush goes out
        drain(m)
    assert quiet.take_events() == []
    keys = block_keys(prefix_digests(tokens, 4), 0, 4, 4)
    assert model.take_events() == [
        KVEvent(STORED, keys[0], None, (1, 2, 3, 4), 4),
        KVEvent(STORED, keys[1], keys[0].digest, (5, 6, 7, 8), 4),
    ]
    assert model.take_events() == []  # drained
    model.add_request("b", [7, 7, 7, 7, 7], max_tokens=1)
    model.step(16)
    model.step(0)
    drain(model)
    # the CPU pool holds two blocks: b's store evicts a's first one, the head of its queue
    events = model.take_events()
    assert events[0] == KVEvent(REMOVED, keys[0])
    assert [e.kind for e in events[1:]] == [STORED]
    assert model.reset()
    assert model.take_events() == [KVEvent(CLEARED)]
