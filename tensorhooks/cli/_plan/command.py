"""The ``plan`` subcommand: its arguments; what it runs is imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from tensorhooks.cli._arguments import Subcommand

__all__ = ["PLAN"]


def _gigabytes_per_second(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GB/s, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--out", type=Path, default=Path("plan-out"), help="output directory (default: plan-out)"
    )
    plan.add_argument(
        "--bandwidth",
        type=_gigabytes_per_second,
        default=None,
        help="plan offloading for a simulated host link of this many GB/s (tensors of 16 KiB "
        "and more); on a CPU the tensors stay in place and count as host bytes",
    )


def _run(args: argparse.Namespace, stream: TextIO) -> int:
    from .run import PlanOptions, run_plan  # noqa: PLC0415  # torch and the models: when run

    if args.bandwidth is None:
        return run_plan(PlanOptions(out=args.out), stream)
    return run_plan(
        PlanOptions(out=args.out, bandwidth=args.bandwidth * 1e9, min_offload_bytes=16 << 10),
        stream,
    )


PLAN = Subcommand(
    name="plan",
    help="plan the tiny Llama's activations for a few budgets; table and chart",
    description="Profile one step of the demo's tiny Llama, plan what each block keeps, "
    "recomputes or offloads for a few budgets, measure each plan against no checkpointing, "
    "full checkpointing and the save-matmuls policy, and write plan.png.",
    add_arguments=_arguments,
    run=_run,
)
