"""``kvoffload fuzz``: the conformance campaign in several processes, on different seeds,
sharing one Hypothesis example database.

Each worker is a process running :func:`kvoffload.testing.campaign.run_campaign` on the
target from seed ``base + worker * SEED_STRIDE`` in batches, with the shared database: a
failure one worker finds (and shrinks) is saved there under the target's key, and every
other worker replays it first at its next batch. The database is a folder (local workers) or
a Redis server, named by a URL the Redis client reads itself (:func:`open_database`:
``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://`` with TLS and the client's query
parameters, ``unix://PATH``): workers on any number of machines, each running ``kvoffload
fuzz`` against the same server. Workers stop at their first failure, when the time is spent,
or when another worker of the same run has found a failure (a stop file).

Invariants kept:

- DISJOINT: every worker's seeds are disjoint from the others' (``SEED_STRIDE`` batches
  apart), so that N workers explore N times as many programs, and each is printed to rerun
  it;
- VERDICT: the run's verdict is a disagreement iff some worker found one; a worker that
  crashed is a broken setup (exit status 3), never a verdict; the model breaking one of its
  own invariants is exit status 3 too, as for ``kvoffload verify``;
- CHECKED FIRST: the workers (at most :func:`~kvoffload.model.limits.cores`), the seconds
  (finite, > 0, at most :data:`~kvoffload.model.limits.MAX_SECONDS`), the target and the
  database are checked before any worker starts; the database is written and read back
  (a probe file, a probe key with an expiry), so that a database that cannot keep a failure
  is refused (exit status 2; a server that does not answer: 3) rather than shared in vain;
- NO SECRET: a database URL's password, and any query parameter that carries one, is shown
  as ``***`` (:func:`redacted`) in the header, in every error (the Redis client's own words
  included), in the JSON verdict and in what a worker prints when it breaks; workers get
  their spec, the URL in it, on standard input, never in their command line or environment;
- ISOLATED: workers run ``python -P -m kvoffload.fuzz`` (:mod:`kvoffload.testing.isolation`)
  in an empty folder of their own, with the isolated environment, and every path they are
  given is absolute; what they find is saved once, by this process, in the caller's
  failures folder (the shortest failure of the run);
- PROGRESS: while workers run, a line every ``PROGRESS_EVERY`` seconds and whenever one
  ends (rewritten in place on a terminal only), from the progress file each worker
  replaces atomically, so that a half-written file is never read.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvoffload.model.errors import ConfigError, KVOffloadError, SetupError
from kvoffload.model.limits import (
    brief,
    cut,
    require_processes,
    require_seconds,
    require_seed,
)
from kvoffload.testing import isolation
from kvoffload.testing.failure import Failure, model_broke, save, validate
from kvoffload.vllm_target.forms import is_vllm_target

SEED_STRIDE = 1_000_000
DEFAULT_DATABASE = isolation.DATABASE
WORKER_MODULE = "kvoffload.fuzz"
# Seconds between two progress lines while workers run; a worker reports twice as often,
# so that a line is never much older than the work it shows.
PROGRESS_EVERY = 10.0
POLL_SECONDS = 0.2
MIN_SPAN_SECONDS = 0.001
# A worker's spec on standard input: a few hundred bytes (a URL, paths, numbers).
MAX_SPEC_BYTES = 64 * 2**10
REDIS_SCHEMES = ("redis", "rediss", "unix")
SECRET = "***"
# Query parameters whose value is a secret (the client's ``password``, a TLS key's
# ``ssl_password``, a token): their values are never shown.
_SECRET_PARAMETER = re.compile(r"pass|secret|token|credential", re.IGNORECASE)
_PARAMETER = re.compile(r"([?&;])([^=&#;]*)=([^&#;]*)")
# A probe key lives a minute at most, whatever happens to the process that set it.
PROBE_EXPIRY_SECONDS = 60
CONNECT_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class WorkerResult:
    worker: int
    seed: int
    conforms: bool
    programs: int
    rule_steps: int
    seconds: float
    first_failure: float | None
    first_failing_program: int | None
    failure: dict[str, Any] | None
    saved: str | None


# -- secrets ------------------------------------------------------------------------------


def _credentials(rest: str) -> tuple[int, str, str] | None:
    """Where the credentials of a URL's part after ``://`` end (its last ``@``), the part
    shown of them and the part hidden; None without any. Everything before the last ``@``
    is taken as credentials, whatever it holds (a password with an unquoted ``/``, ``?`` or
    ``@`` included): it may hide too much, never too little. A user name is shown; a lone
    name (``redis://NAME@HOST``) may be a password written without its colon: hidden."""
    at = rest.rfind("@")
    if at < 0:
        return None
    userinfo = rest[:at]
    user, colon, password = userinfo.partition(":")
    if colon and not set(user) & set("/?#"):
        return at, f"{user}:", password
    return at, "", userinfo


def redacted(spec: str) -> str:
    """``spec`` with the password of a URL, and the value of every query parameter that
    carries one, shown as ``***``; a folder as it is."""
    scheme, separator, rest = spec.partition("://")
    if not separator:
        return spec
    rest = _PARAMETER.sub(
        lambda m: f"{m[1]}{m[2]}={SECRET}" if _SECRET_PARAMETER.search(m[2]) else m[0], rest
    )
    found = _credentials(rest)
    if found is not None:
        at, shown, hidden = found
        rest = f"{shown}{SECRET if hidden else ''}{rest[at:]}"
    return f"{scheme}://{rest}"


def _secrets(spec: str) -> set[str]:
    """The secrets ``spec`` holds, as written and as the client decodes them."""
    _, separator, rest = spec.partition("://")
    if not separator:
        return set()
    found: set[str] = set()
    for _, name, value in _PARAMETER.findall(rest):
        if _SECRET_PARAMETER.search(name):
            found |= {value, unquote(value), unquote_plus(value)}
    credentials = _credentials(rest)
    if credentials is not None:
        found |= {credentials[2], unquote(credentials[2])}
    return {secret for secret in found if secret}


def scrubbed(text: str, spec: str) -> str:
    """``text`` (an error of the Redis client, a worker's traceback) with ``spec`` shown
    :func:`redacted` and each of its secrets as ``***``, wherever they appear."""
    text = text.replace(spec, redacted(spec))
    # the longest first: a secret that holds another is hidden whole
    for secret in sorted(_secrets(spec), key=len, reverse=True):
        text = text.replace(secret, SECRET)
    return text


def _said(error: BaseException, spec: str) -> str:
    """An error of the client in one line, with nothing of ``spec``'s secrets."""
    return cut(scrubbed(" ".join(str(error).split()) or type(error).__name__, spec))


# -- the example database -----------------------------------------------------------------


def open_database(spec: str, parents: bool = False) -> ExampleDatabase:
    """The example database ``spec`` names, written and read back first: a Redis URL
    (``redis://``, ``rediss://``, ``unix://``, read by the Redis client) or a folder (created
    when absent, its parent existing, or with ``parents`` its parents too). A database that
    cannot be used is refused with :class:`ConfigError` (bad input), a server that does
    not answer with :class:`SetupError`; either in one line, without its secrets."""
    if "://" in spec:
        return _redis_database(spec)
    return DirectoryBasedExampleDatabase(str(writable_folder(Path(spec), parents)))


def writable_folder(path: Path, parents: bool = False) -> Path:
    """``path``, absolute, once a probe file was written into it and removed: created when
    absent (a parent that does not exist is refused, unless ``parents``)."""
    shown = brief(str(path))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"the database {shown} is not a folder")
    created = False
    if not path.exists():
        if not parents and not path.parent.is_dir():
            raise ConfigError(
                f"the folder {brief(str(path.parent))} of the database {shown} does not exist"
            )
        try:
            path.mkdir(parents=parents)
        except OSError as error:
            raise ConfigError(
                f"the database folder {shown} cannot be created: {error.strerror or error}"
            ) from None
        created = True
    try:
        handle, probe = tempfile.mkstemp(prefix=".kvoffload-probe-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        if created:
            path.rmdir()  # refused input leaves nothing behind
        raise ConfigError(
            f"the database folder {shown} cannot be written: {error.strerror or error}"
        ) from None
    return path.absolute()


def _redis_database(spec: str) -> ExampleDatabase:
    shown = brief(redacted(spec))
    scheme = spec.partition("://")[0].lower()
    if scheme not in REDIS_SCHEMES:
        raise ConfigError(
            f"the database {shown} is neither a folder nor redis://HOST:PORT[/DB] "
            "(rediss:// with TLS, unix://PATH)"
        )
    try:
        url = urlsplit(spec)
    except ValueError as error:  # an unclosed "[" of an IPv6 address
        raise ConfigError(f"the database {shown}: {_said(error, spec)}") from None
    try:
        url.port  # noqa: B018 (read for the error it raises)
    except ValueError:
        raise ConfigError(f"the database {shown}: the port and database must be numbers") from None
    # The client takes a path that is not a number as database 0: refused instead.
    if scheme != "unix" and not re.fullmatch(r"[0-9]*", unquote(url.path).replace("/", "")):
        raise ConfigError(f"the database {shown}: the port and database must be numbers")
    from hypothesis.extra.redis import RedisExampleDatabase
    from redis import Redis
    from redis.exceptions import (
        AuthenticationError,
        RedisError,
        ResponseError,
    )
    from redis.exceptions import ConnectionError as NoAnswer
    from redis.exceptions import TimeoutError as TooSlow

    try:
        # (what the URL says wins over the connect timeout given here)
        client = Redis.from_url(spec, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"the database {shown}: {_said(error, spec)}") from None
    key, value = f"kvoffload-probe:{uuid.uuid4().hex}", uuid.uuid4().hex.encode()
    try:
        client.set(key, value, ex=PROBE_EXPIRY_SECONDS)
        read = client.get(key)
        client.delete(key)
    except AuthenticationError as error:  # (a kind of NoAnswer: caught first)
        raise ConfigError(
            f"the Redis database {shown} refuses the credentials: {_said(error, spec)}"
        ) from None
    except (NoAnswer, TooSlow) as error:
        raise SetupError(
            f"the Redis database {shown} does not answer: {_said(error, spec)}"
        ) from None
    except ResponseError as error:  # no permission, a read-only replica, out of memory
        raise ConfigError(
            f"the Redis database {shown} cannot be written: {_said(error, spec)}"
        ) from None
    except RedisError as error:
        raise SetupError(
            f"the Redis database {shown} cannot be used: {_said(error, spec)}"
        ) from None
    except TypeError as error:  # a query parameter the client does not take
        raise ConfigError(
            f"the database {shown} has a parameter the Redis client does not take: "
            f"{_said(error, spec)}"
        ) from None
    if read != value:
        raise ConfigError(f"the Redis database {shown} does not give back what was written")
    return RedisExampleDatabase(client)


# -- a worker -----------------------------------------------------------------------------


def _write_atomically(path: Path, text: str) -> None:
    """``text`` in ``path``, replaced in one step: a reader sees the old file or the new."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def run_worker(
    target: str,
    profile_name: str,
    seconds: float,
    seed: int,
    database: str,
    stop_file: Path | None,
    variant: str | None = None,
    progress_file: Path | None = None,
    every: float = PROGRESS_EVERY / 2,
) -> WorkerResult:
    """One worker, in this process: batches from ``seed`` until a failure, the time limit,
    or ``stop_file`` appearing. Every batch first replays what the database holds for the
    target: a failure another worker saved comes back at once. With ``progress_file``, the
    programs and steps so far are written there about every ``every`` seconds."""
    from kvoffload.testing import campaign, profiles

    profile = profiles.get(profile_name)
    examples = open_database(database)
    stopped = None if stop_file is None else stop_file.exists
    start = time.perf_counter()
    programs = rule_steps = 0
    first_failure: float | None = None
    first_failing_program: int | None = None
    batch_seed = seed
    # The campaign runs in spans of ``every`` seconds, each from the batch after the last
    # one run (run_campaign's batch k runs seed + k): the same batches, on the same seeds,
    # as one campaign of ``seconds``, with the counts between spans to report.
    while True:
        elapsed = time.perf_counter() - start
        result = campaign.run_campaign(
            target,
            profile,
            # (never 0, which run_campaign takes for no time limit at all)
            seconds=max(min(every, seconds - elapsed), MIN_SPAN_SECONDS),
            variant=variant,
            seed=batch_seed,
            database=examples,
            stop=stopped,
        )
        rec = result.recorder
        if rec.first_failing_program is not None and first_failing_program is None:
            first_failing_program = programs + rec.first_failing_program
            first_failure = elapsed + (rec.first_failure or 0.0)
        programs += rec.programs
        rule_steps += rec.rule_steps
        batch_seed = (batch_seed if result.seed is None else result.seed) + 1
        done = time.perf_counter() - start
        if progress_file is not None:
            report = {"programs": programs, "rule_steps": rule_steps, "seconds": done}
            _write_atomically(progress_file, json.dumps(report))
        if not result.conforms or done >= seconds or (stopped is not None and stopped()):
            break
    if not result.conforms and stop_file is not None:
        stop_file.touch()
    return WorkerResult(
        0,
        seed,
        result.conforms,
        programs,
        rule_steps,
        time.perf_counter() - start,
        first_failure,
        first_failing_program,
        result.failure,
        None if result.saved is None else str(result.saved),
    )


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzRun:
    """What a run was asked: its target, profile, seconds, base seed and database (the
    spec as the workers get it, shown only :func:`redacted`)."""

    target: str
    profile: str
    seconds: float
    base: int
    database: str


@dataclass
class _Worker:
    number: int
    seed: int
    process: subprocess.Popen[bytes]
    result: Path
    progress: Path


def check_bounds(workers: int, seconds: float, seed: int | None) -> None:
    """The work asked for within :mod:`kvoffload.model.limits`, or :class:`ConfigError`."""
    require_processes(workers, "workers")
    require_seconds(seconds)
    if seed is not None:
        require_seed(seed)


def run_fuzz(
    target: str | None,
    workers: int,
    seconds: float,
    database: str | None,
    profile_name: str | None,
    seed: int | None,
    json_path: str | None = None,
) -> int:
    """``kvoffload fuzz``: ``workers`` processes for ``seconds``; 0 when every one conforms,
    1 when one found a disagreement (printed, shrunk, saved), 3 when one crashed or the
    model broke its own invariant. ``json_path`` receives the verdict as JSON
    (:func:`verdict_document`)."""
    check_bounds(workers, seconds, seed)
    from kvoffload.testing.targets import default_target
    from kvoffload.testing.targets import spec as target_row

    target = target or default_target()
    python, environment, variant, adapter = sys.executable, isolation.environment(), None, target
    if is_vllm_target(target):
        python, environment, variant = _vllm_worker(target)
        adapter = "vllm"  # the adapter of every vLLM target, in the environment just made
    elif (why := target_row(target).unavailable()) is not None:
        raise ConfigError(f"the target {target} cannot run here: {why}")
    if database is None:
        # the caller's .hypothesis/examples (or the folder its environment names), absolute
        spec = str(isolation.database_folder().absolute())
        open_database(spec, parents=True)
    else:
        spec = database if "://" in database else str(Path(database).absolute())
        open_database(spec)  # bad credentials or a folder said now, not by every worker
    run = FuzzRun(
        target,
        profile_name or "nightly",
        seconds,
        random.getrandbits(32) if seed is None else seed,
        spec,
    )
    print(
        f"fuzzing {target} with {workers} workers for {seconds:g} s, profile {run.profile}, "
        f"database {redacted(spec)}, seeds {run.base} + k * {SEED_STRIDE}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvoffload-fuzz-") as scratch:
        folder = Path(scratch).absolute()
        stop = folder / "stop"
        started: list[_Worker] = []
        with contextlib.ExitStack() as own_folders:
            try:
                for k in range(workers):
                    files = folder / f"worker-{k}"
                    files.mkdir()
                    seed_of_worker = run.base + k * SEED_STRIDE
                    result, progress = files / "result.json", files / "progress.json"
                    spec_of_worker = {
                        "target": adapter,
                        "profile": run.profile,
                        "seconds": seconds,
                        "seed": seed_of_worker,
                        "database": spec,
                        "stop": str(stop),
                        "variant": variant,
                        "result": str(result),
                        "progress": str(progress),
                    }
                    # What a worker's campaign saves stays in the run's folder: this
                    # process saves the run's failure once, in the caller's folder.
                    env = environment | {isolation.FAILURES_VARIABLE: str(files / "failures")}
                    process = subprocess.Popen(
                        isolation.python_command(python, WORKER_MODULE),
                        stdin=subprocess.PIPE,
                        env=env,
                        cwd=own_folders.enter_context(isolation.own_folder()),
                    )
                    started.append(_Worker(k, seed_of_worker, process, result, progress))
                    _send(process, spec_of_worker)
                _watch(started, seconds)
            finally:
                _end(started, stop)
        results, broken = _results(started)
    return _verdict(run, started, results, broken, json_path)


def _watch(workers: list[_Worker], seconds: float) -> None:
    """Until every worker has ended: a progress line every ``PROGRESS_EVERY`` seconds and
    when a worker ends."""
    from kvoffload.testing.progress import Progress

    # every=0: this loop decides when a line is due; Progress writes it (in place only on
    # a terminal, a line of its own anywhere else)
    shown = Progress(every=0.0)
    start = last = time.monotonic()
    running = {w.number for w in workers}
    while running:
        time.sleep(POLL_SECONDS)
        ended = {w.number for w in workers if w.number in running and w.process.poll() is not None}
        running -= ended
        now = time.monotonic()
        if ended or now - last >= PROGRESS_EVERY:
            shown.update(_progress_line(workers, now - start, seconds))
            last = now
    shown.done()


def _progress_line(workers: list[_Worker], elapsed: float, seconds: float) -> str:
    parts = []
    for w in workers:
        try:
            so_far = json.loads(w.progress.read_text())
            counts = f"{int(so_far['programs'])} programs, {int(so_far['rule_steps'])} steps"
        except (OSError, ValueError, KeyError, TypeError):
            counts = "no batch ended yet"  # no progress written yet
        ended = w.process.poll() is not None
        parts.append(f"worker {w.number} {counts}{' (ended)' if ended else ''}")
    # (a worker ends at the end of a batch: the elapsed time may pass the seconds asked)
    return f"fuzz {elapsed:.0f}/{seconds:g} s: " + "; ".join(parts)


def _end(workers: list[_Worker], stop: Path) -> None:
    """Every worker ended: a run cut short (an interrupt, an error here) stops its workers
    rather than leave them running."""
    if all(w.process.poll() is not None for w in workers):
        return
    stop.touch()
    for w in workers:
        if w.process.poll() is None:
            w.process.terminate()
    for w in workers:
        try:
            w.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()


def _results(workers: list[_Worker]) -> tuple[list[WorkerResult], list[str]]:
    results, broken = [], []
    for w in workers:
        code = w.process.returncode
        if code != 0 or not w.result.exists():
            broken.append(f"worker {w.number} exited {code} without a result")
            continue
        results.append(WorkerResult(**(json.loads(w.result.read_text()) | {"worker": w.number})))
    return results, broken


def _send(process: subprocess.Popen[bytes], spec: dict[str, Any]) -> None:
    """A worker's spec on its standard input (a few hundred bytes: never blocks)."""
    assert process.stdin is not None
    # a worker that died at once is said by its exit status
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()


def _verdict(
    run: FuzzRun,
    workers: list[_Worker],
    results: list[WorkerResult],
    broken: list[str],
    json_path: str | None,
) -> int:
    """The run's verdict printed (and written as JSON), the failure saved; its exit status."""
    for r in results:
        verdict = "conforms" if r.conforms else f"DISAGREES (program {r.first_failing_program})"
        print(
            f"worker {r.worker} (seed {r.seed}): {r.programs} programs, {r.rule_steps} steps "
            f"in {r.seconds:.0f} s: {verdict}"
        )
    found = [r for r in results if r.failure is not None]
    failure: Failure | None = None
    best: WorkerResult | None = None
    saved: Path | None = None
    if found:
        best = min(found, key=lambda r: len(r.failure["program"]) if r.failure else 0)
        failure = validate(best.failure)
        print(f"\nworker {best.worker} found:\n{failure.disagreement}")
        print("\nreproduce with:\n" + failure.reproducer())
        try:
            saved = save(failure)
        except OSError as error:
            broken.append(f"the failure could not be saved: {error.strerror or error}")
        else:
            print(f"saved to {saved}")
    status = 3 if broken or (failure and failure.broken_invariant) else 1 if failure else 0
    if json_path:
        document = verdict_document(run, workers, results, broken, status, best, failure, saved)
        Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    if broken:
        raise SetupError("; ".join(broken))
    return status


def _said_of(failure: dict[str, Any] | Failure | None) -> str:
    """A verdict in words: conforms, disagrees, or the model broke an invariant."""
    if failure is None:
        return "conforms"
    found = failure.disagreement if isinstance(failure, Failure) else failure["disagreement"]
    invariant = model_broke(str(found))
    return "disagrees" if invariant is None else f"the model broke {invariant}"


def verdict_document(
    run: FuzzRun,
    workers: list[_Worker],
    results: list[WorkerResult],
    broken: list[str],
    status: int,
    best: WorkerResult | None,
    failure: Failure | None,
    saved: Path | None,
) -> dict[str, Any]:
    """The run as JSON (``kvoffload fuzz --json``): per worker its seed, programs, steps,
    seconds, verdict and first failing program (a worker that broke: verdict ``broken``);
    the database, redacted; the verdict and exit status; the failure with its reproducer
    and the file it was saved to."""
    by_worker = {r.worker: r for r in results}
    rows: list[dict[str, Any]] = []
    for w in workers:
        r = by_worker.get(w.number)
        rows.append(
            {
                "worker": w.number,
                "seed": w.seed,
                "programs": None if r is None else r.programs,
                "rule_steps": None if r is None else r.rule_steps,
                "seconds": None if r is None else round(r.seconds, 3),
                "verdict": "broken" if r is None else _said_of(r.failure),
                "first_failing_program": None if r is None else r.first_failing_program,
            }
        )
    return {
        "target": run.target,
        "profile": run.profile,
        "seconds": run.seconds,
        "seed": run.base,
        "seed_stride": SEED_STRIDE,
        "database": redacted(run.database),
        "workers": rows,
        # a crash is no verdict on the target: never "conforms"
        "verdict": "broken" if broken and failure is None else _said_of(failure),
        "exit_status": status,
        "errors": broken,
        "found_by": None if best is None else best.worker,
        "failure": None if failure is None else failure.to_dict(),
        "reproducer": None if failure is None else failure.reproducer(),
        "saved": None if saved is None else str(saved),
    }


def _vllm_worker(spec: str) -> tuple[str, dict[str, str], str]:
    """The interpreter, environment and model variant of a vLLM target's workers: a release
    or a tree in the cache's interpreter, the current environment's vLLM in this one."""
    from kvoffload.upstream.install import Cache, default_cache, run_variables, write_model
    from kvoffload.vllm_target.forms import TARGET_VARIABLE, checks_for, parse

    target = parse(spec)
    row, _ = checks_for(target, "conform")
    cache = Cache(default_cache())
    if target.kind == "current":
        if target.version is None:
            raise SetupError("no vLLM is installed in this environment (--target vllm)")
        write_model(cache)
        # The workers' failures name the target they ran on (testing/failure.py): here the
        # vLLM this environment imports, as the parent found it.
        variables = run_variables(cache.model) | {
            "KVOFFLOAD_VLLM_VERSION": target.version,
            TARGET_VARIABLE: json.dumps(target.identity(), sort_keys=True),
        }
        return sys.executable, isolation.environment(extra=variables), row.model_variant
    version = target.version or "unknown"
    ready = cache.installed(version) if target.kind == "release" else cache.ready()
    if not ready:
        raise ConfigError(f"{spec} cannot run: `kvoffload install vllm==X.Y.Z` first")
    # A tree's identity carries its content digest, so that a failure found by a worker
    # names the very sources it ran (replay refuses a tree that has changed since).
    environment = cache.environment(version, target.path, target.identity())
    return str(cache.python), environment, row.model_variant


def main() -> int:
    """A worker process: ``python -P -m kvoffload.fuzz``, its spec (a JSON object
    of :func:`run_fuzz`) on standard input; its result written to the spec's result file.
    What it prints when it breaks holds none of the database's secrets."""
    # torch warns at import where NumPy is absent, which it never needs here (as cli.main)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    spec = json.loads(sys.stdin.read(MAX_SPEC_BYTES))
    database = str(spec["database"])
    try:
        result = run_worker(
            spec["target"],
            spec["profile"],
            float(spec["seconds"]),
            int(spec["seed"]),
            database,
            Path(spec["stop"]),
            spec["variant"],
            Path(spec["progress"]),
        )
    except KeyboardInterrupt:
        return 130
    except KVOffloadError as error:
        print(f"kvoffload fuzz worker: {_said(error, database)}", file=sys.stderr)
        return 3
    except Exception:
        print(scrubbed(traceback.format_exc(), database), file=sys.stderr, end="")
        return 3
    _write_atomically(Path(spec["result"]), json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
