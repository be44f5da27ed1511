"""The command line: ``python -m tensorhooks demo`` and ``python -m tensorhooks bench``.

Both commands work with torch alone; with the ``cli`` extra (rich, matplotlib) they draw
progress bars, tables and a chart. ``--plain`` forces the plain-text output.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch

import tensorhooks

from ._console import Console, make_console

__all__ = ["main"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tensorhooks",
        description="Try tensorhooks: a demo that checks every feature against plain autograd, "
        "and the benchmarks against torch.autograd.graph.",
    )
    parser.add_argument("--version", action="version", version=tensorhooks.__version__)
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench}")

    demo = commands.add_parser(
        "demo",
        help="train a tiny transformer under every feature and compare gradients (< 1 min)",
        description="Train a tiny transformer for a few steps under each feature, check the "
        "gradients against plain autograd and print what each feature did. Exits with status 1 "
        "if any gradient differs.",
    )
    demo.add_argument("--steps", type=int, default=8, help="training steps (default: 8)")
    demo.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--plain", action="store_true", help="plain-text output even with rich")

    bench = commands.add_parser(
        "bench",
        help="run the benchmarks against torch; write a Markdown table and a PNG chart",
        description="Measure every feature against torch.autograd.graph (CPU ratios, GPU offload "
        "when CUDA is present), run the scripts in benchmarks/, and write benchmarks.md and "
        "benchmarks.png to the output directory.",
    )
    bench.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)"
    )
    bench.add_argument(
        "--rounds", type=int, default=11, help="interleaved rounds, median taken (default: 11)"
    )
    bench.add_argument(
        "--steps", type=int, default=20, help="timed steps per mode and round (default: 20)"
    )
    bench.add_argument(
        "--scripts",
        type=Path,
        default=None,
        help="directory of benchmark scripts to run (default: benchmarks/ of the source tree)",
    )
    bench.add_argument("--no-scripts", action="store_true", help="skip the benchmark scripts")
    bench.add_argument(
        "--script-timeout",
        type=float,
        default=600.0,
        help="seconds each benchmark script may run (default: 600)",
    )
    bench.add_argument("--no-gpu", action="store_true", help="skip the GPU offload benchmark")
    bench.add_argument("--plain", action="store_true", help="plain-text output even with rich")
    return parser


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
        stream: where output goes (default: standard output).

    Returns:
        The exit status: 0 on success, 1 when the demo saw a gradient differ from plain autograd
        or a benchmark script failed, 2 on a usage error.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.command is None:
        parser.print_help(out)
        return 2
    console = make_console(out, plain=args.plain)
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"demo: --steps must be at least 1, got {args.steps}")
        return demo(console, steps=args.steps, device=args.device, seed=args.seed)
    if args.rounds < 1 or args.steps < 1:
        parser.error(
            f"bench: --rounds and --steps must be at least 1, got {args.rounds}, {args.steps}"
        )
    from ._bench import BenchOptions, run_bench  # noqa: PLC0415  # only the bench needs it

    options = BenchOptions(
        out=args.out,
        rounds=args.rounds,
        steps=args.steps,
        scripts=None if args.no_scripts else (args.scripts or _default_scripts()),
        script_timeout=args.script_timeout,
        gpu=not args.no_gpu,
    )
    return run_bench(options, console)


def _default_scripts() -> Path:
    """benchmarks/ next to the package in a source checkout, else in the working directory."""
    beside = Path(__file__).resolve().parent.parent / "benchmarks"
    return beside if beside.is_dir() else Path.cwd() / "benchmarks"


def demo(
    console: Console,
    *,
    steps: int = 8,
    device: str | None = None,
    seed: int = 0,
    **sizes: int,
) -> int:
    """Run the demo and print its table.

    Args:
        console: where output goes.
        steps: training steps per feature.
        device: torch device; CUDA when available by default.
        seed: random seed of the model and the data.
        sizes: overrides of `tensorhooks._demo.DemoConfig` model sizes (for tests).

    Returns:
        0 when every feature reproduced plain autograd's gradients, else 1.
    """
    from ._demo import DemoConfig, result_table, run_demo  # noqa: PLC0415  # keeps --help fast

    device = device or _default_device()
    if device.startswith("cuda"):
        # Longer sequences on a GPU: activations of several MiB each, as in real training, so
        # that offloading has something to move (small tensors stay on the device).
        sizes = {"batch": 32, "seq": 256} | sizes
    config = DemoConfig(steps=steps, seed=seed, device=device, **sizes)
    console.line(
        f"tensorhooks {tensorhooks.__version__} demo on {config.device} (torch {torch.__version__})"
    )
    started = time.perf_counter()
    result = run_demo(config, console)
    millions = result.parameters / 1e6
    plural = "s" if steps != 1 else ""
    console.line(
        f"Trained a tiny transformer ({config.layers} layers, d_model {config.d_model}, "
        f"{millions:.2f}M parameters, batch {config.batch}x{config.seq} tokens) for {steps} "
        f"step{plural} under each feature; loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}."
    )
    columns, rows = result_table(result)
    console.table("What each feature did, checked against plain autograd", columns, rows)
    elapsed = time.perf_counter() - started
    if result.all_matched:
        console.line(f"Every gradient matched plain autograd ({elapsed:.1f}s).")
        return 0
    failed = [row.feature for row in result.rows if not row.matched]
    console.line(f"GRADIENT MISMATCH in: {', '.join(failed)} ({elapsed:.1f}s).")
    return 1
