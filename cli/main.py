"""The ``kvoffload`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvoffload.model.demo import run_demo

        return run_demo(args.variant)
    if args.command == "prove":
        from kvoffload.proofs.run import run_prove

        return run_prove(args.verbose)
    if args.command == "bench":
        from kvoffload.impl.bench import run_bench

        return run_bench(args.output, args.quick)
    return 2
