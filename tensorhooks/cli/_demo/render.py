"""What the demo prints: a section per case (what each side did, the timing), then a summary."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from tensorhooks.cli._verdict import MIN_ROUNDS, NOISE_MARGIN, Spread, verdict

from .case import Row

__all__ = ["ratio_cell", "show_demo"]


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
        console.print(row.situation)
        table = Table(show_header=True, expand=True, box=None, padding=(0, 1))
        table.add_column(row.peer, ratio=1)
        table.add_column("tensorhooks", ratio=1)
        table.add_row(
            f"{_mark(row.torch.good)}{row.torch.result}[/]: {row.torch.detail}",
            f"{_mark(row.ours.good)}{row.ours.result}[/]: {row.ours.detail}",
        )
        console.print(table)
        if row.timing is not None:
            console.print(f"step time, {row.timed}: {row.timing.format()}, {verdict(row.timing)}")
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
        "step time: tensorhooks over its peer (offload_parameters: over no offload), median of "
        f"the per-round ratios; 'faster' or 'slower' only when every round is, by more than "
        f"{NOISE_MARGIN:.0%}; 'noise' otherwise (always under {MIN_ROUNDS} rounds)."
    )
