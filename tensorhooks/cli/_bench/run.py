"""``python -m tensorhooks bench`` from start to end: run every part, print, write the report.

See `tensorhooks.cli._bench` for what each part measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import torch
from rich.table import Table

from tensorhooks.cli._console import format_bytes, make_console, progress
from tensorhooks.cli._environment import environment
from tensorhooks.cli._harness import SKIPPED, TARGET_MARKERS
from tensorhooks.cli._verdict import MIN_ROUNDS, Spread, TargetVerdict

from .chart import write_chart
from .cpu import cpu_variants, round_seconds, run_cpu
from .cuda import run_offload, run_offload_parameters
from .report import CHART_NAME, MARKDOWN_NAME, markdown
from .results import (
    OFFLOAD_PARAMETERS,
    SAVE_ON_CPU,
    SYNC,
    BenchOptions,
    BenchReport,
    Comparison,
    GpuRow,
    word,
)
from .sync import run_sync, sync_seconds

__all__ = ["run_bench"]


def _cell(spread: Spread | None) -> str:
    return "-" if spread is None else f"{spread.median:.2f}x\n{spread.low:.2f}-{spread.high:.2f}"


_STYLES = {
    TargetVerdict.MET: "green",
    TargetVerdict.MISSED: "bold red",
    TargetVerdict.NOT_DECIDABLE: "yellow",
}


def _target_lines(rows: Sequence[Comparison]) -> list[str]:
    """A line per target: its marker (see `TARGET_MARKERS`), the feature, the ratio, the bound."""
    return [
        f"[{_STYLES[checked.verdict]}]{TARGET_MARKERS[checked.verdict]}[/] {row.mode} at "
        f"{checked.describe()}"
        for row in rows
        for checked in row.targets
    ]


def _tally_line(report: BenchReport) -> str:
    """How many targets were met, missed, and not decidable."""
    tally = report.tally()
    return "Targets: " + ", ".join(f"{count} {reading.value}" for reading, count in tally.items())


def _decide_line(options: BenchOptions) -> str:
    """What would decide the targets this run left undecided, in one line.

    See NOTE [Reading a ratio from its rounds]: under `MIN_ROUNDS` rounds nothing is decided;
    past it, longer rounds or a quieter machine narrow the range, more rounds alone do not.
    """
    if options.rounds < MIN_ROUNDS:
        return f"To decide: at least {MIN_ROUNDS} rounds (--rounds {MIN_ROUNDS} or more)."
    return (
        f"To decide: a quieter machine or longer rounds (--steps {2 * options.steps}), "
        "not more rounds."
    )


_COLOUR = {"faster": "green", "slower": "red", "noise": "yellow"}


def _ours_over_torch(spread: Spread | None) -> str:
    """Ours over torch, with a word by the one rule (see `side`): faster, slower, or noise."""
    if spread is None:
        return "-"
    said = word(spread)
    return f"{spread.median:.2f}x [{_COLOUR[said]}]{said}[/]\n{spread.low:.2f}-{spread.high:.2f}"


def _cpu_table(rows: Sequence[Comparison]) -> Table:
    table = Table(
        title="CPU: step time relative to plain autograd (lower is better)", title_justify="left"
    )
    table.add_column("mode")  # the column that wraps on a narrow terminal
    for title in ("torch", "tensorhooks"):
        table.add_column(title, justify="right", no_wrap=True, min_width=len(title))
    table.add_column("ours/torch\nper round", justify="right", no_wrap=True, min_width=12)
    for row in rows:
        table.add_row(
            row.mode, _cell(row.torch), _cell(row.ours), _ours_over_torch(row.ours_over_torch)
        )
    return table


CELL_LEGEND = (
    "Each cell: the median ratio over the rounds, below it the lowest-highest round.",
    "ours/torch is the median of per-round ratios, not the ratio of the two medians",
    "beside it; faster or slower when every round lies past 1.00 by 5%, else noise.",
)
"""How to read the CPU table, lines of at most 80 characters."""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _duration(seconds: float) -> str:
    """A rough duration: ``"40 s"``, ``"3 min"``."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _gpu_rich_table(rows: Sequence[GpuRow], title: str, memory: str) -> Table:
    table = Table(title=f"{title} (lower is better)", title_justify="left")
    table.add_column("mode")
    table.add_column("step (ms)", justify="right", no_wrap=True, min_width=9)
    table.add_column(memory, justify="right", no_wrap=True, min_width=len(memory))
    for row in rows:
        table.add_row(
            row.mode,
            f"{1e3 * row.step.median:.1f}\n{1e3 * row.step.low:.1f}-{1e3 * row.step.high:.1f}",
            format_bytes(row.peak_bytes),
        )
    return table


def _skips(options: BenchOptions) -> dict[str, str]:
    """The parts this run leaves out, and why."""
    skipped = {}
    if not options.processes:
        skipped[SYNC] = "--no-processes"
    if not options.gpu:
        why = "--no-gpu"
    elif not torch.cuda.is_available():
        why = "no CUDA device"
    else:
        return skipped
    return skipped | {SAVE_ON_CPU: why, OFFLOAD_PARAMETERS: why}


def run_bench(options: BenchOptions, stream: TextIO | None = None, width: int | None = None) -> int:
    """Run every benchmark, print the tables, write the Markdown report and the chart.

    Args:
        options: what to run and where to write.
        stream: where output goes (standard output by default).
        width: the console's width (default: the terminal's).

    Returns:
        0 (a missed target is reported, not an error).
    """
    console = make_console(stream, width)
    skipped = _skips(options)
    gpu = SAVE_ON_CPU not in skipped
    report = BenchReport(skipped=skipped, environment=environment("cuda" if gpu else "cpu"))
    console.print(f"tensorhooks bench: {report.environment}")
    total = options.rounds * (3 if gpu else 1) + (SYNC not in skipped)
    variants = cpu_variants()
    seconds = options.rounds * round_seconds(variants, options.steps)
    if SYNC not in skipped:
        seconds += sync_seconds(options)
    rounds = f"{_count(options.rounds, 'round')} x {_count(options.steps, 'step')}"
    console.print(
        f"About {_duration(seconds)} here ({rounds}"
        f"{', two processes included' if SYNC not in skipped else ''})"
        f"{', then the CUDA part' if gpu else ''}.",
        highlight=False,
    )
    with progress(console, total, "CPU rounds", lines=True) as advance:
        report.cpu = run_cpu(options, lambda done: advance(f"CPU round {done}"), variants)
        if SYNC not in skipped:
            row, report.sync = run_sync(options)
            report.cpu.append(row)
            advance("two processes: done")
        if gpu:
            report.gpu = run_offload(options, advance=lambda done: advance(f"CUDA round {done}"))
            report.params = run_offload_parameters(
                options, advance=lambda done: advance(f"CUDA round {done}")
            )
    console.print(_cpu_table(report.cpu))
    for line in CELL_LEGEND:
        console.print(line)
    if report.sync:
        console.print(f"sync_gradients vs DDP: {report.sync}; plain = no synchronisation.")
    if report.gpu:
        console.print(_gpu_rich_table(report.gpu, SAVE_ON_CPU, "peak activations"))
    if report.params:
        console.print(_gpu_rich_table(report.params, OFFLOAD_PARAMETERS, "peak memory"))
    for part, why in skipped.items():
        console.print(f"{SKIPPED} {part} ({why})")
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / MARKDOWN_NAME).write_text(markdown(report, options))
    write_chart(report, options.out / CHART_NAME)
    for line in _target_lines(report.cpu):
        console.print(line)
    console.print(_tally_line(report))
    if report.tally()[TargetVerdict.NOT_DECIDABLE]:
        console.print(_decide_line(options))
    console.print(f"Wrote {options.out / MARKDOWN_NAME} and {options.out / CHART_NAME}.")
    return 0
