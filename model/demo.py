"""``kvoffload demo``: one story a reviewer can follow, with every invariant checked after
every call.

A prompt is computed in chunks and decoded; the eager scan stores each block one step after
it is computed; the request finishes and the final flush (PR #53532) queues the blocks no
scan reached, including the prompt-tail block with its secondary key; a filler request
evicts the prompt from the GPU; the repeated prompt is then served from the CPU pool;
finally a larger request fills the CPU pool and evicts the oldest blocks.
Run with ``--variant no-final-flush`` or ``--variant phantom-primary``
to watch an invariant catch the bug.
"""

from __future__ import annotations

from kvoffload.model.config import OffloadConfig
from kvoffload.model.driver import OffloadModel
from kvoffload.model.errors import InvariantViolation
from kvoffload.model.snapshot import PoolView
from kvoffload.model.types import NO_EVENT, StepResult

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
FILLER = [7] * 28
LARGE = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6, 0, 2, 8]


def describe_pool(name: str, pool: PoolView) -> str:
    keys = ", ".join(f"{k}->{list(ids)}" for k, ids in pool.cached) or "-"
    return f"  {name}: free {list(pool.free_queue)}; map {keys}"


def describe_step(n: int, result: StepResult) -> str:
    parts = [f"step {n}:"]
    for req_id, (start, end) in result.scheduled.items():
        parts.append(f"{req_id} computes [{start}, {end})")
    parts += [f"{req_id} waits for its CPU load" for req_id in result.loading]
    m = result.metadata
    if m.store_event != NO_EVENT:
        pairs = ", ".join(
            f"{g}->{c}" for g, c in zip(m.store_gpu_blocks, m.store_cpu_blocks, strict=True)
        )
        parts.append(f"store event {m.store_event} copies gpu->cpu {pairs}")
    if m.load_event != NO_EVENT:
        pairs = ", ".join(
            f"{c}->{g}" for g, c in zip(m.load_gpu_blocks, m.load_cpu_blocks, strict=True)
        )
        parts.append(f"load event {m.load_event} copies cpu->gpu {pairs}")
    parts += [f"{req_id} finished" for req_id in result.finished]
    return " ".join(parts[:1]) + " " + "; ".join(parts[1:])


class Story:
    def __init__(self, variant: str) -> None:
        config = OffloadConfig(
            gpu_blocks=9, cpu_blocks=12, group_block_sizes=(4,), hash_block_size=2
        )
        self.model = OffloadModel(config, variant=variant, check=True)
        self.steps = 0
        print(
            f"kvoffload demo ({variant}): 1 KV group of 4-token blocks, 2-token hash blocks, "
            f"{config.gpu_blocks - 1} usable GPU blocks, {config.cpu_blocks - 1} usable CPU "
            "blocks; every invariant is checked after every call."
        )

    def say(self, text: str) -> None:
        print(f"\n# {text}")

    def state(self) -> None:
        snap = self.model.snapshot()
        print(describe_pool("gpu", snap.gpu))
        print(describe_pool("cpu", snap.cpu))
        for b in snap.cpu.blocks[1:]:
            if b.primary is not None:
                extra = f" secondary {[str(k) for k in b.secondary]}" if b.secondary else ""
                print(f"  cpu block {b.block_id}: primary {b.primary}{extra}")

    def step(self, budget: int) -> StepResult:
        self.steps += 1
        result = self.model.step(budget)
        print(describe_step(self.steps, result))
        return result

    def complete_stores(self) -> None:
        for view in self.model.snapshot().store_events:
            assert view.event is not None
            self.model.complete_store(view.event)
            print(f"worker 0 completes store event {view.event}")

    def run(self) -> None:
        m = self.model
        self.say(f"A prompt of {len(PROMPT)} tokens, computed in chunks of 4, then 3 decodes")
        m.add_request("A", PROMPT, max_tokens=3)
        for _ in range(5):
            self.step(4)
        print(f"has_pending_stores() = {m.has_pending_stores()}: the final flush is queued")
        self.complete_stores()
        self.say("An empty step submits the queued final flush; the worker completes it")
        self.step(0)
        self.complete_stores()
        self.state()
        print(f"lookup(prompt) = {m.lookup(PROMPT)} tokens from the CPU pool")

        self.say("A filler request takes every GPU block, evicting A's cached GPU blocks")
        m.add_request("F", FILLER, max_tokens=1)
        self.step(32)
        self.step(0)
        self.complete_stores()

        self.say("The prompt comes back: a GPU miss, a CPU hit, a load, then one token computed")
        m.add_request("B", PROMPT, max_tokens=1)
        result = self.step(16)
        for event in sorted(result.metadata.load_event_to_reqs):
            print(f"worker 0 completes load event {event}: {m.complete_load(event)} ready")
        self.step(16)

        self.say(
            "A large request fills the CPU pool: stores evict from the LRU head; B's load "
            "moved A's first blocks to the tail, so the filler's blocks go first"
        )
        m.add_request("L", LARGE, max_tokens=1)
        self.step(32)
        self.step(0)
        self.complete_stores()
        self.state()
        print(f"lookup(prompt) = {m.lookup(PROMPT)} tokens from the CPU pool")
        print(f"lookup(filler) = {m.lookup(FILLER)} tokens: its first blocks were evicted")
        print(f"\n{self.steps} steps, every invariant held after every call.")


def run_demo(variant: str = "fixed") -> int:
    story = Story(variant)
    try:
        story.run()
    except InvariantViolation as violation:
        print(f"\nINVARIANT VIOLATED: {violation}")
        return 1
    return 0
