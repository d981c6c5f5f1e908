"""The conformance state machine: random programs drive the model and an implementation
in lockstep, compared after every call (results, snapshots, KV bytes), with the model's
``check()`` of every invariant. Parameterize it with an adapter (:func:`machine_for`).

Rules are few and draws small, so that shrinking works: requests come from three token
stems (prefixes are shared), budgets are small, pools tiny (2 to 8 CPU blocks) so eviction
and capacity limits happen, hash blocks may be smaller than blocks (secondary keys), and
up to 4 workers report completions in any order.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.model.invariants import exercised
from kvoffload.testing.adapters import Adapter, adapters
from kvoffload.testing.lockstep import Call, compare

LAYOUTS = [((4,), 4), ((4,), 2), ((8,), 4), ((4, 8), 4)]
FAILURES = Path(".hypothesis/kvoffload-failures")

PROMPTS = st.builds(
    lambda stem, length, tail: [(stem * 5 + i) % 7 for i in range(length)] + tail,
    st.integers(0, 2),
    st.integers(1, 16),
    st.lists(st.integers(0, 3), max_size=2),
)


@dataclass
class Recorder:
    """What a campaign saw: programs, steps, rule and invariant counts, the last failure."""

    programs: int = 0
    steps: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    invariants: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    first_failure: float | None = None
    failure: dict[str, Any] | None = None

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class ConformanceMachine(RuleBasedStateMachine):
    """Subclass with ``adapter`` set, or use :func:`machine_for`."""

    adapter_name: ClassVar[str] = "impl"
    adapter: ClassVar[Adapter]
    recorder: ClassVar[Recorder] = Recorder()

    config: OffloadConfig
    model: OffloadModel
    target: OffloadImpl

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        gpu_blocks=st.integers(6, 12),
        cpu_blocks=st.integers(2, 8),
        world_size=st.integers(1, 4),
        first=PROMPTS,
    )
    def setup(
        self,
        layout: tuple[tuple[int, ...], int],
        gpu_blocks: int,
        cpu_blocks: int,
        world_size: int,
        first: list[int],
    ) -> None:
        groups, hbs = layout
        self.config = OffloadConfig(gpu_blocks, cpu_blocks, groups, hbs, world_size)
        self.model = OffloadModel(self.config, check=True)
        self.target = type(self).adapter(self.config)
        self.program: list[Call] = []
        self.next_id = 0
        type(self).recorder.programs += 1
        self.add_request(first, 2)

    def run(self, call: Call, rule_name: str) -> None:
        rec = type(self).recorder
        rec.steps += 1
        rec.count(rec.rules, rule_name)
        self.program.append(call)
        found = compare(self.model, self.target, call, len(self.program) - 1)
        for invariant in exercised(self.model.engine):
            rec.count(rec.invariants, invariant)
        if found:
            if rec.first_failure is None:
                rec.first_failure = time.perf_counter() - rec.started
            rec.failure = {
                "adapter": type(self).adapter_name,
                "config": asdict(self.config)
                | {"group_block_sizes": list(self.config.group_block_sizes)},
                "program": [list(c) for c in self.program],
                "disagreement": found,
            }
            raise AssertionError(f"{found}\n\nreproduce with:\n{reproducer(rec.failure)}")

    def fits(self, tokens: list[int], max_tokens: int) -> bool:
        need = sum(-(-(len(tokens) + max_tokens - 1) // s) for s in self.config.group_block_sizes)
        return need < self.config.gpu_blocks

    @rule(tokens=PROMPTS, max_tokens=st.integers(1, 4))
    def add_request(self, tokens: list[int], max_tokens: int) -> None:
        if len(self.model.live_requests()) >= 3 or not self.fits(tokens, max_tokens):
            return
        self.run(("add", f"r{self.next_id}", tokens, max_tokens), "add_request")
        self.next_id += 1

    @rule(budget=st.integers(0, 24), steps=st.integers(1, 3))
    def step(self, budget: int, steps: int) -> None:
        for _ in range(steps):
            self.run(("step", budget), "step")

    @precondition(lambda self: bool(self.model.live_requests()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.run(("finish", data.draw(st.sampled_from(self.model.live_requests()))), "finish")

    @precondition(
        lambda self: bool(self.model.outstanding("store") + self.model.outstanding("load"))
    )
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        choices = [("store", *c) for c in self.model.outstanding("store")]
        choices += [("load", *c) for c in self.model.outstanding("load")]
        call = data.draw(st.sampled_from(choices))
        self.run(call, f"complete {call[0]}")

    @rule()
    def drain(self) -> None:
        self.run(("drain",), "drain")

    @rule(tokens=PROMPTS)
    def lookup(self, tokens: list[int]) -> None:
        self.run(("lookup", tokens), "lookup")

    @rule()
    def reset(self) -> None:
        self.run(("reset",), "reset")


def machine_for(adapter_name: str, recorder: Recorder | None = None) -> type[ConformanceMachine]:
    """A conformance machine driving the implementation ``adapter_name`` names."""
    factory = adapters()[adapter_name]
    return type(
        f"Conformance[{adapter_name}]",
        (ConformanceMachine,),
        {
            "adapter_name": adapter_name,
            "adapter": staticmethod(factory),
            "recorder": recorder or Recorder(),
        },
    )


def reproducer(failure: dict[str, Any]) -> str:
    """A standalone program that reproduces a recorded failure."""
    config = failure["config"]
    fields = ", ".join(
        f"{k}={tuple(v) if isinstance(v, list) else v!r}"
        for k, v in config.items()
        if k != "scheduler_block_size"
    )
    faults = []
    if failure["adapter"].startswith("fault:"):
        faults = [failure["adapter"].split(":", 1)[1]]
    device = "cuda" if failure["adapter"] == "impl-cuda" else "cpu"
    calls = ",\n".join(f"    {tuple(c)!r}" for c in failure["program"])
    return (
        "from kvoffload.model import OffloadConfig\n"
        "from kvoffload.testing.lockstep import first_disagreement\n\n"
        f"config = OffloadConfig({fields})\n"
        f"program = [\n{calls},\n]\n"
        f"print(first_disagreement(config, program, faults={faults!r}, device={device!r}))\n"
    )


def save_failure(failure: dict[str, Any], folder: Path = FAILURES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{failure['adapter'].replace(':', '-')}.json"
    path.write_text(json.dumps(failure, indent=1))
    return path
