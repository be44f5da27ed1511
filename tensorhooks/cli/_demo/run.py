"""The demo from start to end: run the cases, print what they gave, say whether all went right."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TextIO

import torch

from tensorhooks.cli._console import make_console, progress
from tensorhooks.cli._environment import environment
from tensorhooks.cli._models import ModelConfig

from .case import Case, Demo, DemoConfig, Row
from .cases import CASES
from .render import show_demo

__all__ = ["DIFFERENCES", "demo", "run_demo"]

DIFFERENCES = (
    "Every difference from torch, with its reason and a reproducer: docs/differences.md "
    '("Differences from torch" in the documentation).'
)
"""The demo's last line: where the differences are listed."""


def run_demo(
    config: DemoConfig,
    cases: Sequence[Case] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Run every case; return its rows.

    On a CPU the cases run on one intra-op thread (see NOTE [How long the demo times]); the
    thread count is restored at the end.

    Args:
        config: the model timed and how long.
        cases: the cases to run (default: `CASES`).
        progress: called once each case is done, with what to show on the progress line.

    Returns:
        The rows, in the order of the cases.
    """
    previous = torch.get_num_threads()
    if not config.model.device.startswith("cuda"):
        torch.set_num_threads(1)
    try:
        shared = Demo(config)
        rows: list[Row] = []
        for case in CASES if cases is None else cases:
            rows.append(Row.of(case, case.run(shared)))
            if progress is not None:
                progress(f"done: {case.feature}")
        return rows
    finally:
        torch.set_num_threads(previous)


def demo(
    stream: TextIO,
    *,
    device: str = "cpu",
    rounds: int = DemoConfig.rounds,
    steps: int = DemoConfig.steps,
    seed: int = 0,
    processes: bool = True,
    width: int | None = None,
    cases: Sequence[Case] | None = None,
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
        cases: the cases to run (default: `CASES`).
        sizes: overrides of `ModelConfig` sizes (for tests).

    Returns:
        0 when tensorhooks did right on every case, else 1.
    """
    # Longer sequences on a GPU: activations of several MiB each, as in real training. A batch
    # of 8 on a CPU: see NOTE [How long the demo times].
    cuda = device.startswith("cuda")
    sizes = ({"batch": 32, "seq": 256} if cuda else {"batch": 8}) | sizes
    config = DemoConfig(ModelConfig(seed=seed, device=device, **sizes), rounds, steps, processes)
    chosen = CASES if cases is None else cases
    console = make_console(stream, width)
    console.print(f"tensorhooks demo: {environment(device)}")
    started = time.perf_counter()
    with progress(console, len(chosen), "running the cases") as advance:
        rows = run_demo(config, chosen, progress=advance)
    show_demo(console, rows)
    wrong = [row.feature for row in rows if not row.ours.good]
    elapsed = time.perf_counter() - started
    if wrong:
        console.print(
            f"[bold red]tensorhooks got a case wrong:[/] {', '.join(wrong)} ({elapsed:.0f}s)"
        )
    else:
        console.print(f"tensorhooks did right on every case ({elapsed:.0f}s).")
    console.print(DIFFERENCES)
    return 1 if wrong else 0
