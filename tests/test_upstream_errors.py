"""vLLM's adapter refuses a bad call as the model does: the same error type and message, and
vLLM's state left as it was (the INPUT contract of docs/spec.md, on the third driver). Run in
0.34.0's release environment; skipped where it is not installed."""

from __future__ import annotations

import textwrap

from helpers import found_in_release

# Each bad call as the source of a call on ``t``; HUGE an int Python refuses to write.
BAD_CALLS = [
    "t.add_request(['a'], [1])",
    "t.add_request(7, [1])",
    "t.add_request('x', [1, -2])",
    "t.add_request('x', [1, HUGE])",
    "t.add_request('x', [1], HUGE)",
    "t.add_request('x', [1], 1, 1)",
    "t.finish(['a'])",
    "t.finish({'a': 1})",
    "t.finish(3)",
    "t.finish('nope')",
    "t.lookup([2**31])",
    "t.lookup('abc')",
    "t.step(True)",
    "t.step(-1)",
    "t.step(HUGE)",
    "t.step(2**24 + 1)",
    "t.complete_store([0])",
    "t.complete_store({0: 1})",
    "t.complete_store(True)",
    "t.complete_store(HUGE)",
    "t.complete_store(0, [0])",
    "t.complete_store(0, 5)",
    "t.complete_store(99)",
    "t.complete_load([0])",
    "t.complete_load(0)",
    "t.reset_prefix_cache(1)",
    "t.reset_prefix_cache(False, 1)",
    "t.reset_prefix_cache(False, 'yes')",
]

SCRIPT = """
import json
from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.vllm_target.offload import VllmOffload

HUGE = 10**5000

def busy(t):
    t.add_request("done", [(7 + i * 3) % 11 + 1 for i in range(33)], max_tokens=1)
    t.add_request("live", [(14 + i * 3) % 11 + 1 for i in range(40)], max_tokens=5)
    t.step(80)
    t.step(8)
    t.complete_store(0, worker=0)

def refusal(t, call):
    before = t.snapshot()
    try:
        eval(call, {"t": t, "HUGE": HUGE})
    except Exception as error:
        if t.snapshot() != before:
            return "changed its state"
        return [type(error).__name__, str(error)]
    return "accepted it"

config = OffloadConfig(32, 16, (16,), 16, 2)
for prepared in (False, True):
    model, vllm = OffloadModel(config, check=True), VllmOffload(config)
    if prepared:
        busy(model)
        busy(vllm)
    for call in CALLS:
        ours, theirs = refusal(model, call), refusal(vllm, call)
        found = None if ours == theirs else f"{call}: the model {ours}, vLLM's adapter {theirs}"
        print(json.dumps({"found": found}))
"""


def test_vllms_adapter_refuses_a_bad_call_as_the_model_does() -> None:
    script = f"CALLS = {BAD_CALLS!r}\n" + textwrap.dedent(SCRIPT)
    found = found_in_release("0.34.0", script)
    assert len(found) == 2 * len(BAD_CALLS)
    assert [f for f in found if f is not None] == []


def test_vllms_adapter_refuses_a_reset_that_preempts_saying_where_it_runs() -> None:
    script = textwrap.dedent(
        """
        import json
        from kvoffload.model import InvalidArgumentError, OffloadConfig
        from kvoffload.vllm_target.offload import VllmOffload
        vllm = VllmOffload(OffloadConfig(32, 16, (16,), 16, 1))
        before = vllm.snapshot()
        try:
            vllm.reset_prefix_cache(True, True)
        except InvalidArgumentError as error:
            unchanged = vllm.snapshot() == before
            print(json.dumps({"found": f"{unchanged}: {error}"}))
        """
    )
    (found,) = found_in_release("0.34.0", script)
    assert found is not None and found.startswith("True: reset_running_requests=True"), found
    assert "vLLM's own Scheduler" in found
