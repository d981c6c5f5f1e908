"""Efficiency as a measured verdict of its own (issue 34): what a target's cache costs in hits
and copies, counted on the target's own state call after call, reported beside the
correctness verdict and never failing it.

A target can be correct and wasteful: serve fewer hits than its tiers hold, copy a block to a
tier that already holds its key, spend CPU blocks on keys no lookup reaches. vLLM 0.34.0 has
known limits of that kind, kept by the model on purpose (docs/spec.md, "Hit-rate limits"):
these figures make them numbers, so that a change which improves or worsens them shows it.

What is counted, from each call's snapshots of the target (before and after) and its result:

- **admitted**, **held blocks** and **served blocks**: for each request, at the first step that
  schedules or loads it, the scheduler blocks of its prompt a hit could be served from what the
  tiers held before the step (in every group the longest prefix of its keys the GPU map or the
  CPU map held, the shortest of those, less the last token, which is always computed), and the
  blocks it was served (its computed tokens when first scheduled, after any load). Counted
  where every group is full attention (a window's and a Mamba group's hits follow rules of
  their own); not for a request that skips reading the prefix cache, nor one never scheduled,
  nor after a host block was damaged on purpose (its key is held, and rightly not served).
  **unserved** is held less served, per request, where positive.
- **stored blocks** and **stored twice**: the GPU blocks of the stores a step sent, and of
  those the ones whose key the CPU map held when the step began or another store in flight (or
  one earlier in the same step) was already copying.
- **loaded blocks** and **loaded twice**: the blocks of the loads a step started, and of those
  the ones whose key the GPU map held when the step began.
- **stranded CPU blocks**: at each program's end, the CPU blocks holding a key whose prefix one
  block shorter neither tier holds: no lookup reaches them until that prefix is stored again.

Every figure is a count over all programs of a campaign, and each is measured on the target,
not the model: a target that differs is measured up to its first difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.keys import BlockKey, block_keys, prefix_digests
from kvoffload.model.snapshot import Snapshot

Call = tuple[Any, ...]


@dataclass
class Efficiency:
    """The counts of :mod:`kvoffload.testing.efficiency` (see there)."""

    admitted: int = 0
    held_blocks: int = 0
    served_blocks: int = 0
    unserved_blocks: int = 0
    stored_blocks: int = 0
    stored_twice: int = 0
    loaded_blocks: int = 0
    loaded_twice: int = 0
    stranded_cpu_blocks: int = 0

    def add(self, other: Efficiency) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def line(self) -> str:
        """One line for a report."""
        served = f"{self.served_blocks} of {self.held_blocks} held blocks served"
        return (
            f"{self.admitted} requests admitted, {served} ({self.unserved_blocks} unserved); "
            f"{self.stored_twice} of {self.stored_blocks} stored blocks and {self.loaded_twice} "
            f"of {self.loaded_blocks} loaded blocks copied to a tier that held their key; "
            f"{self.stranded_cpu_blocks} CPU blocks stranded at the programs' ends"
        )


def _keys(map_: Any) -> set[BlockKey]:
    return {key for key, _ in map_}


@dataclass
class ProgramEfficiency:
    """The counts of one program, fed call by call with the target's snapshots."""

    config: OffloadConfig
    counts: Efficiency = field(default_factory=Efficiency)
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skips: set[str] = field(default_factory=set)
    held: dict[str, int] = field(default_factory=dict)  # per request, blocks held at admission
    served: set[str] = field(default_factory=set)  # the requests counted
    damaged: bool = False  # a host block was damaged on purpose: no admission counted after

    def _chain(self, tokens: Sequence[int]) -> list[BlockKey]:
        c = self.config
        group = c.first_full_attention_group
        digests = prefix_digests(tokens, c.hash_block_size)
        return block_keys(digests, group, c.group_block_sizes[group], c.hash_block_size)

    def observe(self, call: Call, before: Snapshot | None, after: Snapshot, result: object) -> None:
        """One call the target agreed on: ``before`` its snapshot after the previous call."""
        name = call[0]
        if name == "add" and not isinstance(result, str):  # (a string: the call was refused)
            self.prompts[call[1]] = tuple(call[2])
            if len(call) > 4 and call[4]:
                self.skips.add(call[1])
        if name == "corrupt":
            self.damaged = True
        if name != "step" or before is None:
            return
        if not self.damaged:  # (a damaged block is held but rightly not served: INTEGRITY)
            self._admissions(before, result)
        self._stores(before, after)
        self._loads(before, after)

    def _held_tokens(self, prompt: Sequence[int], held: set[BlockKey]) -> int:
        """The tokens of ``prompt`` a hit could be served from ``held``: every group's longest
        prefix of held keys, the shortest of them, in whole scheduler blocks, less the last
        token (always computed)."""
        c = self.config
        digests = prefix_digests(prompt[: len(prompt) - 1], c.hash_block_size)
        tokens = len(prompt)
        for g, size in enumerate(c.group_block_sizes):
            keys = block_keys(digests, g, size, c.hash_block_size)
            n = next((i for i, key in enumerate(keys) if key not in held), len(keys))
            tokens = min(tokens, n * size)
        return tokens - tokens % c.scheduler_block_size

    def _admissions(self, before: Snapshot, result: object) -> None:
        c = self.config
        if any(not c.full_attention(g) for g in range(c.num_groups)):
            return  # (a window's or a Mamba group's hit follows rules of its own)
        scheduled: dict[str, tuple[int, int]] = getattr(result, "scheduled", {}) or {}
        loading: Sequence[str] = getattr(result, "loading", ()) or ()
        held = _keys(before.gpu.cached) | _keys(before.cpu.cached)
        for req_id in [*loading, *scheduled]:
            if req_id in self.held or req_id not in self.prompts or req_id in self.skips:
                continue
            self.held[req_id] = self._held_tokens(self.prompts[req_id], held)
        size = c.scheduler_block_size
        for req_id, (start, _) in scheduled.items():
            if req_id not in self.held or req_id in self.served:
                continue
            # (served when first scheduled, after any load; a hit on a block another request
            # computes in the same step was not held before it, and counts as held)
            self.served.add(req_id)
            served, n = start // size, self.held[req_id] // size
            counts = self.counts
            counts.admitted += 1
            counts.held_blocks += max(n, served)
            counts.served_blocks += served
            counts.unserved_blocks += max(0, n - served)

    def _stores(self, before: Snapshot, after: Snapshot) -> None:
        sent = {t.event for t in before.store_events}
        on_cpu = _keys(before.cpu.cached)
        copying = {
            before.gpu.blocks[i].primary for t in before.store_events for i in t.gpu_block_ids
        }
        for t in after.store_events:
            if t.event in sent:
                continue
            for gpu_id in t.gpu_block_ids:
                key = after.gpu.blocks[gpu_id].primary
                self.counts.stored_blocks += 1
                if key is not None and (key in on_cpu or key in copying):
                    self.counts.stored_twice += 1
                copying.add(key)

    def _loads(self, before: Snapshot, after: Snapshot) -> None:
        started = {(load.request_id, load.transfer) for load in before.loads}
        on_gpu = _keys(before.gpu.cached)
        for load in after.loads:
            if (load.request_id, load.transfer) in started:
                continue
            for cpu_id in load.transfer.cpu_block_ids:
                self.counts.loaded_blocks += 1
                if after.cpu.blocks[cpu_id].primary in on_gpu:
                    self.counts.loaded_twice += 1

    def end(self, last: Snapshot | None) -> Efficiency:
        """The program's counts, with the CPU blocks stranded in ``last`` (its final
        snapshot, where known)."""
        if last is not None:
            held = _keys(last.gpu.cached) | _keys(last.cpu.cached)
            parent: dict[BlockKey, BlockKey] = {}
            for r in last.requests:
                chain = self._chain([*self.prompts.get(r.request_id, ()), *r.output])
                parent.update(zip(chain[1:], chain, strict=False))
            for key, ids in last.cpu.cached:
                if key in parent and parent[key] not in held:
                    self.counts.stranded_cpu_blocks += len(ids)
        return self.counts
