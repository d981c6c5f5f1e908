"""``kvoffload fuzz``: workers on different seeds sharing one example database, here a real
Redis server on the loopback (the Debian package ``redis-server``; skipped where it is not
installed): a failure one worker found is the first program another runs."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError

from kvoffload.main import main
from kvoffload.testing.fuzz import open_database, run_worker

SERVER = shutil.which("redis-server")
FAULT = "fault:no-final-flush"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if SERVER is None:
        pytest.skip("needs redis-server (Debian package redis-server)")
    port = _free_port()
    server = subprocess.Popen(
        [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    client = Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except RedisError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


def test_a_failure_one_worker_found_is_replayed_first_by_another(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # On its own, worker 2's seed meets the fault only after several programs.
    alone = run_worker(FAULT, "fast", 60, 2_000_000, str(tmp_path / "empty"), None)
    assert not alone.conforms and alone.first_failing_program is not None
    assert alone.first_failing_program > 1
    # Worker 1 finds it and saves it, shrunk, in the shared database ...
    first = run_worker(FAULT, "fast", 60, 1_000_000, redis_url, None)
    assert not first.conforms and first.failure is not None
    # ... and worker 2's very first program is that failure.
    second = run_worker(FAULT, "fast", 60, 2_000_000, redis_url, None)
    assert second.first_failing_program == 1
    assert second.failure is not None
    assert second.failure["program"] == first.failure["program"]


def test_fuzz_runs_workers_against_redis(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "-m", "kvoffload", "fuzz", "--target", FAULT, "--workers", "2"]
    command += ["--seconds", "60", "--database", redis_url, "--seed", "5", "--profile", "fast"]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    assert run.returncode == 1, run.stderr
    out = run.stdout
    assert f"fuzzing {FAULT} with 2 workers" in out and "seeds 5 + k * 1000000" in out
    assert "worker 0 (seed 5)" in out and "worker 1 (seed 1000005)" in out
    assert "DISAGREES" in out and "reproduce with:" in out


def test_the_implementation_conforms_under_two_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "-m", "kvoffload", "fuzz", "--workers", "2", "--seconds", "3"]
    command += ["--target", "impl", "--database", str(tmp_path / "db")]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": conforms") == 2


@pytest.mark.parametrize(
    ("database", "status", "message"),
    [
        ("ftp://host", 2, "neither a folder nor redis://HOST:PORT[/DB]"),
        ("redis://127.0.0.1:notaport", 2, "must be numbers"),
        # The free port is found when the test runs: a parameter drawn at collection differs
        # between pytest-xdist's workers, which then refuse the whole run.
        ("redis://127.0.0.1:{free_port}", 3, "does not answer"),
    ],
)
def test_a_bad_database_is_said_in_one_line(
    database: str, status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    database = database.format(free_port=_free_port())
    assert main(["fuzz", "--target", "impl", "--database", database, "--seconds", "1"]) == status
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_open_database_takes_a_folder(tmp_path: Path) -> None:
    database = open_database(str(tmp_path / "examples"))
    database.save(b"key", b"value")
    assert list(database.fetch(b"key")) == [b"value"]
