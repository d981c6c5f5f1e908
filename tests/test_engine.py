"""The reduced engine: chunked prefill, decode, GPU prefix hits, keys, finish."""

from __future__ import annotations

from kvoffload.model.keys import block_keys, fine_key, prefix_digests

from helpers import complete_all_stores, drain, make, prompt


def test_chunked_prefill_then_one_token_decode_steps_then_finish() -> None:
    model = make(group_block_sizes=(4,))
    model.add_request("r", prompt(10), max_tokens=3)
    assert model.step(4).scheduled == {"r": (0, 4)}
    assert model.step(4).scheduled == {"r": (4, 8)}
    third = model.step(4)
    assert third.scheduled == {"r": (8, 10)}  # the prompt's rest, then a token is sampled
    assert model.step(4).scheduled == {"r": (10, 11)}
    last = model.step(4)
    assert last.scheduled == {"r": (11, 12)} and last.finished == ("r",)
    view = model.snapshot().requests[0]
    assert view.status == "finished" and len(view.output) == 3
    assert view.block_ids == ()  # the blocks were freed


def test_budget_is_shared_running_first_then_waiting() -> None:
    model = make(group_block_sizes=(4,))
    model.add_request("a", prompt(6, 1), max_tokens=2)
    model.add_request("b", prompt(6, 2), max_tokens=2)
    assert model.step(8).scheduled == {"a": (0, 6), "b": (0, 2)}
    assert model.step(8).scheduled == {"a": (6, 7), "b": (2, 6)}


def test_full_blocks_are_keyed_at_allocation_and_freed_tail_first() -> None:
    # One CPU block is the null block: no capacity, so no flush pins the GPU blocks.
    model = make(gpu_blocks=8, cpu_blocks=1, group_block_sizes=(4,))
    tokens = prompt(9)
    model.add_request("r", tokens, max_tokens=1)
    model.step(16)
    snap = model.snapshot()
    keys = block_keys(prefix_digests(tokens, 4), 0, 4, 4)
    gpu = {b.block_id: b for b in snap.gpu.blocks}
    assert [gpu[i].primary for i in (1, 2)] == keys
    assert gpu[3].primary is None
    # Finished: hashless block 3 to the head, hashed 2 then 1 (tail first) to the tail.
    assert snap.gpu.free_queue == (3, 4, 5, 6, 7, 2, 1)


def test_blocks_pinned_by_the_final_flush_are_freed_when_it_completes() -> None:
    model = make(gpu_blocks=8, group_block_sizes=(4,))
    model.add_request("r", prompt(9), max_tokens=1)
    model.step(16)
    assert model.snapshot().gpu.free_queue == (3, 4, 5, 6, 7)
    drain(model)
    assert model.snapshot().gpu.free_queue == (3, 4, 5, 6, 7, 1, 2)


def test_gpu_prefix_hit_shares_blocks_and_never_covers_the_last_token() -> None:
    model = make(group_block_sizes=(4,))
    tokens = prompt(8)
    model.add_request("a", tokens, max_tokens=5)
    model.step(8)
    model.add_request("b", tokens, max_tokens=2)
    result = model.step(8)
    # Both blocks are hits for b but the last token is recomputed: 4 hit, [4, 8) computed.
    assert result.scheduled["b"] == (4, 8)
    snap = model.snapshot()
    a, b = snap.requests
    assert a.block_ids[0][0] == b.block_ids[0][0]
    # Held by a, by b, and by the store of a's confirmed blocks selected in this step.
    assert snap.gpu.blocks[a.block_ids[0][0]].ref_cnt == 3
    assert snap.in_flight_gpu_blocks == a.block_ids[0][:2]


def test_prompt_tail_key_is_primary_while_partial_and_secondary_once_full() -> None:
    model = make(group_block_sizes=(4,), hash_block_size=2)
    tokens = prompt(6)
    model.add_request("r", tokens, max_tokens=3)
    model.step(16)  # computes 6 tokens: block 1 holds tokens 4..5, boundary 6 inside it
    digests = prefix_digests(tokens, 2)
    tail = fine_key(digests, 2, 0, 2)
    block1 = model.snapshot().requests[0].block_ids[0][1]
    view = model.snapshot().gpu.blocks[block1]
    assert view.primary == tail and view.secondary == ()
    model.step(16)
    model.step(16)  # 8 tokens now: block 1 is full
    req = model.engine.requests["r"]
    full = block_keys(req.digests, 0, 4, 2)[1]
    view = model.snapshot().gpu.blocks[block1]
    assert view.primary == full and view.secondary == (tail,)


def test_a_request_that_cannot_get_blocks_waits_and_is_scheduled_later() -> None:
    model = make(gpu_blocks=3, group_block_sizes=(4,))
    model.add_request("a", prompt(8, 1), max_tokens=1)
    model.add_request("b", prompt(8, 2), max_tokens=1)
    first = model.step(16)
    assert first.scheduled == {"a": (0, 8)} and first.finished == ("a",)
    # a's two blocks stay pinned by its final flush until the store completes.
    assert model.step(16).scheduled == {}
    complete_all_stores(model)
    assert model.step(16).scheduled == {"b": (0, 8)}


def test_finish_aborts_a_waiting_request_that_never_ran() -> None:
    model = make()
    model.add_request("r", prompt(4), max_tokens=1)
    assert model.finish("r").flush_gpu_blocks == ()
    assert model.step(16).scheduled == {}


def test_a_request_that_cannot_grow_preempts_the_last_running_one_which_resumes_as_new() -> None:
    # Three usable blocks of 4 tokens; two prompts of 5 tokens prefilled 3 tokens a step.
    model = make(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,))
    model.add_request("r0", [0, 1, 2, 3, 4], max_tokens=3)
    model.add_request("r1", [5, 6, 0, 1, 2], max_tokens=3)
    model.step(3)
    model.step(3)
    model.step(3)  # r0 samples its first token, r1 has 3 computed tokens in one block
    engine = model.engine
    assert engine.blocks_of("r1") == [[3]] and engine.requests["r1"].num_computed_tokens == 3
    step = model.step(3)
    # r0 decodes; r1 needs a second block, none is free: the last running request (r1
    # itself) is preempted, its block freed, its computed tokens back to 0, first in line.
    assert step.scheduled == {"r0": (6, 7)} and step.preempted == ("r1",)
    r1 = engine.requests["r1"]
    assert r1.status == "preempted" and r1.num_computed_tokens == 0
    assert engine.waiting == ["r1"] and engine.blocks_of("r1") == [[]]
    assert engine.connector.reqs_to_store["r1"].block_ids == ([],)  # the table starts over
    assert engine.connector.reqs_to_store["r1"].num_stored_blocks == [0]
    drain(model)
    resumed = model.step(8)
    # Back as a new request: recomputed from its first token, whole table to the connector.
    assert resumed.scheduled == {"r1": (0, 5)} and r1.status == "running"
    assert engine.connector.reqs_to_store["r1"].block_ids == tuple(engine.blocks_of("r1"))
