"""The call-level reduction after Hypothesis's shrinker: 1-minimal, a subsequence, and the
same kind of difference; and the simplest configuration that still shows it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvoffload.model import OffloadConfig
from kvoffload.testing.campaign import reduced, regrouped, rules_of
from kvoffload.testing.failure import Failure
from kvoffload.testing.lockstep import Call, disagreement, first_disagreement
from kvoffload.testing.reduce import kind, reduce_program, simpler_config, simplest
from kvoffload.testing.stateful import machine_for


def test_it_keeps_exactly_the_calls_the_difference_needs() -> None:
    program: list[Call] = [("reset",)] * 5 + [("step", 1)] + [("reset",)] * 4 + [("step", 2)]

    def disagrees(calls: list[Call]) -> str | None:
        wanted = [c for c in calls if c[0] == "step"]
        return (
            "call 1 ('step', 2): model returned 1, implementation 2" if len(wanted) == 2 else None
        )

    reduced, found = reduce_program(program, disagrees)
    assert reduced == [("step", 1), ("step", 2)]
    assert found is not None and found.startswith("call 1")


def test_a_program_that_conforms_is_returned_as_it_is() -> None:
    program: list[Call] = [("reset",), ("drain",)]
    assert reduce_program(program, lambda calls: None) == (program, None)


def test_a_reduction_never_trades_the_difference_for_another() -> None:
    program: list[Call] = [("add", "a", [1], 1), ("step", 4), ("finish", "a")]

    def disagrees(calls: list[Call]) -> str | None:
        if calls == program:
            return "call 2 ('finish', 'a'): snapshots differ in ['cpu']: ..."
        return "call 0 ('step', 4): model returned 1, implementation 2"

    assert reduce_program(program, disagrees)[0] == program


def test_kind_ignores_numbers_and_blocks() -> None:
    a = "call 3 ('step', 8): snapshots differ in ['gpu', 'cpu']: gpu: block 1 is ..."
    b = "call 9 ('drain',): snapshots differ in ['gpu', 'cpu']: gpu: block 4 is ..."
    assert kind(a) == kind(b) == "snapshot ['gpu', 'cpu']"
    assert kind("call 1 ('finish', 'r0'): model returned 'x', implementation 'y'") == (
        "result of finish"
    )
    data = "call 4 ('drain',): worker 0 cpu block 1 layer 0 does not hold the KV of g0:150ae7@4"
    assert kind(data) == "KV bytes of a cpu block"
    assert kind(
        "call 2 ('step', 8): worker 1 gpu block 3 layer 1 does not hold the KV of g1:9@8"
    ) == ("KV bytes of a gpu block")
    crash = "call 2 ('finish', 'r0'): the implementation's snapshot raised KeyError: 'x'"
    assert kind(crash) == "the implementation's snapshot raised KeyError"


def test_a_real_failure_reduces_to_a_program_that_still_fails() -> None:
    """The stuck shrink seen under the ci profile: resets nothing needs, around the race of
    vLLM #45704 (a store that does not wait for compute)."""
    config = OffloadConfig(4, 2, (4,), 4, 1)
    program: list[Call] = [("add", "r0", [0, 1, 2, 3], 2), *[("reset",)] * 10]
    program += [("step", 8), ("drain",), ("step", 8), ("drain",)]
    faults = ["store-skips-compute-wait"]

    def disagrees(calls: list[Call]) -> str | None:
        return first_disagreement(config, calls, faults=faults, device="cpu")

    reduced, found = reduce_program(program, disagrees)
    assert [c[0] for c in reduced] == ["add", "step", "step", "drain"]
    assert found is not None and "does not hold the KV" in found


def test_a_failure_is_reported_in_the_simplest_configuration_that_shows_it() -> None:
    # An input-contract fault: the request longer than the GPU pool is accepted, whatever the
    # mode or the number of workers; the campaign happened to draw lazy mode and 3 workers.
    machine = machine_for("fault:fit-counts-cpu-pool")
    config = OffloadConfig(4, 16, (16,), 16, 3, lazy=True)
    program: tuple[Call, ...] = (("add", "a", list(range(64)), 1), ("step", 64))
    failure = Failure(machine.adapter_name, "fixed", config, program, 2, "found")
    simple = reduced(machine, failure)
    assert simple.config == OffloadConfig(4, 16, (16,), 16, 1, lazy=False)
    assert simple.program == program[:1] and simple.disagreement.startswith("call 0 ('add'")

    # A difference that needs lazy mode keeps it (and one that needs nothing changes nothing).
    def only_lazy(c: OffloadConfig) -> Callable[[list[Call]], str | None]:
        found = "call 0 ('step', 8): model returned 1, implementation 2" if c.lazy else None
        return lambda calls: found

    wanted = "result of step"
    assert simpler_config(config, program, only_lazy, wanted).lazy
    assert simpler_config(config, program, lambda c: lambda calls: None, wanted) == config


def test_a_simpler_configuration_drops_decode_context_parallelism_unless_it_is_needed() -> None:
    config = OffloadConfig(4, 16, (16,), 16, 2, dcp_world_size=2)
    program: tuple[Call, ...] = (("step", 8),)
    wanted = "result of step"
    found = "call 0 ('step', 8): model returned 1, implementation 2"

    def always(c: OffloadConfig) -> Callable[[list[Call]], str | None]:
        return lambda calls: found

    def only_dcp(c: OffloadConfig) -> Callable[[list[Call]], str | None]:
        return lambda calls: found if c.dcp_world_size > 1 else None

    # one rank, then one worker
    assert simpler_config(config, program, always, wanted) == OffloadConfig(4, 16, (16,), 16, 1)
    # two ranks kept, and with them two workers: one worker is a configuration the model
    # refuses (DCP splits the workers), passed over rather than raised
    assert simpler_config(config, program, only_dcp, wanted) == config


def test_a_call_only_the_lazy_program_needs_goes_with_lazy_mode() -> None:
    # As S21's counterexample found in lazy mode: there a step must store the block again
    # after a reset; in eager mode the reset must not be there at all.
    program: list[Call] = [("add", "a", [1], 1), ("reset",), ("step", 8), ("finish", "a")]
    lazy = OffloadConfig(4, 2, (4,), 4, 1, lazy=True)

    def checker(c: OffloadConfig) -> Callable[[list[Call]], str | None]:
        def disagrees(calls: list[Call]) -> str | None:
            needs = [("add", "a", [1], 1), ("finish", "a")]
            if not all(call in calls for call in needs) or (("reset",) in calls) != c.lazy:
                return None
            return f"call {len(calls) - 1} ('finish', 'a'): snapshots differ in ['cpu']: ..."

        return disagrees

    config, reduced_program, found = simplest(lazy, program, checker)
    assert not config.lazy and reduced_program == [("add", "a", [1], 1), ("finish", "a")]
    assert found is not None and "snapshots differ in ['cpu']" in found


def test_stats_drained_after_a_completion_belong_to_its_rule() -> None:
    program: list[Call] = [("add", "a", [1], 1), ("step", 8), ("drain",), ("stats",)]
    assert rules_of(program) == 3
    assert rules_of([*program, ("reset",), ("stats",), ("stats",)]) == 5
    assert rules_of([("step", 8), ("drain",)], settles=1) == 3


PHANTOM = OffloadConfig(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,), hash_block_size=4)


def _phantom() -> tuple[type[Any], Callable[[list[Call]], str | None]]:
    machine = machine_for("fault:phantom-primary", loads=False)
    return machine, lambda calls: disagreement(machine.adapter, machine.variant, PHANTOM, calls)


def test_steps_and_drains_become_one_settle_rule_where_the_difference_stays() -> None:
    machine, disagrees = _phantom()
    program: list[Call] = [("add", "r0", [0, 1, 2, 3], 2), ("step", 8), ("step", 8)]
    found = disagrees(program)
    assert found is not None and rules_of(program) == 3
    regrouped_program, again, rules = regrouped(machine, PHANTOM, program, found, disagrees)
    # add_request, then settle: its first round computes the prompt, its second stores it
    assert rules == 2 and kind(again) == kind(found)
    assert regrouped_program == [
        ("add", "r0", [0, 1, 2, 3], 2),
        ("step", 8),
        ("drain",),
        ("stats",),
        ("step", 8),
    ]


def test_a_settle_that_loses_the_difference_is_not_taken() -> None:
    machine = machine_for("fault:stats-pending-skips-abandoned", loads=False)

    def disagrees(calls: list[Call]) -> str | None:
        return disagreement(machine.adapter, machine.variant, PHANTOM, calls)

    # A store in flight at the reset: settling first would complete it, and the reset
    # would then abandon nothing.
    program: list[Call] = [
        ("add", "r0", [0, 1, 2, 3], 2),
        ("step", 8),
        ("step", 8),
        ("reset",),
        ("stats",),
    ]
    found = disagrees(program)
    assert found is not None
    assert regrouped(machine, PHANTOM, program, found, disagrees) == (program, found, 4)
