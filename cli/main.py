"""The ``kvoffload`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoffload.model.errors import KVOffloadError
from kvoffload.model.variants import VARIANTS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvoffload", description="Verification kit for KV-cache CPU offloading."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk one offloading story step by step")
    demo.add_argument(
        "--variant",
        default="fixed",
        choices=sorted(VARIANTS),
        help="the model variant to run (default: fixed)",
    )
    bench = sub.add_parser("bench", help="measure copy bandwidth and scheduler cost")
    bench.add_argument("--output", help="also write the markdown report to this file")
    bench.add_argument("--quick", action="store_true", help="a small, fast subset")
    prove = sub.add_parser("prove", help="check the z3 proofs of the model's invariants")
    prove.add_argument("--verbose", action="store_true", help="print every witness")
    verify = sub.add_parser("verify", help="conformance campaign and mutation matrix")
    verify.add_argument(
        "--profile",
        choices=["fast", "ci", "nightly"],
        help="profile of the conformance campaign (default: ci with CI set, else fast); the "
        "mutation matrix runs ci, or nightly when that is chosen",
    )
    verify.add_argument("--seconds", type=float, help="run the campaign for this long")
    verify.add_argument(
        "--target",
        help="adapter to verify (default: impl, or impl-cuda), or a vLLM release as "
        "vllm==X.Y.Z (checked in its own environment, see docs/upstream.md)",
    )
    verify.add_argument(
        "--install", action="store_true", help="with --target vllm==X: install it if absent"
    )
    verify.add_argument("--no-mutants", action="store_true", help="skip the mutation matrix")
    mutants = sub.add_parser("mutants", help="the mutation matrix: is every fault found?")
    mutants.add_argument(
        "--profile", choices=["ci", "nightly"], help="Hypothesis profile (default: ci)"
    )
    mutants.add_argument("--write", help="also write the bug catalogue page to this file")
    replay = sub.add_parser("replay", help="a saved failure as a pytest regression file")
    replay.add_argument("failure", help="a JSON file under .hypothesis/kvoffload-failures/")
    replay.add_argument("--output", help="write the test to this file")
    install = sub.add_parser("install", help="install a vLLM release into the cache folder")
    install.add_argument("target", help="the release, as vllm==X.Y.Z")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except KVOffloadError as error:
        # Bad input (an unknown target, a release not installed): said plainly, no traceback.
        print(f"kvoffload {args.command}: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from kvoffload.model.demo import run_demo

        return run_demo(args.variant)
    if args.command in ("verify", "mutants", "replay"):
        from kvoffload.testing import campaign

        if args.command == "verify" and (args.target or "").startswith("vllm=="):
            from kvoffload.upstream.check import check_release

            return check_release(args.target, args.profile, args.seconds, args.install)
        if args.command == "verify":
            return campaign.run_verify(args.profile, args.seconds, args.target, not args.no_mutants)
        if args.command == "mutants":
            return campaign.run_mutants(args.profile, args.write)
        return campaign.run_replay(args.failure, args.output)
    if args.command == "install":
        from kvoffload.upstream.install import install_command

        return install_command(args.target)
    if args.command == "prove":
        from kvoffload.proofs.run import run_prove

        return run_prove(args.verbose)
    if args.command == "bench":
        from kvoffload.impl.bench import run_bench
        from kvoffload.testing.throughput import bench_section

        return run_bench(args.output, args.quick, bench_section(args.quick))
    return 2
