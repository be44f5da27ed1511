"""The ``demo`` subcommand: its arguments, and the call that runs it."""

from __future__ import annotations

import argparse
from typing import TextIO

import torch

from tensorhooks.cli._arguments import Subcommand, at_least_one

from .case import DemoConfig

__all__ = ["DEMO"]


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch device; use cpu or cuda (cuda:N for one GPU)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build"
        raise argparse.ArgumentTypeError(
            f"{text} was asked for, but no CUDA device is available (torch {torch.__version__} "
            f"is {build}); use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: the demo runs on cpu or cuda only")
    return str(device)


def _arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument(
        "--rounds",
        type=at_least_one,
        default=defaults.rounds,
        help=f"timing rounds (default: {defaults.rounds})",
    )
    parser.add_argument(
        "--steps",
        type=at_least_one,
        default=defaults.steps,
        help=f"timed steps per round (default: {defaults.steps})",
    )
    parser.add_argument(
        "--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--no-processes",
        action="store_true",
        help="skip the case that starts two processes (sync_gradients)",
    )


def _run(args: argparse.Namespace, stream: TextIO) -> int:
    from .run import demo  # noqa: PLC0415  # needs the cli extra; keeps --help fast

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return demo(
        stream,
        device=device,
        rounds=args.rounds,
        steps=args.steps,
        seed=args.seed,
        processes=not args.no_processes,
    )


DEMO = Subcommand(
    name="demo",
    help="torch's contexts and tensorhooks' side by side, on the cases where they differ",
    description="Run torch's implementation and tensorhooks' of every feature on the case "
    "where they differ, say what each did, and time a training step of a tiny transformer "
    "under both. Exits with status 1 if tensorhooks got a case wrong.",
    add_arguments=_arguments,
    run=_run,
)
