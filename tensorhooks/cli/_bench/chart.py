"""The bench's chart (matplotlib): ratios with their range as whiskers; lower is better."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorhooks.cli._verdict import MIN_ROUNDS, NOISE_MARGIN, Side, Spread, side

from .results import BenchReport, Comparison, GpuRow

__all__ = ["VERDICT_COLORS", "write_chart"]


def _cpu_panel(axes: Any, rows: Sequence[Comparison]) -> None:
    """Step time over plain autograd, torch's and ours side by side, whiskers min-max."""
    from matplotlib.patches import Patch  # noqa: PLC0415  # slow to import

    width = 0.38
    highest = max(s.high for row in rows for s in (row.torch, row.ours) if s is not None)
    axes.set_ylim(0, 1.3 * highest)  # room for the legend above the bars
    for offset, color, which in (
        (-width / 2, "tab:blue", "torch"),
        (width / 2, "tab:orange", "ours"),
    ):
        picked = [(index, getattr(row, which)) for index, row in enumerate(rows)]
        shown: list[tuple[int, Spread]] = [(i, s) for i, s in picked if s is not None]
        positions = [index + (0 if rows[index].reference else offset) for index, _ in shown]
        spreads = [spread for _, spread in shown]
        colors = ["tab:gray" if rows[index].reference else color for index, _ in shown]
        axes.bar(
            positions,
            [s.median for s in spreads],
            width,
            color=colors,
            yerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
            capsize=3,
        )
        for position, spread in zip(positions, spreads, strict=True):  # above the whisker
            axes.text(position, spread.high, f"{spread.median:.2f}", ha="center", va="bottom",
                      fontsize=8)  # fmt: skip
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(rows)), [row.mode for row in rows], rotation=30, ha="right")
    axes.tick_params(axis="x", labelsize=9)
    axes.set_ylabel("step time / plain autograd (lower is better)")
    axes.set_title(
        "Step time over plain autograd (sync_gradients: over no synchronisation)\n"
        "bars: median of the rounds; whiskers: lowest-highest round",
        fontsize=10,
    )
    axes.legend(
        handles=[
            Patch(color=color, label=label)
            for color, label in (
                ("tab:blue", "torch (autograd.graph, checkpoint, DDP)"),
                ("tab:orange", "tensorhooks"),
                ("tab:gray", "reference, not a feature"),
            )
        ],
        fontsize=9,
        loc="upper center",
        ncols=3,
    )


VERDICT_COLORS = {Side.BELOW: "tab:green", Side.ABOVE: "tab:red", Side.WITHIN_NOISE: "tab:gray"}
"""The colour of a ratio tensorhooks / torch, by where its rounds lie against 1.00 (`side`)."""


def _ratio_panel(axes: Any, rows: Sequence[Comparison]) -> None:
    """The ratio tensorhooks / torch per feature, coloured by how to read it (see `side`)."""
    from matplotlib.patches import Patch  # noqa: PLC0415  # slow to import

    shown = [(row.mode, row.ours_over_torch) for row in rows if row.ours_over_torch is not None]
    spreads = [spread for _, spread in shown]
    positions = range(len(shown))
    axes.barh(
        positions,
        [s.median for s in spreads],
        color=[VERDICT_COLORS[side(s, 1.0)] for s in spreads],
        xerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
        capsize=3,
    )
    for position, spread in zip(positions, spreads, strict=True):
        axes.text(spread.high, position, f" {spread.median:.2f}", va="center", fontsize=8)
    axes.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_yticks(positions, [mode for mode, _ in shown], fontsize=9)
    axes.invert_yaxis()  # the order of the other panel, top to bottom
    axes.set_xlim(0, 1.15 * max(s.high for s in spreads))
    axes.set_xlabel("tensorhooks / torch step time (lower is better)")
    axes.set_title(
        "tensorhooks over torch, per round\nbars: median; whiskers: lowest-highest round",
        fontsize=10,
    )
    low, high = 1 - NOISE_MARGIN, 1 + NOISE_MARGIN
    labels = {
        Side.BELOW: f"faster: every round below {low:.2f}",
        Side.ABOVE: f"slower: every round above {high:.2f}",
        Side.WITHIN_NOISE: f"same, within noise (or under {MIN_ROUNDS} rounds)",
    }
    axes.figure.legend(
        handles=[Patch(color=VERDICT_COLORS[key], label=label) for key, label in labels.items()],
        fontsize=9,
        loc="outside lower center",
        ncols=3,
    )


def _gpu_panel(axes: Any, rows: Sequence[GpuRow], title: str, memory: str) -> None:
    names = [row.mode.replace(" save_on_cpu", "\nsave_on_cpu") for row in rows]
    names = [name.replace(" offload_parameters", "\noffload_parameters") for name in names]
    axes.bar(names, [row.peak_bytes / 2**20 for row in rows], color="tab:green")
    axes.set_ylabel(f"{memory}, MiB (lower is better)", color="tab:green")
    twin = axes.twinx()
    steps = [row.step for row in rows]
    twin.errorbar(
        names,
        [1e3 * s.median for s in steps],
        yerr=[
            [1e3 * (s.median - s.low) for s in steps],
            [1e3 * (s.high - s.median) for s in steps],
        ],
        fmt="o-",
        color="tab:red",
        capsize=3,
    )
    twin.set_ylabel("step time, ms (lower is better)", color="tab:red")
    twin.set_ylim(bottom=0)
    axes.set_title(title, fontsize=10)


def write_chart(report: BenchReport, path: Path) -> None:
    """Draw the bench's chart: ratios with their range as error bars; lower is better."""
    from matplotlib.figure import Figure  # noqa: PLC0415  # slow to import

    gpu = [
        (rows, title, memory)
        for rows, title, memory in (
            (report.gpu, "CUDA: transformer stack under save_on_cpu", "peak activation memory"),
            (report.params, "CUDA: transformer stack, offload_parameters", "peak device memory"),
        )
        if rows
    ]
    # One row each: the ratios to plain autograd, the ratios to torch, then the CUDA panels
    # side by side; each row a subfigure of its own, so that one row's long tick labels do not
    # push the others' axes. Stacked, the chart stays legible at the width of a docs page.
    heights = [8, 6] + [5] * bool(gpu)
    figure = Figure(figsize=(10, sum(heights) + 1), layout="constrained")
    rows = figure.subfigures(len(heights), 1, squeeze=False, height_ratios=heights)[:, 0]
    _cpu_panel(rows[0].subplots(), report.cpu)
    _ratio_panel(rows[1].subplots(), report.cpu)
    if gpu:
        for axes, (cuda, title, memory) in zip(
            rows[2].subplots(1, len(gpu), squeeze=False)[0], gpu, strict=True
        ):
            _gpu_panel(axes, cuda, title, memory)
    lines = [f"tensorhooks bench (CPU rows on one thread): {report.environment}"]
    lines += [f"skipped: {part}: {why}" for part, why in report.skipped.items()]
    caption = "\n".join(textwrap.fill(line, 120) for line in lines)
    figure.suptitle(caption, fontsize=10)
    figure.savefig(path, dpi=100)
