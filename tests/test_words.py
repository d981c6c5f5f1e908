"""A difference in plain words (issue 34, testing/words.py): each sentence names what the
model does and the target does not, every differing field gives one (FAITHFUL), transfers
come first (CAUSE FIRST), and the raw text every parser reads is unchanged before the mark."""

from __future__ import annotations

from dataclasses import replace

from test_impl_conformance import FAULT_SCENARIO

from kvoffload.model.snapshot import PoolView, Snapshot, TransferView
from kvoffload.testing.failure import verdict_of
from kvoffload.testing.lockstep import first_disagreement
from kvoffload.testing.reduce import kind
from kvoffload.testing.words import (
    MARK,
    MAX_SENTENCES,
    difference_words,
    differing,
    in_words,
    snapshot_words,
    without_words,
    words_of,
)

from helpers import make
from scenarios import SCENARIOS


def _snapshot() -> Snapshot:
    model = make(8, 8, (4,))
    model.add_request("r0", list(range(8)), 1)
    model.step(8)
    return model.snapshot()


def test_a_flush_the_target_does_not_queue_is_said_as_the_issue_says_it() -> None:
    mine = _snapshot()
    mine = replace(mine, pending_flushes=(TransferView(None, (3,), (1,)),))
    theirs = replace(mine, pending_flushes=())
    said = snapshot_words(mine, theirs, "vLLM", differing(mine, theirs))
    assert said == [
        "at the final flush the model stores GPU block 3 into CPU block 1; vLLM does not"
    ]


def test_every_differing_field_gives_a_sentence() -> None:
    """FAITHFUL: a corruption of any one field of the snapshot is said, by a rule of its own
    or by both values under the field's name."""
    mine = _snapshot()
    for field in mine.__dataclass_fields__:
        value = getattr(mine, field)
        other: object
        if isinstance(value, PoolView):
            other = value._replace(free_queue=(*value.free_queue, 99))
        elif isinstance(value, bool):
            other = not value
        elif isinstance(value, int):
            other = value + 1
        else:
            other = ()
            if value == other:
                continue
        theirs = replace(mine, **{field: other})  # type: ignore[arg-type]
        said = difference_words(None, None, mine, theirs, None, "the target")
        assert said, field


def test_transfers_come_before_results_and_pools() -> None:
    mine = replace(_snapshot(), pending_flushes=())
    theirs = replace(
        mine,
        pending_flushes=(TransferView(None, (1,), (1,)),),
        has_pending_stores=not mine.has_pending_stores,
    )
    said = difference_words(1, 2, mine, theirs, None, "the target")
    assert said[0].startswith("at the final flush the target stores GPU block 1")
    assert said[1] == "the call returns 1 in the model, 2 in the target"
    assert "has_pending_stores" in said[-1]


def test_words_are_bounded_and_found_again_behind_the_mark() -> None:
    text = in_words([f"s{i}" for i in range(MAX_SENTENCES + 2)])
    assert text.startswith(MARK) and text.endswith("; and 2 more difference(s).")
    found = "call 3 ('step', 8): snapshots differ in ['cpu']: cpu: ..." + text
    assert words_of(found) == text.removeprefix(MARK)
    assert without_words(found) == "call 3 ('step', 8): snapshots differ in ['cpu']: cpu: ..."
    assert kind(found) == "snapshot ['cpu']" and in_words([]) == ""


def test_every_fault_s_first_difference_has_words() -> None:
    """Every fault of the catalogue, on its scenario: the first difference carries words,
    and the class the verdict gives it is read from the raw text as before."""
    for fault, scenario in sorted(FAULT_SCENARIO.items()):
        config, program = SCENARIOS[scenario]
        found = first_disagreement(config, program, faults=[fault], device="cpu")
        assert found is not None and words_of(found), fault
        assert verdict_of(without_words(found)) == verdict_of(found), fault
