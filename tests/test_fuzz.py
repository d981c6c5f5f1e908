"""``kvoffload fuzz``: workers on different seeds sharing one example database, here a real
Redis server on the loopback (the Debian package ``redis-server``; skipped where it is not
installed), protected by a password and ACL users, and over TLS where ``redis-server`` takes
``--tls-port`` and ``openssl`` makes a self-signed certificate: a failure one worker found is
the first program another runs; the password is never shown, nor given on a command line; a
database that cannot be written is refused before any worker starts; workers run isolated,
from a folder of their own, and say how far they are while they run."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import RedisError

from kvoffload.fuzz import open_database, redacted, run_fuzz, run_worker, scrubbed
from kvoffload.main import main
from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.model.limits import MAX_SECONDS, cores
from kvoffload.testing import isolation

SERVER = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")
FAULT = "fault:no-final-flush"
# The server's passwords: the default user's, a user who may do anything, one who may read
# only. Each is a word that appears nowhere else in what fuzz prints.
PASSWORD = "Zq7-default-secret"
ALICE = "alice", "Wx3-alice-secret"
READER = "reader", "Vu5-reader-secret"
SECRETS = (PASSWORD, ALICE[1], READER[1])
PLANTED = ("kvoffload/__init__.py", "json.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Server:
    """A redis-server on the loopback: its port (TLS only when ``tls``), its socket."""

    port: int
    socket: Path
    tls: bool = False

    def url(self, user: str = "", password: str = PASSWORD, query: str = "") -> str:
        scheme = "rediss" if self.tls else "redis"
        credentials = f"{user}:{password}@" if password else ""
        return f"{scheme}://{credentials}127.0.0.1:{self.port}/0{query}"


def _serve(folder: Path, extra: list[str], tls: bool = False) -> Iterator[Server]:
    """A password-protected redis-server with the users ALICE and READER, until closed."""
    if SERVER is None:
        pytest.skip("needs redis-server (Debian package redis-server)")
    port = _free_port()
    # A socket path must be short (about 100 characters): not under pytest's folder.
    sockets = Path(tempfile.mkdtemp(prefix="kvoffload-redis-"))
    sock = sockets / "redis.sock"
    config = [
        f"port {0 if tls else port}",
        "bind 127.0.0.1",
        'save ""',
        "appendonly no",
        f"dir {folder}",
        f"unixsocket {sock}",
        # (the passwords in a file the server reads, not on its command line)
        f"requirepass {PASSWORD}",
        f"user {ALICE[0]} on >{ALICE[1]} ~* &* +@all",
        f"user {READER[0]} on >{READER[1]} ~* &* +@read +@connection",
        *(extra if not tls else [f"tls-port {port}", *extra]),
    ]
    conf = folder / "redis.conf"
    conf.write_text("\n".join(config) + "\n")
    log = folder / "redis.log"
    with log.open("w") as out:
        server = subprocess.Popen([SERVER, str(conf)], stdout=out, stderr=subprocess.STDOUT)
    client = Redis(unix_socket_path=str(sock), password=PASSWORD)
    try:
        for _ in range(200):
            if server.poll() is not None:
                if tls:
                    pytest.skip(f"this redis-server does not serve TLS: {log.read_text()[-200:]}")
                raise AssertionError(f"redis-server did not start: {log.read_text()[-500:]}")
            try:
                client.ping()
                break
            except RedisError:
                time.sleep(0.05)
        yield Server(port, sock, tls)
    finally:
        client.close()
        server.terminate()
        server.wait()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Server]:
    yield from _serve(tmp_path, [])


@pytest.fixture
def redis_url(secured: Server) -> str:
    """The server with the right credentials: ALICE's, a user of the server's ACL."""
    return secured.url(*ALICE)


def _certificate(folder: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (and its key beside it), made by openssl."""
    if OPENSSL is None:
        pytest.skip("needs openssl for a self-signed certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    command = [OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt"]
    command += ["ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert)]
    command += ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    made = subprocess.run(command, capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a self-signed certificate: {made.stderr[-200:]}")
    return cert


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    cert = _certificate(tmp_path)
    key = cert.with_name("key.pem")
    tls_config = [f"tls-cert-file {cert}", f"tls-key-file {key}", f"tls-ca-cert-file {cert}"]
    for server in _serve(tmp_path, [*tls_config, "tls-auth-clients no"], tls=True):
        yield server, cert


def _nothing_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text


def _one_line(err: str) -> str:
    err = err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# -- the shared database, with credentials -----------------------------------------------


def test_a_failure_one_worker_found_is_replayed_first_by_another(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # On its own, worker 2's seed meets the fault only after several programs.
    alone = run_worker(FAULT, "fast", 60, 2_000_000, str(tmp_path / "empty"), None)
    assert not alone.conforms and alone.first_failing_program is not None
    assert alone.first_failing_program > 1
    # Worker 1 finds it and saves it, shrunk, in the shared database (with a password) ...
    first = run_worker(FAULT, "fast", 60, 1_000_000, redis_url, None)
    assert not first.conforms and first.failure is not None
    # ... and worker 2's very first program is that failure.
    second = run_worker(FAULT, "fast", 60, 2_000_000, redis_url, None)
    assert second.first_failing_program == 1
    assert second.failure is not None
    assert second.failure["program"] == first.failure["program"]


def test_fuzz_with_credentials_shows_them_nowhere(
    secured: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    started: list[tuple[list[str], dict[str, Any]]] = []
    real = subprocess.Popen

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, args: list[str], **options: Any) -> None:
            started.append((list(args), options))
            super().__init__(args, **options)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    workers = min(2, cores())
    verdict = tmp_path / "verdict.json"
    argv = ["fuzz", "--target", FAULT, "--workers", str(workers), "--seconds", "60"]
    argv += ["--database", secured.url(*ALICE), "--seed", "5", "--profile", "fast"]
    status = main([*argv, "--json", str(verdict)])
    out, err = capfd.readouterr()
    assert status == 1, out + err
    assert f"fuzzing {FAULT} with {workers} workers" in out and "seeds 5 + k * 1000000" in out
    assert f"database redis://{ALICE[0]}:***@127.0.0.1:{secured.port}/0" in out
    assert "worker 0 (seed 5)" in out and "DISAGREES" in out and "reproduce with:" in out
    document = json.loads(verdict.read_text())
    _nothing_secret(out, err, verdict.read_text())
    # The workers: isolated, in folders of their own, the URL on no command line and in no
    # variable (it goes on their standard input).
    assert len(started) == workers
    for command, options in started:
        assert command[1:] == ["-P", "-m", "kvoffload.fuzz"]
        assert options["stdin"] == subprocess.PIPE
        assert Path(options["cwd"]).is_absolute() and Path(options["cwd"]) != tmp_path
        assert not Path(options["cwd"]).exists()  # removed once the run ended
        _nothing_secret(" ".join(command), json.dumps(options["env"]))
    # The verdict as JSON.
    assert document["target"] == FAULT and document["verdict"] == "disagrees"
    assert document["exit_status"] == 1 and document["errors"] == []
    assert document["database"] == f"redis://{ALICE[0]}:***@127.0.0.1:{secured.port}/0"
    assert [w["seed"] for w in document["workers"]] == [k * 1_000_000 + 5 for k in range(workers)]
    for row in document["workers"]:
        assert row["programs"] > 0 and row["rule_steps"] > 0 and row["seconds"] > 0
        assert row["verdict"] in ("disagrees", "conforms")
    finder = document["workers"][document["found_by"]]
    assert finder["verdict"] == "disagrees" and finder["first_failing_program"] >= 1
    assert document["failure"]["adapter"] == FAULT and document["failure"]["program"]
    assert "first_disagreement(" in document["reproducer"]
    # The failure is saved where it always was: in the caller's folder, once.
    saved = tmp_path / document["saved"]
    assert saved.parent == tmp_path / isolation.FAILURES
    assert json.loads(saved.read_text())["program"] == document["failure"]["program"]
    assert f"saved to {document['saved']}" in out
    # The database was written through the URL: the failure is there for the next run.
    client = Redis(host="127.0.0.1", port=secured.port, username=ALICE[0], password=ALICE[1])
    assert client.keys("hypothesis-example:*")
    assert not client.keys("kvoffload-probe:*")  # the probes removed


@pytest.mark.parametrize(
    ("user", "password", "message"),
    [
        ("", "not-the-password", "refuses the credentials"),
        (ALICE[0], READER[1], "refuses the credentials"),
        ("", "", "refuses the credentials"),
        (READER[0], READER[1], "cannot be written"),
    ],
)
def test_a_database_that_refuses_is_said_in_one_line_with_exit_status_2(
    secured: Server,
    user: str,
    password: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    verdict = tmp_path / "verdict.json"
    url = secured.url(user, password)
    argv = ["fuzz", "--target", "impl", "--database", url, "--seconds", "1"]
    assert main([*argv, "--json", str(verdict)]) == 2
    out, err = capsys.readouterr()
    assert message in _one_line(err) and out == ""
    assert redacted(url) in err
    _nothing_secret(err)
    assert not verdict.exists()  # refused before anything ran or was written


def test_a_unix_socket_and_a_password_in_the_query(secured: Server) -> None:
    url = f"unix://{secured.socket}?password={PASSWORD}&db=2"
    assert redacted(url) == f"unix://{secured.socket}?password=***&db=2"
    database = open_database(url)
    database.save(b"key", b"value")
    assert list(open_database(url).fetch(b"key")) == [b"value"]
    client = Redis(unix_socket_path=str(secured.socket), password=PASSWORD, db=2)
    assert client.keys("hypothesis-example:*")


def test_a_tls_server_is_reached_with_its_certificate(
    tls: tuple[Server, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, cert = tls
    verified = server.url(*ALICE, query=f"?ssl_ca_certs={cert}")
    database = open_database(verified)
    database.save(b"key", b"over TLS")
    unverified = server.url(*ALICE, query="?ssl_cert_reqs=none")
    assert list(open_database(unverified).fetch(b"key")) == [b"over TLS"]
    # Without the certificate the server cannot be trusted: a broken setup, said in a line.
    argv = ["fuzz", "--target", "impl", "--database", server.url(*ALICE), "--seconds", "1"]
    assert main(argv) == 3
    err = _one_line(capsys.readouterr().err)
    assert "does not answer" in err and "certificate verify failed" in err
    assert "rediss://alice:***@127.0.0.1" in err
    _nothing_secret(err)
    # Over TLS too, the wrong password is bad input.
    with pytest.raises(ConfigError, match="refuses the credentials"):
        open_database(server.url(ALICE[0], "wrong", query="?ssl_cert_reqs=none"))


@pytest.mark.parametrize(
    ("database", "status", "message"),
    [
        ("ftp://host", 2, "neither a folder nor redis://HOST:PORT[/DB]"),
        ("redis://127.0.0.1:notaport", 2, "must be numbers"),
        ("redis://127.0.0.1:6379/zero", 2, "must be numbers"),
        ("redis://127.0.0.1:6379/0?nonsense=1", 2, "a parameter the Redis client does not take"),
        # The free port is found when the test runs: a parameter drawn at collection differs
        # between pytest-xdist's workers, which then refuse the whole run.
        ("redis://127.0.0.1:{free_port}", 3, "does not answer"),
        ("redis://:{password}@127.0.0.1:{free_port}", 3, "does not answer"),
    ],
)
def test_a_bad_database_is_said_in_one_line(
    database: str, status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    database = database.format(free_port=_free_port(), password=PASSWORD)
    assert main(["fuzz", "--target", "impl", "--database", database, "--seconds", "1"]) == status
    err = _one_line(capsys.readouterr().err)
    assert message in err
    _nothing_secret(err)


# -- secrets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("redis://:pw@host", "redis://:***@host"),
        ("redis://user:pw@host:6380/2", "redis://user:***@host:6380/2"),
        ("redis://pw@host", "redis://***@host"),  # a lone name may be a password
        ("redis://:p@ss/w?rd@host:1", "redis://:***@host:1"),  # an unquoted @, / or ?
        ("redis://:p%40ss@host", "redis://:***@host"),
        (
            "rediss://u:pw@h/0?ssl_ca_certs=/c.pem&ssl_password=kp&password=x",
            "rediss://u:***@h/0?ssl_ca_certs=/c.pem&ssl_password=***&password=***",
        ),
        ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("/some/folder@where", "/some/folder@where"),
    ],
)
def test_redacted_hides_every_password(spec: str, shown: str) -> None:
    assert redacted(spec) == shown


def test_an_error_that_echoes_the_url_is_reworded() -> None:
    spec = "redis://user:p%40ss@host/0?ssl_password=key-secret"
    said = scrubbed(f"cannot reach {spec}; AUTH p@ss failed; key key-secret", spec)
    assert "p@ss" not in said and "p%40ss" not in said and "key-secret" not in said
    assert "redis://user:***@host/0?ssl_password=***" in said


# -- folders ------------------------------------------------------------------------------


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot create a file in: one without the write permission,
    or as root (whom permissions do not stop) a folder of sysfs, which takes no new file."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        folder = Path("/sys/kernel")
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError:
            return folder
        pytest.skip("no folder that cannot be written is at hand")
    return folder


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("/dev/null", "is not a folder"),
        ("{tmp}/missing/examples", "of the database"),
        ("unwritable", "cannot be written"),
    ],
)
def test_a_folder_that_cannot_keep_a_failure_is_refused(
    where: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(_unwritable(tmp_path)) if where == "unwritable" else where
    folder = folder.format(tmp=tmp_path)
    assert main(["fuzz", "--target", "impl", "--database", folder, "--seconds", "1"]) == 2
    assert message in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "missing").exists()  # nothing created for a refused folder


def test_open_database_takes_a_folder(tmp_path: Path) -> None:
    database = open_database(str(tmp_path / "examples"))
    database.save(b"key", b"value")
    assert list(database.fetch(b"key")) == [b"value"]
    assert [p.name for p in (tmp_path / "examples").iterdir() if p.is_file()] == []


# -- bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "seconds", "message"),
    [
        (cores() + 1, 1.0, f"workers must be from 1 to {cores()} (the cores here)"),
        (0, 1.0, "workers must be from 1 to"),
        (1, float("nan"), "seconds must be finite, > 0 and at most 604800"),
        (1, float("inf"), "seconds must be finite"),
        (1, 0.0, "seconds must be finite"),
        (1, MAX_SECONDS + 1, "seconds must be finite"),
    ],
)
def test_the_work_asked_is_bounded_before_any_worker_starts(
    workers: int, seconds: float, message: str, tmp_path: Path
) -> None:
    # (an unknown target: what would fail first if the bounds were not checked first)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_fuzz("no-such-target", workers, seconds, str(tmp_path / "db"), "fast", 1)
    assert not (tmp_path / "db").exists()


# -- isolation and progress ---------------------------------------------------------------


def test_a_fuzz_run_in_a_planted_folder_runs_none_of_it(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    for name in PLANTED:
        module = tmp_path / name
        module.parent.mkdir(parents=True, exist_ok=True)
        mark = marks / name.replace("/", "-")
        module.write_text(f"import pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\n")
    command = [sys.executable, "-P", "-m", "kvoffload", "fuzz", "--workers", "1"]
    command += ["--seconds", "2", "--target", "impl", "--profile", "fast"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": conforms") == 1
    assert not list(marks.iterdir()), [p.name for p in marks.iterdir()]
    # the default database is the caller's, though the worker ran in a folder of its own
    assert f"database {tmp_path.resolve() / isolation.DATABASE}," in run.stdout
    assert (tmp_path / isolation.DATABASE).is_dir()


def test_the_implementation_conforms_under_two_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    workers = min(2, cores())
    verdict = tmp_path / "verdict.json"
    command = [sys.executable, "-m", "kvoffload", "fuzz", "--workers", str(workers)]
    command += ["--seconds", "3", "--target", "impl", "--database", str(tmp_path / "db")]
    command += ["--profile", "fast", "--json", str(verdict)]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": conforms") == workers
    # Progress, to a pipe: a line per update, never a carriage return; the last one has
    # every worker ended, with what it ran.
    assert "\r" not in run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("fuzz ")]
    assert lines, run.stderr
    for line in lines:
        assert re.fullmatch(r"fuzz \d+/3 s: worker 0 .*", line), line
    assert lines[-1].count("(ended)") == workers
    document = json.loads(verdict.read_text())
    last = lines[-1]
    for row in document["workers"]:
        assert f"worker {row['worker']} {row['programs']} programs, " in last
        assert f"{row['rule_steps']} steps (ended)" in last
        assert row["verdict"] == "conforms" and row["first_failing_program"] is None
    assert document["verdict"] == "conforms" and document["exit_status"] == 0
    assert document["failure"] is None and document["saved"] is None
    assert document["database"] == str(tmp_path / "db")


def test_a_worker_that_breaks_is_a_broken_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # Workers whose interpreter cannot start (its home is a folder that does not exist): no
    # verdict on the target, a broken setup.
    isolated = isolation.environment
    home = {"PYTHONHOME": str(tmp_path / "no-such-home")}
    monkeypatch.setattr(isolation, "environment", lambda: isolated() | home)
    verdict = tmp_path / "verdict.json"
    with pytest.raises(SetupError, match="worker 0 exited 1 without a result"):
        run_fuzz("impl", 1, 1.0, str(tmp_path / "db"), "fast", 3, json_path=str(verdict))
    document = json.loads(verdict.read_text())
    assert document["verdict"] == "broken" and document["exit_status"] == 3
    assert document["workers"] == [
        {
            "worker": 0,
            "seed": 3,
            "programs": None,
            "rule_steps": None,
            "seconds": None,
            "verdict": "broken",
            "first_failing_program": None,
        }
    ]
    assert "fuzz " in capfd.readouterr().err  # its end was said
