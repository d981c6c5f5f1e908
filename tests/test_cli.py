"""The command line answers bad usage in one line with exit status 2, before anything runs or
is written; every number it takes is bounded (kvoffload.model.limits) and a value of any size
is shown cut; the exit status of every command and every target form are documented in its
help."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload import __version__
from kvoffload.main import main
from kvoffload.model.limits import MAX_SEED, cores

SECONDS = "seconds must be finite, > 0 and at most 604800 (a week), got"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "--seconds", "nan"], f"{SECONDS} 'nan'"),
        (["verify", "--seconds", "inf"], f"{SECONDS} 'inf'"),
        (["verify", "--seconds", "-5"], f"{SECONDS} '-5'"),
        (["verify", "--seconds", "1e308"], f"{SECONDS} '1e308'"),
        (["history", "--seconds", "604801"], f"{SECONDS} '604801'"),
        (["fuzz", "--seconds", "0"], f"{SECONDS} '0'"),
        (["verify", "--seconds", "soon"], "'soon' is not a number of seconds"),
        (["verify", "--seed", "-1"], f"must be from 0 to {MAX_SEED}, got '-1'"),
        (["verify", "--seed", str(MAX_SEED + 1)], f"must be from 0 to {MAX_SEED}, got"),
        (["fuzz", "--workers", "0"], f"must be from 1 to {cores()} (the cores here"),
        (["fuzz", "--workers", str(cores() + 1)], f"must be from 1 to {cores()} (the cores"),
        (["verify", "--jobs", "1000000"], f"must be from 1 to {cores()} (the cores here"),
        (["mutants", "--jobs", "0"], f"must be from 1 to {cores()} (the cores here"),
        (["verify", "--jobs", "9" * 100], "is longer than any number taken here"),
        (["mutants", "--write", "/no/such/dir/x.md"], "the folder /no/such/dir of"),
        (["bench", "--output", "/no/such/x.md"], "the folder /no/such of /no/such/x.md"),
        (["verify", "--json", "/no/such/v.json"], "the folder /no/such of /no/such/v.json"),
        (["replay", "x.json", "--output", "/no/such/t.py"], "the folder /no/such of"),
        (["verify", "--profile", "weekly"], "invalid choice: 'weekly'"),
        (["install", "vllm==latest"], "is not of the form vllm==X.Y.Z"),
        (["verify", "--target", "nope", "--no-mutants"], "unknown target 'nope'"),
        (["history", "--only", "S99"], "unknown bugs ['S99']"),
    ],
)
def test_bad_usage_is_one_line_and_exit_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        status = main(argv)
        raise SystemExit(status)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_an_output_that_is_a_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["mutants", "--write", str(tmp_path)])
    assert exited.value.code == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_the_help_documents_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["verify", "--help"], ["replay", "--help"], ["fuzz", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 conforms (or as expected), 1 a disagreement, 2 bad usage" in out
        assert "3 a broken setup" in out


def test_a_huge_bad_value_is_refused_in_one_short_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["verify", "--seconds", "x" * 20_000_000], ["verify", "--target", "y" * 10**6]):
        with pytest.raises(SystemExit) as exited:
            raise SystemExit(main([*argv, "--no-mutants"]))
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) < 1000, err[:300]


def test_the_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvoffload {__version__}"


def test_every_command_that_takes_a_target_names_every_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["verify", "--help"], ["fuzz", "--help"], ["replay", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        for form in ("impl", "impl-cuda", "fault:NAME", "vllm==X.Y.Z", "vllm@PATH"):
            assert form in out, (argv, form)
        assert "the vLLM of this environment as vllm" in out
