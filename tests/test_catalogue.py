"""The bug catalogue: one id per bug across the model's variants, the implementation's faults
and vLLM's history, and the one table of which forms each bug has (docs/catalogue.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.impl import faults
from kvoffload.impl.driver import OffloadImpl
from kvoffload.main import main
from kvoffload.model import OffloadConfig, catalogue
from kvoffload.model.catalogue import BUGS, BY_HISTORY, RENAMED, canonical
from kvoffload.model.variants import VARIANTS, scheduler_class
from kvoffload.testing import targets
from kvoffload.upstream import bugs as history
from kvoffload.upstream.catalogue import bug_variants, forms, page, unnamed_forms

ROOT = Path(__file__).resolve().parents[1]


def test_ids_are_unique_and_no_id_is_an_old_name() -> None:
    ids = [b.id for b in BUGS]
    assert len(ids) == len(set(ids))
    assert not set(RENAMED) & set(ids)
    assert set(RENAMED.values()) <= set(ids)


def test_each_history_number_belongs_to_one_bug_and_numbers_its_row() -> None:
    numbers = [b.history for b in BUGS if b.history is not None]
    assert sorted(numbers, key=lambda n: int(n[1:])) == [f"S{n}" for n in range(1, 30)]
    assert len(numbers) == len(set(numbers))
    assert [row.id for row in history.BUGS] == [f"S{n}" for n in range(1, 30)]
    for row in history.BUGS:
        assert BY_HISTORY[row.id].id == row.bug


def test_every_form_is_named_by_a_bug_of_the_catalogue() -> None:
    assert unnamed_forms() == []
    assert set(bug_variants()) <= {b.id for b in BUGS}
    assert set(faults.FAULTS) <= {b.id for b in BUGS}


def test_a_form_under_a_name_the_catalogue_lacks_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above can fail: a fault, a variant or a history row under a second name."""
    import kvoffload.upstream.catalogue as forms_module

    fault = faults.FAULTS["no-final-flush"]
    monkeypatch.setitem(faults.FAULTS, "final-flush-missing", fault)
    monkeypatch.setitem(VARIANTS, "flushless", VARIANTS["no-final-flush"])
    renamed = history.HistoricalBug("flush-dropped", "0.29.0", "0.30.0", out_of_reach="x")
    monkeypatch.setattr(forms_module, "HISTORY", [*history.BUGS, renamed])
    assert unnamed_forms() == [
        "variant flushless",
        "fault final-flush-missing",
        "history row flush-dropped",
    ]


def test_the_bugs_that_had_two_names_have_every_form_under_one() -> None:
    """The eight bugs that had one name as a variant and another as a fault (and the
    variants that lost their ``bug-53498-`` prefix)."""
    by_id = {f.bug.id: f for f in forms()}
    for old, new in RENAMED.items():
        assert by_id[new].variant, new
        assert by_id[new].fault is not None or old.startswith("bug-53498-"), new
    assert by_id["lazy-returns-to-tail"].history is not None
    assert by_id["lazy-returns-to-tail"].history.id == "S26"


def test_an_old_name_reads_as_the_bugs_id() -> None:
    assert canonical("lazy-tail") == "lazy-returns-to-tail"
    assert canonical("no-final-flush") == "no-final-flush"
    assert scheduler_class("lazy-tail") is VARIANTS["lazy-returns-to-tail"]
    assert scheduler_class("lazy-tail+window-stale-ids") is scheduler_class(
        "lazy-returns-to-tail+window-stale-ids"
    )
    config = OffloadConfig(gpu_blocks=4, cpu_blocks=2, group_block_sizes=(4,), hash_block_size=4)
    with OffloadImpl(config, faults=["lookup-pin-missing"], layout=None) as impl:
        assert impl.faults == ("no-hit-pins",)
    assert targets.spec("fault:window-scan-breaks").name == "fault:scan-breaks-unhashed"


def test_the_page_is_the_table_and_the_command_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (ROOT / "docs" / "catalogue.md").read_text() == page(), (
        "docs/catalogue.md is stale: kvoffload catalogue --write docs/catalogue.md"
    )
    out = tmp_path / "catalogue.md"
    assert main(["catalogue", "--write", str(out)]) == 0
    assert out.read_text() == page()
    printed = capsys.readouterr().out
    assert "| lazy-returns-to-tail | lazy mode returns offloaded blocks" in printed
    assert f"{len(BUGS)} bugs" in page() and catalogue.BY_ID["no-hit-pins"].history == "S1"
