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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvoffload.model.demo import run_demo

        return run_demo(args.variant)
    return 2
