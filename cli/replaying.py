"""A saved failure replayed on the target it names: ``kvoffload replay --run`` and
``--html``, and the pytest files ``kvoffload replay`` writes for vLLM's failures.

Invariants kept:

- SAME TARGET: a failure is replayed on the target it failed on (the implementation, a fault
  of the catalogue; for vLLM the release, the tree whose Python sources still have the digest
  recorded, or the environment whose vLLM is the one recorded), or on the target ``target``
  names on purpose (``replay --target``). When that target is not here, nothing runs: the
  refusal (:class:`~kvoffload.model.errors.ConfigError`, exit status 2) says what is missing
  or what changed, and how to replay elsewhere.
- NAMED VERDICT: what a replay reports is about that target alone (:attr:`Plan.label`).
- ONE HOP: a vLLM target runs in its own isolated process (the cache's interpreter with the
  release or tree, :mod:`kvoffload.testing.isolation`), which replays in-process only when its own
  identity is the one asked for, and otherwise fails; it never starts another.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.testing import isolation
from kvoffload.testing.failure import (
    MODEL_ALONE,
    SCHEDULED,
    Failure,
    load,
    model_broke,
    validate,
)
from kvoffload.testing.targets import spec, variant_of
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.vllm_target.forms import (
    checks_for,
    describe,
    from_identity,
    installed_location,
    installed_version,
    is_vllm_target,
    parse,
    running_identity,
    tree_digest,
)


@dataclass(frozen=True)
class Plan:
    """Where and how a failure is replayed."""

    label: str  # the target, in words: every verdict names it
    adapter: str  # the adapter that builds the target, in the process that replays
    variant: str  # the model variant it is compared with
    python: Path | None = None  # another interpreter to replay in; None: this process
    environment: dict[str, str] | None = None  # that interpreter's (isolated) environment


def _normal(identity: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if identity is None else {k: v for k, v in identity.items() if v is not None}


def plan(failure: Failure, target: str | None = None) -> Plan:
    """How ``failure`` is replayed on its own target, or on ``target`` (a target of the
    registry such as ``impl`` or ``fault:NAME``, or a vLLM target form); a ConfigError when
    it is not here."""
    if target is not None and not is_vllm_target(target):
        if failure.machine in SCHEDULED and target != MODEL_ALONE:
            raise ConfigError(
                f"the {failure.machine} machine's failure replays on a vLLM target or on "
                f"{MODEL_ALONE!r} (the model alone), not on {target!r}"
            )
        if target == MODEL_ALONE:
            return Plan("the model alone", MODEL_ALONE, failure.variant)
        why = spec(target).unavailable()
        if why is not None:
            raise ConfigError(f"--target {target!r} cannot run here: {why}")
        return Plan(target, target, variant_of(target))
    if target is None and failure.adapter == MODEL_ALONE:
        return Plan("the model alone", MODEL_ALONE, failure.variant)
    if target is None and not failure.elsewhere:
        why = spec(failure.adapter).unavailable()
        if why is not None:
            raise ConfigError(
                f"the target {failure.adapter} of this failure cannot run here: {why}"
            )
        return Plan(failure.adapter, failure.adapter, failure.variant)
    if target is not None:
        parsed = parse(target)
        _, checks = checks_for(parsed, "conform")
        variant = checks[0].variant  # what the target is held to conform to
        identity = _normal(parsed.identity())
    else:
        variant = failure.variant
        identity = _normal(failure.target_identity)
        if identity is None:
            raise ConfigError("a vLLM failure that does not name its target: nothing to replay on")
    assert identity is not None
    label = describe(identity)
    if _normal(running_identity()) == identity or _is_this_environment(identity):
        return Plan(label, "vllm", variant)
    return Plan(label, "vllm", variant, *_cache_process(identity, label))


def _is_this_environment(identity: dict[str, Any]) -> bool:
    """Whether ``identity`` is the vLLM this process imports (``--target vllm``'s kind)."""
    if identity["kind"] != "current":
        return False
    here = installed_location()
    if installed_version() == identity.get("version") and str(here) == identity.get("path"):
        return True
    raise ConfigError(
        f"the failure came from {describe(identity)}; this environment's vLLM is "
        f"{installed_version() or 'absent'} at {here}: replay it in that environment, or "
        "elsewhere on purpose with --target"
    )


def _cache_process(identity: dict[str, Any], label: str) -> tuple[Path, dict[str, str]]:
    """The cache's interpreter and environment for a release or a tree; a ConfigError when
    the release is not installed, or the tree is gone or changed."""
    cache = Cache(default_cache())
    version = str(identity.get("version") or "unknown")
    if identity["kind"] == "release":
        if not cache.installed(version):
            raise ConfigError(
                f"the failure came from {label}, which is not installed; run `kvoffload install "
                f"vllm=={version}` first, or replay elsewhere on purpose with --target"
            )
        return cache.python, cache.environment(version, identity=identity)
    target = from_identity(identity)
    assert target.path is not None
    if not (target.path / "vllm").is_dir():
        raise ConfigError(f"the failure came from {label}, and that tree is not there any more")
    now = tree_digest(target.path)
    if now != identity.get("digest"):
        raise ConfigError(
            f"the failure came from {label}, and the tree has changed since (its sources are "
            f"{now[:19]} now): replay it on the tree as it is with --target vllm@{target.path}"
        )
    if not cache.ready():
        raise ConfigError(
            f"the shared environment of {cache.root} is not there; run `kvoffload install "
            "vllm==X.Y.Z` (any release) first"
        )
    return cache.python, cache.environment(version, target.path, identity)


@dataclass(frozen=True)
class Outcome:
    found: str | None  # the first difference, or None: it conforms now
    label: str  # the target it was replayed on


def replay(failure: Failure, target: str | None = None, html: Path | None = None) -> Outcome:
    """Drive ``failure``'s program again on the target :func:`plan` says; with ``html``, also
    write the page of the run (:mod:`kvoffload.testing.page`)."""
    chosen = plan(failure, target)
    if chosen.python is None:
        return Outcome(_here(failure, chosen, html), chosen.label)
    with isolation.own_folder() as folder:
        result = folder / "result.json"
        request = {
            "failure": failure.to_dict(),
            "target": target,
            "html": None if html is None else str(html.absolute()),
            "result": str(result),
        }
        command = isolation.python_command(chosen.python, "kvoffload.replaying")
        assert chosen.environment is not None
        run = isolation.run(
            command, chosen.environment, folder, input=json.dumps(request), text=True
        )
        if not result.exists():
            raise SetupError(
                f"the replay on {chosen.label} did not finish (exit {run.returncode}): its "
                "environment failed before any verdict, see the output above"
            )
        answer: dict[str, Any] = json.loads(result.read_text())
    return Outcome(answer["found"], chosen.label)


def _here(failure: Failure, chosen: Plan, html: Path | None) -> str | None:
    """The failure's program on its machine, in this process."""
    from kvoffload.testing.lockstep import disagreement

    if failure.machine in SCHEDULED:
        from kvoffload.testing.scheduler_lockstep import first_difference

        if html is not None:
            raise ConfigError(
                f"--html draws the offload machine's failures, not the {failure.machine}'s"
            )
        assert failure.whole_sequence_admission is not None
        return first_difference(
            failure.config,
            failure.program,
            chosen.variant,
            failure.whole_sequence_admission,
            vllm=chosen.adapter != MODEL_ALONE,
            workers=failure.workers,
        )
    factory = spec(chosen.adapter).build
    if html is not None:
        from kvoffload.testing.page import write_page

        trace = write_page(html, failure, factory, chosen.variant, chosen.label)
        return trace.difference
    return disagreement(factory, chosen.variant, failure.config, failure.program)


def replay_or_skip(failure: Failure) -> str | None:
    """For the pytest files ``kvoffload replay`` writes: the failure replayed on its own
    target, or the test skipped with one line saying what this machine lacks."""
    import pytest

    try:
        plan(failure)
    except ConfigError as missing:
        pytest.skip(str(missing))
    return replay(failure).found


def run_replay(
    path: str,
    output: str | None = None,
    run: bool = False,
    target: str | None = None,
    html: str | None = None,
) -> int:
    """``kvoffload replay``: the saved failure at ``path`` as a pytest file (printed, and
    written to ``output``); or with ``run`` (or ``html``, a page of the run to write) the
    failure's program driven again on the target it failed on, or on ``target``
    (:mod:`kvoffload.replaying`): 0 when it conforms now, 1 while it disagrees, 3
    while the model breaks an invariant on it. The file is validated before anything is
    written or run (:mod:`kvoffload.testing.failure`)."""
    failure = load(path)
    if not (run or html):
        if target is not None:
            raise ConfigError("--target says where to replay: it goes with --run or --html")
        text = failure.regression_test()
        if output:
            Path(output).write_text(text)
        print(text)
        return 0
    outcome = replay(failure, target, None if html is None else Path(html))
    if html is not None:
        print(f"the page of the run on {outcome.label}: {html}")
    if outcome.found is None:
        print(f"no longer disagrees on {outcome.label}: the program of {path} conforms")
        return 0
    invariant = model_broke(outcome.found)
    if invariant is not None:
        print(f"the model still breaks {invariant} on the program of {path}:\n{outcome.found}")
        return 3
    print(f"still disagrees on {outcome.label}:\n{outcome.found}")
    return 1


def main() -> int:
    """The replay in a target's own process: the request on standard input (never on the
    command line), the result into the file it names."""
    request = json.loads(sys.stdin.read())
    failure = validate(request["failure"])
    try:
        chosen = plan(failure, request["target"])
        if chosen.python is not None:
            raise SetupError(f"this process is not {chosen.label}: its environment is wrong")
        html = Path(request["html"]) if request["html"] else None
        found = _here(failure, chosen, html)
    except (ConfigError, SetupError) as error:
        print(f"broken setup: {error}", file=sys.stderr)
        return 3
    Path(request["result"]).write_text(json.dumps({"found": found, "label": chosen.label}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
