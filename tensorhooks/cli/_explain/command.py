"""The ``explain`` subcommand: its arguments; what it runs is imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from tensorhooks.cli._arguments import Subcommand

__all__ = ["CHECKPOINTING", "EXPLAIN"]

CHECKPOINTING = ("none", "layers", "children")
"""How the command's model checkpoints itself: not at all, each layer, each layer's children."""


def _budget(text: str) -> float | str:
    """A fraction in (0, 1] of the step's peak, or a size such as ``512KiB``."""
    try:
        value = float(text)
    except ValueError:
        return text  # a size with units, checked by explain
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction must be in (0, 1], got {value}")
    return value


def _arguments(explain: argparse.ArgumentParser) -> None:
    explain.add_argument(
        "--checkpoint",
        choices=CHECKPOINTING,
        default="children",
        help="how the model checkpoints itself: not at all, each layer whole, or each layer's "
        "children one by one (the trap accelerate's FSDP2 wrapping fell into; the default)",
    )
    explain.add_argument(
        "--budget",
        type=_budget,
        default=0.5,
        help="the budget to plan for: a fraction of the step's measured peak (default 0.5), or "
        "a size (512KiB, 1MiB)",
    )
    explain.add_argument(
        "--out",
        type=Path,
        default=Path("explain-out"),
        help="output directory (default: explain-out)",
    )


def _run(args: argparse.Namespace, stream: TextIO) -> int:
    from .run import ExplainOptions, run_explain  # noqa: PLC0415  # torch and the models: when run

    return run_explain(
        ExplainOptions(checkpoint=args.checkpoint, budget=args.budget, out=args.out), stream
    )


EXPLAIN = Subcommand(
    name="explain",
    help="what holds the tiny Llama's activation peak, the traps in it, and a plan that fits",
    description="Run one step of the demo's tiny Llama as it checkpoints itself (--checkpoint), "
    "say which modules and ops hold the peak of saved activations, name the traps found with "
    "their fixes, plan for the budget, and write explain.png.",
    add_arguments=_arguments,
    run=_run,
)
