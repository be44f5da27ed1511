"""What the command line prints, drawn with rich: the environment line, progress, the tables."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.utils import collect_env

from ._demo import Row
from ._harness import Spread, verdict
from ._main import version

__all__ = ["environment", "machine", "make_console", "progress", "show_demo"]


@functools.cache
def _cpu_name() -> str:
    """The CPU's model name, as ``lscpu`` (Linux) or ``sysctl`` (macOS) reports it."""
    info: str = collect_env.get_cpu_info(collect_env.run)  # type: ignore[no-untyped-call]
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Name"):
            return value.strip()
    if sys.platform == "darwin" and info.strip():
        return info.strip()
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> str:
    """The machine in words: the CPU (or the GPU when ``device`` is CUDA), cores, OS.

    Example:
        >>> "logical CPUs" in machine()
        True
    """
    cpu = f"{_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}; {cpu}"
    return cpu


def environment(device: str = "cpu") -> str:
    """One line: versions, machine and date, for every report the command line makes."""
    today = datetime.date.today().isoformat()
    return (
        f"tensorhooks {version()}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, on {machine(device)}, {today}"
    )


def make_console(stream: TextIO | None = None, width: int | None = None) -> Console:
    """A rich console writing to ``stream`` (standard output by default)."""
    return Console(file=stream, width=width, highlight=False)


@contextlib.contextmanager
def progress(console: Console, total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A progress bar over ``total`` steps; yields ``advance(description_of_next_step)``."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(next_description: str) -> None:
            bar.update(task, advance=1, description=next_description)

        yield advance


def ratio_cell(ratio: Spread | None) -> str:
    """A step-time ratio, its range, and how to read it."""
    if ratio is None:
        return "-"
    reading = verdict(ratio)
    short = {"same (within noise)": "noise"}.get(reading, reading)
    return f"{ratio.median:.2f}x {short}"


def _mark(good: bool) -> str:
    return "[green]" if good else "[bold red]"


def show_demo(console: Console, rows: Sequence[Row]) -> None:
    """Each case with what torch and tensorhooks did, then a summary table."""
    for row in rows:
        console.rule(f"[bold]{row.feature}", align="left")
        console.print(row.case)
        table = Table(show_header=True, expand=True, box=None, padding=(0, 1))
        table.add_column("torch.autograd.graph", ratio=1)
        table.add_column("tensorhooks", ratio=1)
        table.add_row(
            f"{_mark(row.torch.good)}{row.torch.result}[/]: {row.torch.detail}",
            f"{_mark(row.ours.good)}{row.ours.result}[/]: {row.ours.detail}",
        )
        console.print(table)
        if row.timing is not None:
            console.print(
                f"step time, tensorhooks / torch ({row.timed}): {row.timing.format()}, "
                f"{verdict(row.timing)}"
            )
    console.print()
    summary = Table(title="Summary: what each did", title_justify="left")
    summary.add_column("feature", no_wrap=True)
    summary.add_column("torch")
    summary.add_column("tensorhooks")
    summary.add_column("step time", min_width=7)
    for row in rows:
        summary.add_row(
            row.feature,
            f"{_mark(row.torch.good)}{row.torch.result}[/]",
            f"{_mark(row.ours.good)}{row.ours.result}[/]",
            ratio_cell(row.timing),
        )
    console.print(summary)
    console.print(
        "step time: tensorhooks over torch, median of the per-round ratios; 'noise' where the "
        "rounds disagree on which is faster."
    )
