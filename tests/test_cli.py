"""The command line answers bad usage in one line with exit status 2, before anything runs or
is written; the exit status of every command is documented in its help."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "--seconds", "nan"], "seconds must be finite and > 0, got 'nan'"),
        (["verify", "--seconds", "inf"], "seconds must be finite and > 0, got 'inf'"),
        (["verify", "--seconds", "-5"], "seconds must be finite and > 0, got '-5'"),
        (["verify", "--seconds", "soon"], "'soon' is not a number of seconds"),
        (["verify", "--seed", "-1"], "must be >= 0, got -1"),
        (["fuzz", "--workers", "0"], "must be >= 1, got 0"),
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
