"""The ``kvoffload`` command line.

Exit status, for every subcommand:

- 0: the target conforms (or reaches the verdict expected of it); the command did its job;
- 1: a disagreement (or a verdict other than the one expected): the output says which;
- 2: bad usage or bad input (an unknown target, an unreadable failure file, an output folder
  that does not exist): one line on standard error, before anything runs or is written;
- 3: a broken setup (a target that cannot be built, a release environment that fails, a
  package that is not installed), the model breaking one of its own invariants on a program
  (a bug of the specification: the program is saved like any failure), or an error of
  kvoffload itself: what broke is said.

Every number an argument gives is bounded (:mod:`kvoffload.model.limits`) and checked before
anything runs; an error is one line, the values it shows cut short.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from kvoffload import __version__
from kvoffload.model.errors import ConfigError, KVOffloadError, SetupError
from kvoffload.model.limits import (
    brief,
    cores,
    cut,
    require_processes,
    require_seconds,
    require_seed,
)
from kvoffload.model.variants import VARIANTS
from kvoffload.vllm_target.forms import is_vllm_target

EXIT_CODES = """exit status: 0 conforms (or as expected), 1 a disagreement, 2 bad usage or input,
3 a broken setup, the model breaking its own invariant, or an error of kvoffload itself"""
TARGETS = (
    "impl (the implementation on the CPU), impl-cuda (on a GPU), fault:NAME (a fault of the "
    "catalogue), or vLLM: a release as vllm==X.Y.Z, a source tree or checkout as vllm@PATH, "
    "the vLLM of this environment as vllm (docs/upstream.md)"
)

# Packages some subcommands import, and how to get them.
INSTALL = {
    "torch": "pip install torch==2.13.0 (the implementation, the conformance machine)",
    "hypothesis": "pip install hypothesis",
    "z3": "pip install z3-solver",
    "crosshair": "pip install crosshair-tool",
    "redis": "pip install 'kvoffload[redis]' (a shared example database on Redis)",
}


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors said in one line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {cut(message)}\n")


T = TypeVar("T")


def seconds(text: str) -> float:
    """A finite number of seconds greater than zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{brief(text)} is not a number of seconds") from None
    return _within(require_seconds, value, text)


def _whole(text: str) -> int:
    if len(text) > 40:  # (converting a digit string takes time quadratic in its length)
        raise argparse.ArgumentTypeError(f"{brief(text)} is longer than any number taken here")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{brief(text)} is not a whole number") from None


def _within(bound: Callable[..., T], value: object, text: str) -> T:
    """``value`` (read from ``text``) checked against its bound in
    :mod:`kvoffload.model.limits`, the one place the bounds are kept, in the bound's words
    naming what was typed."""
    try:
        return bound(value, typed=text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# The mutation matrix's campaigns are independent and CPU-bound: one process per core, and
# never more (each holds its own copy of the model, the implementation and Hypothesis).
JOBS = cores()
JOBS_HELP = (
    "processes that run the mutation matrix's campaigns at once, at most one per core "
    "(default: one per core, here %(default)s); the verdict is the same for any number"
)


def processes(text: str) -> int:
    """A whole number of processes from 1 to the cores here (``--jobs``, ``--workers``)."""
    return _within(require_processes, _whole(text), text)


def seed(text: str) -> int:
    """A whole number from 0 to :data:`~kvoffload.model.limits.MAX_SEED` (a seed)."""
    return _within(require_seed, _whole(text), text)


def output_file(text: str) -> str:
    """A file that can be written: checked before the command runs, so that a long run never
    ends in a failure to save what it found."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {folder} of {text} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written")
    return text


def output_folder(text: str) -> str:
    """A folder that can be written into (created when absent, its parent existing)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    where = path if path.is_dir() else path.parent
    if not where.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {where} of {text} does not exist")
    if not os.access(where, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written")
    return text


def build_parser() -> Parser:
    parser = Parser(
        prog="kvoffload",
        description="Verification kit for KV-cache CPU offloading.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk one offloading story step by step")
    demo.add_argument(
        "--variant",
        default="fixed",
        choices=sorted(VARIANTS),
        help="the model variant to run (default: fixed)",
    )
    bench = sub.add_parser(
        "bench",
        help="measure copy bandwidth, scheduler cost (beside vLLM's when installed) and "
        "lockstep throughput",
    )
    bench.add_argument(
        "--output", type=output_file, help="also write the markdown report to this file"
    )
    bench.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write every figure as JSON"
    )
    bench.add_argument("--quick", action="store_true", help="a small, fast subset")
    prove = sub.add_parser("prove", help="check the z3 proofs of the model's invariants")
    prove.add_argument("--verbose", action="store_true", help="print every witness")
    verify = sub.add_parser(
        "verify", help="conformance campaign and mutation matrix", epilog=EXIT_CODES
    )
    verify.add_argument(
        "--profile",
        choices=["fast", "ci", "nightly"],
        help="profile of the conformance campaign (default: ci with CI set, else fast); the "
        "mutation matrix runs ci, or nightly when that is chosen",
    )
    verify.add_argument("--seconds", type=seconds, help="run the campaign for this long")
    verify.add_argument("--target", help=f"what to verify (default: impl, or impl-cuda): {TARGETS}")
    verify.add_argument(
        "--install",
        action="store_true",
        help="with a vLLM target: install the release (or the shared environment) if absent",
    )
    verify.add_argument(
        "--expect",
        metavar="conform|VARIANT",
        help="with a vLLM target: instead of its release's checks, expect it to conform (to "
        "its release's variant, or to the model variant named)",
    )
    verify.add_argument("--no-mutants", action="store_true", help="skip the mutation matrix")
    verify.add_argument("--jobs", type=processes, default=JOBS, help=JOBS_HELP)
    verify.add_argument(
        "--seed", type=seed, help="a random profile's seed (printed by every campaign)"
    )
    verify.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the verdict as JSON"
    )
    verify.add_argument(
        "--coverage",
        action="store_true",
        help="with a vLLM target: line and branch coverage of vLLM's offload code reached "
        "by the checks, a table per file (coverage.py, installed by kvoffload install)",
    )
    verify.add_argument(
        "--coverage-html",
        type=output_folder,
        metavar="DIR",
        help="with a vLLM target: also write the annotated source into DIR (implies --coverage)",
    )
    mutants = sub.add_parser("mutants", help="the mutation matrix: is every fault found?")
    mutants.add_argument(
        "--profile", choices=["ci", "nightly"], help="Hypothesis profile (default: ci)"
    )
    mutants.add_argument(
        "--write", type=output_file, help="also write the fault catalogue page to this file"
    )
    mutants.add_argument("--jobs", type=processes, default=JOBS, help=JOBS_HELP)
    mutants.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the matrix as JSON"
    )
    replay = sub.add_parser(
        "replay", help="a saved failure as a pytest file, or run again", epilog=EXIT_CODES
    )
    replay.add_argument("failure", help="a JSON file under .hypothesis/kvoffload-failures/")
    replay.add_argument("--output", type=output_file, help="write the test to this file")
    replay.add_argument(
        "--run",
        action="store_true",
        help="drive the failure's program again on the very target it failed on (a vLLM "
        "release or tree in the cache's environment, a tree only while its sources are as "
        "they were): exit status 1 while it disagrees, 0 once it conforms, 2 when that target "
        "is not here",
    )
    replay.add_argument(
        "--target",
        help=f"with --run or --html: replay on this target instead, on purpose: {TARGETS}",
    )
    replay.add_argument(
        "--html",
        type=output_file,
        metavar="FILE",
        help="drive the program again and write a page of it: per call, each tier's blocks "
        "for the model and the target side by side, the first difference marked",
    )
    fuzz = sub.add_parser(
        "fuzz",
        help="the campaign in several processes sharing one example database",
        epilog=EXIT_CODES,
    )
    fuzz.add_argument("--target", help=f"what to fuzz (default: impl, or impl-cuda): {TARGETS}")
    fuzz.add_argument(
        "--workers",
        type=processes,
        default=min(2, cores()),
        help="processes, at most one per core (default: %(default)s)",
    )
    fuzz.add_argument(
        "--seconds", type=seconds, default=60.0, help="how long each worker runs (default: 60)"
    )
    fuzz.add_argument(
        "--database",
        metavar="FOLDER|redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB]",
        help="the shared example database (default: .hypothesis/examples), which must be "
        "writable; a Redis server shares it between machines (the password is never shown)",
    )
    fuzz.add_argument(
        "--profile", choices=["fast", "nightly"], help="Hypothesis profile (default: nightly)"
    )
    fuzz.add_argument(
        "--seed", type=seed, help="worker k runs from seed SEED + k * 1000000 (printed)"
    )
    fuzz.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the verdict as JSON"
    )
    catalogue = sub.add_parser(
        "catalogue", help="the bug catalogue: which bug has a model variant, a fault, a history row"
    )
    catalogue.add_argument(
        "--write", type=output_file, metavar="FILE", help="also write the page (docs/catalogue.md)"
    )
    history = sub.add_parser(
        "history",
        help="the real bugs of vLLM's offload connector, found again release by release",
        epilog=EXIT_CODES,
    )
    history.add_argument(
        "--only",
        metavar="S1,S9",
        help="these bugs of the history only, by row or by id (no-final-flush)",
    )
    history.add_argument(
        "--profile",
        choices=["fast", "ci", "nightly"],
        help="profile of each check (default: ci, derandomized, so that the figures repeat)",
    )
    history.add_argument("--seconds", type=seconds, help="run each check for this long")
    history.add_argument(
        "--releases",
        action="store_true",
        help="also hold every release from 0.19.0 to 0.34.0 to its own checks",
    )
    history.add_argument(
        "--install", action="store_true", help="install the releases that are absent"
    )
    history.add_argument(
        "--write", type=output_file, metavar="FILE", help="also write the page (docs/history.md)"
    )
    history.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write every verdict as JSON"
    )
    install = sub.add_parser("install", help="install a vLLM release into the cache folder")
    install.add_argument("target", help="the release, as vllm==X.Y.Z")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # torch warns at import where NumPy is absent, which it never needs here.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except SetupError as error:
        print(f"kvoffload {args.command}: broken setup: {cut(str(error))}", file=sys.stderr)
        return 3
    except KVOffloadError as error:
        # Bad input (an unknown target, a release not installed): said plainly, no traceback.
        print(f"kvoffload {args.command}: {cut(str(error))}", file=sys.stderr)
        return 2
    except Exception as error:
        missing = (getattr(error, "name", None) or "").partition(".")[0]
        if isinstance(error, ModuleNotFoundError) and missing in INSTALL:
            print(
                f"kvoffload {args.command}: needs the package {missing!r}: {INSTALL[missing]}",
                file=sys.stderr,
            )
            return 3
        traceback.print_exc()
        print(
            f"kvoffload {args.command}: internal error, a bug of kvoffload: "
            f"{type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 3


# -- the subcommands: each a function of the parsed arguments, by name ----------------------


def _demo(args: argparse.Namespace) -> int:
    from kvoffload.model.demo import run_demo

    return run_demo(args.variant)


def _verify(args: argparse.Namespace) -> int:
    if is_vllm_target(args.target or ""):
        from kvoffload.upstream.check import check_release

        return check_release(
            args.target,
            profile_name=args.profile,
            seconds=args.seconds,
            install_first=args.install,
            expect=args.expect,
            seed=args.seed,
            json_path=args.json,
            coverage=args.coverage,
            coverage_html=args.coverage_html,
        )
    if args.expect:
        raise ConfigError("--expect applies to vLLM targets only")
    if args.coverage or args.coverage_html:
        raise ConfigError("--coverage measures vLLM's code: it applies to vLLM targets only")
    from kvoffload.testing import campaign

    return campaign.run_verify(
        profile_name=args.profile,
        seconds=args.seconds,
        target=args.target,
        mutants=not args.no_mutants,
        seed=args.seed,
        json_path=args.json,
        jobs=args.jobs,
    )


def _mutants(args: argparse.Namespace) -> int:
    from kvoffload.testing import campaign

    return campaign.run_mutants(
        profile_name=args.profile, write=args.write, jobs=args.jobs, json_path=args.json
    )


def _replay(args: argparse.Namespace) -> int:
    from kvoffload import replaying

    return replaying.run_replay(
        args.failure, output=args.output, run=args.run, target=args.target, html=args.html
    )


def _fuzz(args: argparse.Namespace) -> int:
    from kvoffload.fuzz import run_fuzz

    return run_fuzz(
        args.target,
        workers=args.workers,
        seconds=args.seconds,
        database=args.database,
        profile_name=args.profile,
        seed=args.seed,
        json_path=args.json,
    )


def _history(args: argparse.Namespace) -> int:
    from kvoffload.upstream.history import run_history

    return run_history(
        args.only,
        profile_name=args.profile,
        seconds=args.seconds,
        install_first=args.install,
        write=args.write,
        releases=args.releases,
        json_path=args.json,
    )


def _catalogue(args: argparse.Namespace) -> int:
    from kvoffload.upstream.catalogue import run_catalogue

    return run_catalogue(args.write)


def _install(args: argparse.Namespace) -> int:
    from kvoffload.upstream.install import install_command

    return install_command(args.target)


def _prove(args: argparse.Namespace) -> int:
    from kvoffload.proofs.run import run_prove

    return run_prove(args.verbose)


def _bench(args: argparse.Namespace) -> int:
    from kvoffload.impl.bench import run_bench
    from kvoffload.testing.throughput import bench_section
    from kvoffload.upstream.schedbench import vllm_scheduler_cost

    return run_bench(
        args.output,
        args.json,
        args.quick,
        vllm=vllm_scheduler_cost,
        lockstep=lambda: bench_section(args.quick),
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "verify": _verify,
    "mutants": _mutants,
    "replay": _replay,
    "fuzz": _fuzz,
    "history": _history,
    "catalogue": _catalogue,
    "install": _install,
    "prove": _prove,
    "bench": _bench,
}


def _run(args: argparse.Namespace) -> int:
    return COMMANDS[args.command](args)
