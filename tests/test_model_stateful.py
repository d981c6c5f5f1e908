"""Random programs against the model alone, with every invariant checked after every call
and a drain to quiescence at the end. Tiny pools force eviction and capacity limits."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvoffload.model import OffloadConfig, OffloadModel

# (group block sizes, hash block size, sliding windows, attention chunks, Mamba groups); then
# hybrid: a sliding-window group beside a full-attention one, its window's run shorter than,
# equal to or longer than a scheduler block; a chunked local group beside full attention;
# all three; a Mamba group beside full attention (and beside a sliding window), its states
# at every scheduler block or every other; and Mamba groups larger than the hash block
# (fine-grained hits), beside full attention of the same blocks and of smaller ones.
Layout = tuple[
    tuple[int, ...], int, tuple[int | None, ...], tuple[int | None, ...], tuple[bool, ...]
]
LAYOUTS: list[Layout] = [
    ((4,), 4, (), (), ()),
    ((4,), 2, (), (), ()),
    ((8,), 4, (), (), ()),
    ((4, 8), 4, (), (), ()),
    ((4, 8), 2, (), (), ()),
    ((8, 4), 4, (None, 3), (), ()),
    ((4, 4), 4, (None, 6), (), ()),
    ((4, 8, 4), 4, (None, 9, 7), (), ()),
    ((4, 4), 4, (), (None, 8), ()),
    ((2, 4, 4), 2, (None, 5, None), (None, None, 12), ()),
    ((4, 4), 4, (), (), (False, True)),
    ((8, 4), 4, (), (), (False, True)),
    ((4, 4, 4), 4, (None, 5, None), (), (False, False, True)),
    ((8, 8), 4, (), (), (False, True)),
    ((4, 8, 16), 4, (), (), (False, False, True)),
]

# Three shared stems, so prefixes repeat across requests.
PROMPTS = st.builds(
    lambda base, length, tail: [(base * 5 + i) % 7 for i in range(length)] + tail,
    st.integers(0, 2),
    st.integers(1, 20),
    st.lists(st.integers(0, 3), max_size=3),
)


class ModelMachine(RuleBasedStateMachine):
    model: OffloadModel

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        gpu_blocks=st.integers(8, 20),
        cpu_blocks=st.integers(1, 10),
        world_size=st.integers(1, 3),
        dcp=st.sampled_from([1, 2]),
        initial=st.lists(PROMPTS, min_size=1, max_size=3),
    )
    def setup(
        self,
        layout: Layout,
        gpu_blocks: int,
        cpu_blocks: int,
        world_size: int,
        dcp: int,
        initial: list[list[int]],
    ) -> None:
        groups, hbs, windows, chunks, mamba = layout
        # Decode context parallelism where the layout allows it: full attention only, the
        # ranks a divisor of the world and of every block size.
        if windows or chunks or mamba or world_size % dcp or any(size % dcp for size in groups):
            dcp = 1
        config = OffloadConfig(
            gpu_blocks,
            cpu_blocks,
            groups,
            hbs,
            world_size,
            sliding_windows=windows,
            attention_chunks=chunks,
            mamba=mamba,
            dcp_world_size=dcp,
        )
        self.model = OffloadModel(config, check=True)
        self.next_id = 0
        for tokens in initial:
            self.add_request(tokens, 2)

    # Few live requests at a time: without preemption a crowded engine stalls.
    @precondition(lambda self: len(self.model.live_requests()) < 3)
    @rule(tokens=PROMPTS, max_tokens=st.integers(1, 4))
    def add_request(self, tokens: list[int], max_tokens: int) -> None:
        need = self.model.config.blocks_for(len(tokens) + max_tokens - 1)
        if need >= self.model.config.gpu_blocks:
            event("request too large for the GPU pool")
            return
        self.model.add_request(f"r{self.next_id}", tokens, max_tokens)
        self.next_id += 1

    @rule(budget=st.integers(0, 32), steps=st.integers(1, 4))
    def step(self, budget: int, steps: int) -> None:
        for _ in range(steps):
            result = self.model.step(budget)
            if result.metadata.store_event >= 0:
                event("store event issued")
            if result.metadata.load_event >= 0:
                event("load event issued")
            if result.finished and self.model.snapshot().pending_flushes:
                event("final flush queued")

    @precondition(lambda self: bool(self.model.live_requests()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.model.finish(data.draw(st.sampled_from(self.model.live_requests())))

    @precondition(lambda self: bool(self.model.outstanding("store")))
    @rule(data=st.data())
    def complete_store(self, data: st.DataObject) -> None:
        event, worker = data.draw(st.sampled_from(self.model.outstanding("store")))
        self.model.complete_store(event, worker)

    @precondition(lambda self: bool(self.model.outstanding("load")))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        event, worker = data.draw(st.sampled_from(self.model.outstanding("load")))
        self.model.complete_load(event, worker)

    @rule()
    def complete_everything(self) -> None:
        """Every worker completes every outstanding transfer, loads first."""
        for event_id, worker in self.model.outstanding("load"):
            self.model.complete_load(event_id, worker)
        for event_id, worker in self.model.outstanding("store"):
            self.model.complete_store(event_id, worker)

    @rule()
    def reset(self) -> None:
        event(f"reset() returned {self.model.reset()}")
        if self.model.snapshot().abandoned_store_events:
            event("store abandoned")

    @invariant()
    def snapshot_is_consistent(self) -> None:
        snap = self.model.snapshot()
        assert snap.has_pending_stores == bool(
            snap.pending_flushes or snap.store_events or snap.abandoned_store_events
        )

    def teardown(self) -> None:
        """Finish everything and complete every transfer: all pins must be released."""
        m = self.model
        for _ in range(20):
            for req_id in m.live_requests():
                m.finish(req_id)
            m.step(0)
            for event_id, worker in m.outstanding("load"):
                m.complete_load(event_id, worker)
            for event_id, worker in m.outstanding("store"):
                m.complete_store(event_id, worker)
            if not (m.live_requests() or m.has_pending_stores() or m.outstanding("load")):
                break
        snap = m.snapshot()
        assert not snap.has_pending_stores and not snap.loads and not snap.abandoned_loads
        assert all(b.ref_cnt == 0 for b in snap.gpu.blocks[1:] + snap.cpu.blocks[1:])


TestModelMachine = ModelMachine.TestCase
