"""``python -m tensorhooks demo`` and ``python -m tensorhooks bench``.

The command line draws with rich and charts with matplotlib: both come with the ``cli`` extra
(``pip install 'tensorhooks[cli]'``). Without them it says so in one line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

import torch

from ._plan import add_plan_command, run_plan_command

__all__ = ["main"]

EXTRAS = ("rich", "matplotlib")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, naming the (sub)command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tensorhooks",
        description="See what tensorhooks does differently from torch.autograd.graph (demo), and "
        "measure what it costs (bench).",
    )
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench}")

    demo = commands.add_parser(
        "demo",
        help="torch's contexts and tensorhooks' side by side, on the cases where they differ",
        description="Run torch's implementation and tensorhooks' of every feature on the case "
        "where they differ, say what each did, and time a training step of a tiny transformer "
        "under both. Exits with status 1 if tensorhooks got a case wrong.",
    )
    demo.add_argument("--rounds", type=_at_least_one, default=5, help="timing rounds (default: 5)")
    demo.add_argument(
        "--steps", type=_at_least_one, default=2, help="timed steps per round (default: 2)"
    )
    demo.add_argument(
        "--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument(
        "--no-processes",
        action="store_true",
        help="skip the case that starts two processes (sync_gradients)",
    )

    bench = commands.add_parser(
        "bench",
        help="time every feature against torch; write a Markdown report and a chart",
        description="Time every feature against its torch counterpart (CPU ratios, checkpoint "
        "included; sync_gradients against DDP on two local gloo processes; save_on_cpu and "
        "offload_parameters on a transformer stack when CUDA is present) and write "
        "benchmarks.md and benchmarks.png to the output directory.",
    )
    bench.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)"
    )
    bench.add_argument(
        "--rounds", type=_at_least_one, default=11, help="interleaved rounds (default: 11)"
    )
    bench.add_argument(
        "--steps",
        type=_at_least_one,
        default=20,
        help="timed steps per variant and round (default: 20)",
    )
    bench.add_argument("--no-gpu", action="store_true", help="skip the CUDA benchmarks")
    bench.add_argument(
        "--no-processes",
        action="store_true",
        help="skip the part that starts two processes (sync_gradients against DDP)",
    )
    add_plan_command(commands)
    return parser


def version() -> str:
    """Tensorhooks' version, from the installed package's metadata."""
    try:
        return importlib.metadata.version("tensorhooks")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing_extras() -> list[str]:
    """The packages of the ``cli`` extra that are not installed."""
    return [name for name in EXTRAS if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
        stream: where output goes (default: standard output).

    Returns:
        The exit status: 0 on success (a missed bench target or a skipped part is reported,
        not an error), 1 when tensorhooks got a demo case wrong, 2 on a usage error or a
        missing ``cli`` extra.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.command is None:
        parser.print_help(out)
        return 2
    missing = missing_extras()
    if missing:
        print(
            f"python -m tensorhooks {args.command}: needs {' and '.join(missing)}; install the "
            "cli extra: pip install 'tensorhooks[cli]'",
            file=sys.stderr,
        )
        return 2
    if args.command == "demo":
        device = args.device or _default_device()
        return demo(
            out,
            device=device,
            rounds=args.rounds,
            steps=args.steps,
            seed=args.seed,
            processes=not args.no_processes,
        )
    if args.command == "plan":
        return run_plan_command(args, out)
    from ._bench import BenchOptions, run_bench  # noqa: PLC0415  # needs the cli extra

    options = BenchOptions(
        out=args.out,
        rounds=args.rounds,
        steps=args.steps,
        gpu=not args.no_gpu,
        processes=not args.no_processes,
    )
    return run_bench(options, out)


def demo(
    stream: TextIO,
    *,
    device: str = "cpu",
    rounds: int = 5,
    steps: int = 2,
    seed: int = 0,
    processes: bool = True,
    width: int | None = None,
    **sizes: int,
) -> int:
    """Run the demo and print what it saw.

    Args:
        stream: where output goes.
        device: torch device of the timed model.
        rounds: timing rounds.
        steps: timed steps per round.
        seed: random seed of the model and the data.
        processes: run the case that starts two processes.
        width: the console's width (default: the terminal's).
        sizes: overrides of `ModelConfig` sizes (for tests).

    Returns:
        0 when tensorhooks did right on every case, else 1.
    """
    from ._demo import CASES, DemoConfig, run_demo  # noqa: PLC0415  # keeps --help fast
    from ._models import ModelConfig  # noqa: PLC0415
    from ._render import environment, make_console, progress, show_demo  # noqa: PLC0415

    if device.startswith("cuda"):
        # Longer sequences on a GPU: activations of several MiB each, as in real training.
        sizes = {"batch": 32, "seq": 256} | sizes
    config = DemoConfig(ModelConfig(seed=seed, device=device, **sizes), rounds, steps, processes)
    console = make_console(stream, width)
    console.print(f"tensorhooks demo: {environment(device)}")
    started = time.perf_counter()
    with progress(console, len(CASES), "running the cases") as advance:
        rows = run_demo(config, progress=lambda name: advance(f"done: {name}"))
    show_demo(console, rows)
    wrong = [row.feature for row in rows if not row.ours.good]
    elapsed = time.perf_counter() - started
    if wrong:
        console.print(
            f"[bold red]tensorhooks got a case wrong:[/] {', '.join(wrong)} ({elapsed:.0f}s)"
        )
        return 1
    console.print(f"tensorhooks did right on every case ({elapsed:.0f}s).")
    return 0
