"""The ``bench`` subcommand: its arguments, and the call that runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from tensorhooks.cli._arguments import Subcommand, at_least_one

__all__ = ["BENCH"]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)"
    )
    parser.add_argument(
        "--rounds", type=at_least_one, default=11, help="interleaved rounds (default: 11)"
    )
    parser.add_argument(
        "--steps",
        type=at_least_one,
        default=20,
        help="timed steps per variant and round (default: 20)",
    )
    parser.add_argument("--no-gpu", action="store_true", help="skip the CUDA benchmarks")
    parser.add_argument(
        "--no-processes",
        action="store_true",
        help="skip the part that starts two processes (sync_gradients against DDP)",
    )


def _run(args: argparse.Namespace, stream: TextIO) -> int:
    from .results import BenchOptions  # noqa: PLC0415  # keeps --help fast
    from .run import run_bench  # noqa: PLC0415  # needs the cli extra

    options = BenchOptions(
        out=args.out,
        rounds=args.rounds,
        steps=args.steps,
        gpu=not args.no_gpu,
        processes=not args.no_processes,
    )
    return run_bench(options, stream)


BENCH = Subcommand(
    name="bench",
    help="time every feature against torch; write a Markdown report and a chart",
    description="Time every feature against its torch counterpart (CPU ratios, checkpoint "
    "included; sync_gradients against DDP on two local gloo processes; save_on_cpu and "
    "offload_parameters on a transformer stack when CUDA is present) and write "
    "benchmarks.md and benchmarks.png to the output directory.",
    add_arguments=_arguments,
    run=_run,
)
