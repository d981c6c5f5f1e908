"""Failure files come from outside: ``kvoffload replay`` validates them before it writes or
runs anything, and what it generates holds their values as literals only, so that no field
of a failure file runs code (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload.main import main
from kvoffload.testing.failure import FailureFileError, load, validate

PROGRAM = [
    ["add", "r0", [0, 1, 2, 3, 4], 2],
    ["step", 8],
    ["step", 8],
    ["drain"],
    ["add", "r1", [0, 1, 2, 3, 4], 1, True],  # a request that skips reading the cache
    ["step", 8],
]


def _failure(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "format": 1,
        "adapter": "impl",
        "variant": "fixed",
        "release": None,
        "seed": 7,
        "config": {
            "gpu_blocks": 8,
            "cpu_blocks": 4,
            "group_block_sizes": [4],
            "hash_block_size": 4,
            "world_size": 1,
        },
        "program": PROGRAM,
        "rule_steps": 3,
        "disagreement": "call 1 ('step', 8): something differed",
    }
    return base | changes


def _payload(mark: Path) -> str:
    """Source that leaves ``mark`` behind if it ever runs."""
    return f"__import__('pathlib').Path({str(mark)!r}).write_text('ran')"


def _hostile(mark: Path) -> dict[str, dict[str, Any]]:
    code = _payload(mark)
    config = _failure()["config"]
    return {
        "docstring": _failure(disagreement=f'"""\n{code}\n"""'),
        "quotes": _failure(disagreement=f"'''\"\"\"\\\n{code} #"),
        "call argument": _failure(program=[["finish", f"x'); {code}; ('"], *PROGRAM]),
        "request id": _failure(program=[["add", f'r0"); {code}; ("', [1, 2], 1]]),
        "flag": _failure(program=[["add", "r0", [1, 2], 1, f"True); {code}; (1"]]),
        "config key": _failure(config=config | {f"x=1, y={code}": 1}),
        "config value": _failure(config=config | {"gpu_blocks": code}),
        "adapter": _failure(adapter=f"impl', device={code}, x='"),
        "variant": _failure(variant=f"fixed'); {code}; ('"),
        "release": _failure(adapter="vllm", release=f"0.34.0\n{code}\n#"),
        "call name": _failure(program=[[f"step'); {code}; ('", 8]]),
    }


@pytest.mark.parametrize(
    "case",
    [
        "docstring",
        "quotes",
        "call argument",
        "request id",
        "config key",
        "config value",
        "adapter",
        "variant",
        "release",
        "call name",
    ],
)
def test_a_hostile_failure_file_never_runs_code(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mark = tmp_path / "ran"
    source = tmp_path / "failure.json"
    source.write_text(json.dumps(_hostile(mark)[case]))
    out = tmp_path / "test_regression.py"
    status = main(["replay", str(source), "--output", str(out)])
    if status == 2:
        # refused: one line naming the file, nothing written
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"kvoffload replay: {source}: ") and "\n" not in err
        assert not out.exists()
    else:
        assert status == 0
        text = out.read_text()
        namespace: dict[str, Any] = {}
        exec(compile(text, str(out), "exec"), namespace)  # what pytest does when collecting
        test = next(v for k, v in namespace.items() if k.startswith("test_regression"))
        test()  # the program conforms: the implementation is the real one
        exec(compile(load(source).reproducer(), "reproducer", "exec"), {})
        assert namespace["__doc__"].endswith(_hostile(mark)[case]["disagreement"])
    assert not mark.exists()


BAD_FILES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "the file is empty"),
    ("blank", b"  \n", "the file is empty"),
    ("truncated", b'{"adapter": "impl", "config": {', "not JSON (Expecting"),
    ("not UTF-8", b'{"adapter": "\xff\xfe"}', "not UTF-8 text"),
    ("a list", b"[1, 2]", "a failure must be a JSON object, got list"),
    ("huge integer", b'{"seed": ' + b"9" * 5000 + b"}", "not JSON a failure can hold"),
    ("deep", b"[" * 100000 + b"]" * 100000, "not JSON a failure can hold"),
]


def _bad_shapes() -> list[tuple[str, dict[str, Any], str]]:
    config = _failure()["config"]
    return [
        ("unknown adapter", _failure(adapter="nope"), "unknown adapter 'nope'"),
        ("unknown fault", _failure(adapter="fault:nope"), "unknown adapter 'fault:nope'"),
        ("unknown variant", _failure(variant="nope"), "unknown variant 'nope'"),
        ("bad config", _failure(config=config | {"gpu_blocks": 0}), "gpu_blocks must be > 0"),
        (
            "config that does not divide",
            _failure(config=config | {"group_block_sizes": [6]}),
            "does not divide",
        ),
        ("config lacking a field", _failure(config={"gpu_blocks": 4}), "config: missing fields"),
        ("bool as int", _failure(config=config | {"world_size": True}), "must be an int"),
        (
            "events not a bool",
            _failure(config=config | {"kv_events": 1}),
            "config kv_events must be a bool",
        ),
        (
            "window not an int",
            _failure(config=config | {"sliding_windows": [None, "3"]}),
            "config sliding_windows must be a list of ints or nulls",
        ),
        (
            "windows for another layout",
            _failure(config=config | {"sliding_windows": [None, 3]}),
            "names 2 groups, group_block_sizes 1",
        ),
        ("empty program", _failure(program=[]), "program is empty"),
        ("unknown call", _failure(program=[["explode"]]), "unknown call 'explode'"),
        ("wrong arity", _failure(program=[["step"]]), "'step' takes 1 arguments, got 0"),
        (
            "too many arguments",
            _failure(program=[["add", "r", [1], 1, True, 2]]),
            "'add' takes 3 to 4 arguments, got 5",
        ),
        (
            "flag not a bool",
            _failure(program=[["add", "r", [1], 1, "yes"]]),
            "argument 4 must be a bool or an int",
        ),
        ("wrong type", _failure(program=[["step", "8"]]), "argument 1 must be an int"),
        ("tokens not ints", _failure(program=[["lookup", [1, "2"]]]), "must be a list of ints"),
        ("call not a list", _failure(program=["step"]), "must be a list starting with"),
        ("unknown field", _failure(extra=1), "unknown fields ['extra']"),
        ("missing field", {"adapter": "impl"}, "missing fields"),
        (
            "negative rule steps",
            _failure(rule_steps=-1),
            "rule_steps must be an int from 0 to 10000",
        ),
        ("bad seed", _failure(seed="7"), "seed must be an int or null"),
        ("other format", _failure(format=3), "format 3 is not one of 1, 2"),
        (
            "too long a program",
            _failure(program=[["step", 1]] * 10_001),
            "program has 10001 calls, more than the 10000",
        ),
        (
            "huge value",
            _failure(adapter="a" * 1_000_000),
            "unknown adapter 'aaaa",
        ),
        ("target of another adapter", _failure(target={"kind": "release"}), "adapter is 'impl'"),
        (
            "tree without digest",
            _failure(adapter="vllm", target={"kind": "tree", "path": "/t", "version": "0.34.0"}),
            "target digest must be sha256:",
        ),
        (
            "tree at a relative folder",
            _failure(
                adapter="vllm",
                target={"kind": "tree", "path": "t", "digest": "sha256:" + "0" * 64},
            ),
            "target path must be an absolute folder name",
        ),
        (
            "release of another version",
            _failure(
                adapter="vllm", release="0.29.0", target={"kind": "release", "version": "0.3"}
            ),
            "is not the failure's release",
        ),
        ("verdict that is not so", _failure(verdict="model-broke-invariant"), "verdict"),
    ]


@pytest.mark.parametrize(("case", "content", "problem"), BAD_FILES)
def test_an_unreadable_failure_file_is_refused_in_one_line(
    case: str, content: bytes, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "failure.json"
    source.write_bytes(content)
    out = tmp_path / "test_regression.py"
    assert main(["replay", str(source), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert problem in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(("case", "data", "problem"), _bad_shapes())
def test_a_failure_of_the_wrong_shape_is_refused(
    case: str,
    data: dict[str, Any],
    problem: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "failure.json"
    source.write_text(json.dumps(data))
    out = tmp_path / "test_regression.py"
    for command in (
        ["replay", str(source), "--output", str(out)],
        ["replay", "--run", str(source)],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert problem in err and "\n" not in err
    assert not out.exists()
    with pytest.raises(FailureFileError, match=problem.replace("(", r"\(").replace("[", r"\[")):
        validate(data)


def test_a_failure_survives_its_round_trip() -> None:
    failure = validate(_failure())
    assert validate(failure.to_dict()) == failure
    # a hybrid layout with events: the null of a full-attention group, a bool, in the file
    # and in the program a reproducer prints
    config = _failure()["config"] | {
        "group_block_sizes": [4, 4],
        "sliding_windows": [None, 3],
        "kv_events": True,
    }
    hybrid = validate(_failure(config=config))
    assert hybrid.config.sliding_windows == (None, 3) and hybrid.config.kv_events
    assert validate(hybrid.to_dict()) == hybrid
    assert "sliding_windows=(None, 3), kv_events=True" in hybrid.reproducer()
    assert failure.file_name == "impl-fixed.json"
    vllm = validate(_failure(adapter="vllm", release="0.29.0", variant="vllm-0.29"))
    assert vllm.file_name == "vllm-0.29.0-vllm-0.29.json"
    assert "kvoffload replay --run" in vllm.reproducer()


def test_replay_run_says_whether_the_program_still_disagrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conforming = tmp_path / "impl.json"
    conforming.write_text(json.dumps(_failure()))
    assert main(["replay", "--run", str(conforming)]) == 0
    assert "no longer disagrees" in capsys.readouterr().out
    # the missing final flush of vLLM #53498: a one-block prompt finished by its first output
    program = [["add", "r0", [0, 1, 2, 3], 1], ["step", 8], ["step", 8]]
    faulty = tmp_path / "fault.json"
    faulty.write_text(json.dumps(_failure(adapter="fault:no-final-flush", program=program)))
    assert main(["replay", "--run", str(faulty)]) == 1
    assert "call 1 ('step', 8)" in capsys.readouterr().out


def test_a_failure_file_is_read_with_a_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.json"
    big.write_text(json.dumps(_failure(disagreement="x" * 3_000_000)))
    for source in (str(big), "/dev/zero"):
        assert main(["replay", source]) == 2
        err = capsys.readouterr().err
        assert "larger than the 2097152 bytes a failure file may have" in err
        assert err.count("\n") == 1 and len(err) < 400


def test_every_bad_value_is_refused_in_a_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "failure.json"
    for data in (
        _failure(adapter="a" * 1_000_000),
        _failure(program=[["lookup", [0] * 200_000 + ["x"]]]),
        _failure(config=_failure()["config"] | {"gpu_blocks": "9" * 1_000_000}),
    ):
        source.write_text(json.dumps(data))
        assert main(["replay", str(source)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) < 600, err[:300]


def test_each_target_has_a_file_of_its_own() -> None:
    digest = "sha256:" + "ab" * 32
    tree = {"kind": "tree", "path": "/src/vllm", "digest": digest, "version": "0.34.0"}
    env = {"kind": "current", "path": "/venv/lib/site-packages", "version": "0.34.0"}
    names = {
        validate(_failure(adapter="vllm", release="0.34.0", target=t)).file_name
        for t in (None, {"kind": "release", "version": "0.34.0"}, tree, env)
    }
    assert len(names) == 3  # the release named twice, a tree and an environment
    assert "vllm-0.34.0-fixed.json" in names and "vllm-tree-abababababab-fixed.json" in names
    broke = _failure(disagreement="the model broke QUEUES at call 3 ('step', 8): ...")
    assert validate(broke).file_name == "impl-fixed-model-broke.json"
