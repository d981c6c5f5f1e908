"""``kvoffload fuzz``: the conformance campaign in several processes, on different seeds,
sharing one Hypothesis example database.

Each worker is a process running :func:`kvoffload.testing.campaign.run_campaign` on the
target from seed ``base + worker * SEED_STRIDE`` in batches, with the shared database: a
failure one worker finds (and shrinks) is saved there under the target's key, and every
other worker replays it first at its next batch. The database is a folder (local workers) or
Hypothesis's Redis database (``redis://HOST:PORT[/DB]``: workers on any number of
machines, each running ``kvoffload fuzz`` against the same server). Workers stop at their
first failure, when the time is spent, or when another worker of the same run has found a
failure (a stop file).

Invariants kept:

- every worker's seeds are disjoint from the others' (``SEED_STRIDE`` batches apart), so
  that N workers explore N times as many programs, and each is printed to rerun it;
- the run's verdict is a disagreement iff some worker found one; a worker that crashed is
  a broken setup (exit status 3), never a verdict.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.upstream.targets import is_vllm_target

SEED_STRIDE = 1_000_000
DEFAULT_DATABASE = ".hypothesis/examples"


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


def open_database(spec: str) -> ExampleDatabase:
    """The example database ``spec`` names: ``redis://HOST:PORT[/DB]`` or a folder."""
    if "://" not in spec:
        return DirectoryBasedExampleDatabase(spec)
    url = urlparse(spec)
    if url.scheme != "redis" or not url.hostname:
        raise ConfigError(f"database {spec!r} is neither a folder nor redis://HOST:PORT[/DB]")
    try:
        port = url.port or 6379
        number = int(url.path.strip("/") or 0)
    except ValueError:
        raise ConfigError(f"database {spec!r}: the port and database must be numbers") from None
    from hypothesis.extra.redis import RedisExampleDatabase
    from redis import Redis
    from redis.exceptions import RedisError

    client = Redis(host=url.hostname, port=port, db=number)
    try:
        client.ping()
    except RedisError as error:
        raise SetupError(f"the Redis database {spec} does not answer: {error}") from None
    return RedisExampleDatabase(client)


def run_worker(
    target: str,
    profile_name: str,
    seconds: float,
    seed: int,
    database: str,
    stop_file: Path | None,
    variant: str | None = None,
) -> WorkerResult:
    """One worker, in this process: batches from ``seed`` until a failure, the time limit,
    or ``stop_file`` appearing. Every batch first replays what the database holds for the
    target: a failure another worker saved comes back at once."""
    from kvoffload.testing import campaign, profiles

    result = campaign.run_campaign(
        target,
        profiles.get(profile_name),
        seconds=seconds,
        variant=variant,
        seed=seed,
        database=open_database(database),
        stop=None if stop_file is None else stop_file.exists,
    )
    rec = result.recorder
    if not result.conforms and stop_file is not None:
        stop_file.touch()
    return WorkerResult(
        0,
        seed,
        result.conforms,
        rec.programs,
        rec.rule_steps,
        result.seconds,
        rec.first_failure,
        rec.first_failing_program,
        result.failure,
        None if result.saved is None else str(result.saved),
    )


def run_fuzz(
    target: str | None,
    workers: int,
    seconds: float,
    database: str | None,
    profile_name: str | None,
    seed: int | None,
) -> int:
    """``kvoffload fuzz``: ``workers`` processes for ``seconds``; 0 when every one conforms,
    1 when one found a disagreement (printed, shrunk, saved), 3 when one crashed."""
    from kvoffload.testing.adapters import adapters, default_adapter

    target = target or default_adapter()
    python, environment, variant, adapter = sys.executable, dict(os.environ), None, target
    if is_vllm_target(target):
        python, environment, variant = _vllm_worker(target)
        adapter = "vllm"  # the adapter of every vLLM target, in the environment just made
    elif target not in adapters():
        raise ConfigError(f"unknown target {target!r}; known here: {sorted(adapters())}")
    database = database or DEFAULT_DATABASE
    open_database(database)  # a bad address is said now, not by every worker
    profile_name = profile_name or "nightly"
    base = random.getrandbits(32) if seed is None else seed
    print(
        f"fuzzing {target} with {workers} workers for {seconds:g} s, profile {profile_name}, "
        f"database {database}, seeds {base} + k * {SEED_STRIDE}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        stop = Path(folder) / "stop"
        runs = []
        for k in range(workers):
            out = Path(folder) / f"worker-{k}.json"
            spec = [adapter, profile_name, seconds, base + k * SEED_STRIDE, database, str(stop)]
            command = [python, "-m", "kvoffload.testing.fuzz", json.dumps([*spec, variant])]
            runs.append((k, out, subprocess.Popen([*command, str(out)], env=environment)))
        results, broken = [], []
        for k, out, process in runs:
            process.wait()
            if process.returncode != 0 or not out.exists():
                broken.append(f"worker {k} exited {process.returncode} without a result")
                continue
            results.append(WorkerResult(**(json.loads(out.read_text()) | {"worker": k})))
    for r in results:
        verdict = "conforms" if r.conforms else f"DISAGREES (program {r.first_failing_program})"
        print(
            f"worker {r.worker} (seed {r.seed}): {r.programs} programs, {r.rule_steps} steps "
            f"in {r.seconds:.0f} s: {verdict}"
        )
    found = [r for r in results if r.failure is not None]
    if found:
        best = min(found, key=lambda r: len(r.failure["program"]) if r.failure else 0)
        assert best.failure is not None
        from kvoffload.testing.failure import validate

        failure = validate(best.failure)
        print(f"\nworker {best.worker} found:\n{failure.disagreement}")
        print("\nreproduce with:\n" + failure.reproducer())
        if best.saved:
            print(f"saved to {best.saved}")
    if broken:
        raise SetupError("; ".join(broken))
    return 1 if found else 0


def _vllm_worker(spec: str) -> tuple[str, dict[str, str], str]:
    """The interpreter, environment and model variant of a vLLM target's workers: a release
    or a tree in the cache's interpreter, the current environment's vLLM in this one."""
    from kvoffload.upstream.install import Cache, default_cache, run_variables, write_model
    from kvoffload.upstream.targets import checks_for, parse

    target = parse(spec)
    row, _ = checks_for(target, "conform")
    cache = Cache(default_cache())
    if target.kind == "current":
        if target.version is None:
            raise SetupError("no vLLM is installed in this environment (--target vllm)")
        write_model(cache)
        variables = run_variables(cache.model) | {"KVOFFLOAD_VLLM_VERSION": target.version}
        return sys.executable, dict(os.environ) | variables, row.model_variant
    version = target.version or "unknown"
    ready = cache.installed(version) if target.kind == "release" else cache.ready()
    if not ready:
        raise ConfigError(f"{spec} cannot run: `kvoffload install vllm==X.Y.Z` first")
    return str(cache.python), cache.environment(version, target.path), row.model_variant


def main(argv: list[str]) -> int:
    """A worker process: ``python -m kvoffload.testing.fuzz SPEC_JSON RESULT_FILE``."""
    spec, out = json.loads(argv[0]), Path(argv[1])
    target, profile_name, seconds, seed, database, stop, variant = spec
    result = run_worker(target, profile_name, seconds, seed, database, Path(stop), variant)
    out.write_text(json.dumps(result.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
