"""``python -m tensorhooks plan``: the activation planner on the demo's tiny Llama.

One step of `TinyLlama` is profiled; `tensorhooks.plan_activations` plans it for a few budgets;
each plan and each hand choice (no checkpointing, every block recomputed, the selective "save
matmuls" policy; with a link, boundary offload and offload everything) is measured: the peak
autograd holds, and the step time, interleaved. It prints every plan's table and a summary, and
draws budget → peak and peak → step time (``plan.png``). `compare` and `write_chart` are what
``benchmarks/plan.py`` runs too, on larger models.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

import tensorhooks
from tensorhooks._planner import PRESETS, preset_plan
from tensorhooks.cli._harness import Spread, interleaved
from tensorhooks.cli._models import LlamaConfig, TinyLlama, llama_step, make_tokens

__all__ = [
    "Measured",
    "PlanOptions",
    "compare",
    "run_plan",
    "write_chart",
]

BASELINE = "recompute"
"""The hand choice ratios are taken against: full checkpointing."""


@dataclass(frozen=True)
class PlanOptions:
    """What ``python -m tensorhooks plan`` runs."""

    out: Path = Path("plan-out")
    budgets: tuple[float, ...] = (0.4, 0.6, 0.8, 1.0)
    rounds: int = 5
    steps: int = 3
    bandwidth: float | None = None
    """A simulated host link, bytes per second (None: no offloading on a CPU)."""
    min_offload_bytes: int = 1 << 20


@dataclass(frozen=True)
class Measured:
    """A plan or hand choice, with what a step under it measured."""

    name: str
    fraction: float | None
    """The budget as a fraction of the unplanned peak, for the planner's plans; None for hand
    choices."""
    plan: tensorhooks.ActivationPlan
    peak_bytes: int
    host_bytes: int
    step: Spread
    """Seconds per step over the rounds."""
    ratio: Spread
    """Step time over full checkpointing's, per round."""


def _measured_peak(plan: tensorhooks.ActivationPlan, step: Callable[[], object]) -> tuple[int, int]:
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_host_peak_bytes is not None
    return plan.measured_peak_bytes, plan.measured_host_peak_bytes


def _applied(plan: tensorhooks.ActivationPlan, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        handle = plan.apply()
        try:
            step()
        finally:
            handle.remove()

    return run


def compare(
    model: nn.Module,
    step: Callable[[], object],
    profile: tensorhooks.StepProfile,
    *,
    budgets: Sequence[float],
    bandwidth: float | None = None,
    min_offload_bytes: int = 1 << 20,
    rounds: int = 5,
    steps: int = 3,
    cuda_events: bool = False,
    prefix: str = "",
) -> list[Measured]:
    """Plan ``step`` for each budget, add the hand choices, measure and time them all.

    Budgets below the least feasible peak are left out. The hand choices that offload are only
    there with a link (``bandwidth``, or the profile's on CUDA).

    Returns:
        One `Measured` per plan, hand choices first.
    """
    link = profile.bandwidth if bandwidth is None else bandwidth
    presets = [name for name in PRESETS if link is not None or not name.startswith("offload")]
    plans: dict[str, tuple[float | None, tensorhooks.ActivationPlan]] = {}
    for preset in presets:
        plans[prefix + preset] = (
            None,
            preset_plan(
                model,
                step,
                preset,
                profile=profile,
                bandwidth=bandwidth,
                min_offload_bytes=min_offload_bytes,
            ),
        )
    for fraction in budgets:
        try:
            plan = tensorhooks.plan_activations(
                model,
                step,
                fraction,
                profile=profile,
                bandwidth=bandwidth,
                min_offload_bytes=min_offload_bytes,
            )
        except tensorhooks.PlanBudgetError:
            continue
        plans[f"{prefix}plan {fraction:.0%}"] = (fraction, plan)
    peaks = {name: _measured_peak(plan, step) for name, (_, plan) in plans.items()}
    timings = interleaved(
        {name: _applied(plan, step) for name, (_, plan) in plans.items()},
        rounds=rounds,
        inner=steps,
        cuda_events=cuda_events,
        warmup=1,
    )
    return [
        Measured(
            name=name,
            fraction=fraction,
            plan=plan,
            peak_bytes=peaks[name][0],
            host_bytes=peaks[name][1],
            step=timings.spread(name),
            ratio=timings.ratio(name, prefix + BASELINE),
        )
        for name, (fraction, plan) in plans.items()
    ]


def _mib(nbytes: float) -> float:
    return nbytes / (1 << 20)


def _series(axes: Any, rows: Sequence[Measured], label: str, color: str) -> None:
    """The planner's plans: budget → peak (predicted and measured) on ``axes``."""
    planned = sorted(
        (row for row in rows if row.fraction is not None), key=lambda row: row.plan.budget_bytes
    )
    if not planned:
        return
    budgets = [_mib(row.plan.budget_bytes) for row in planned]
    axes.plot(budgets, [_mib(row.peak_bytes) for row in planned], "o-", color=color, label=label)
    axes.plot(
        budgets,
        [_mib(row.plan.predicted_peak_bytes) for row in planned],
        "x--",
        color=color,
        label=f"{label}: predicted",
    )


def _tradeoff(axes: Any, rows: Sequence[Measured], label: str, color: str) -> None:
    """Measured peak → measured step time (with its range) and the predicted step time."""
    planned = sorted((row for row in rows if row.fraction is not None), key=lambda r: r.peak_bytes)
    if planned:
        axes.errorbar(
            [_mib(row.peak_bytes) for row in planned],
            [1e3 * row.step.median for row in planned],
            yerr=[
                [1e3 * (row.step.median - row.step.low) for row in planned],
                [1e3 * (row.step.high - row.step.median) for row in planned],
            ],
            fmt="o-",
            color=color,
            capsize=3,
            label=f"{label}: measured",
        )
        axes.plot(
            [_mib(row.plan.predicted_peak_bytes) for row in planned],
            [1e3 * row.plan.predicted_step_seconds for row in planned],
            "x--",
            color=color,
            label=f"{label}: predicted",
        )
    for row in rows:
        if row.fraction is None:
            axes.plot(_mib(row.peak_bytes), 1e3 * row.step.median, "s", color="tab:gray")
            axes.annotate(
                row.name,
                (_mib(row.peak_bytes), 1e3 * row.step.median),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )


def write_chart(series: Sequence[tuple[str, Sequence[Measured]]], path: Path, caption: str) -> None:
    """Draw, for each series of measured plans, budget → peak and peak → step time (one row)."""
    from matplotlib.figure import Figure  # noqa: PLC0415  # slow to import

    figure = Figure(figsize=(12, 1 + 4 * len(series)), layout="constrained")
    for (label, rows), (peak_axes, time_axes) in zip(
        series, figure.subplots(len(series), 2, squeeze=False), strict=True
    ):
        _series(peak_axes, rows, label, "tab:blue")
        _tradeoff(time_axes, rows, label, "tab:blue")
        top = max(_mib(row.plan.budget_bytes) for row in rows)
        peak_axes.plot([0, top], [0, top], ":", color="tab:gray", label="budget")
        peak_axes.set_xlabel("budget, MiB")
        peak_axes.set_ylabel("peak held for backward, MiB")
        peak_axes.set_title(f"{label}: budget → peak (at or under the dotted line)", fontsize=10)
        peak_axes.legend(fontsize=8)
        time_axes.set_xlabel("peak held for backward, MiB (measured)")
        time_axes.set_ylabel("step time, ms (lower is better)")
        time_axes.set_title(f"{label}: plans, and hand choices (squares)", fontsize=10)
        time_axes.set_ylim(bottom=0)
        time_axes.legend(fontsize=8)
    figure.suptitle(textwrap.fill(caption, 140), fontsize=9)
    figure.savefig(path, dpi=100)


def _summary_table(rows: Sequence[Measured], title: str) -> Any:
    """The closing table: fits 80 columns, each figure whole (a cell wraps, never cuts)."""
    from rich import box  # noqa: PLC0415  # the cli extra
    from rich.table import Table  # noqa: PLC0415

    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
    )
    table.add_column("plan", no_wrap=True)
    host = any(row.host_bytes or row.plan.predicted_host_bytes for row in rows)
    columns = [
        "budget\nMiB",
        "peak MiB\npred/meas",
        *(["host\nMiB"] if host else []),
        "step ms\npred",
        "step ms\nmeasured",
        f"x {BASELINE}\npred/meas",
    ]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    baseline = next(row for row in rows if row.name.endswith(BASELINE)).plan
    for row in rows:
        plan = row.plan
        predicted = plan.predicted_step_seconds / baseline.predicted_step_seconds
        step, ratio = row.step, row.ratio
        table.add_row(
            row.name,
            f"{_mib(plan.budget_bytes):.2f}",
            f"{_mib(plan.predicted_peak_bytes):.2f}/{_mib(row.peak_bytes):.2f}",
            *([f"{_mib(row.host_bytes):.2f}"] if host else []),
            f"{1e3 * plan.predicted_step_seconds:.1f}",
            f"{1e3 * step.median:.1f}\n{1e3 * step.low:.1f}-{1e3 * step.high:.1f}",
            f"{predicted:.2f}/{ratio.median:.2f}\n{ratio.low:.2f}-{ratio.high:.2f}",
        )
    return table


def _notes(rows: Sequence[Measured], rounds: int) -> list[str]:
    """How to read the closing table, in lines of at most 80 characters."""
    notes = [
        f"measured: median step over {rounds} interleaved rounds, and below it the fastest-",
        f"slowest round. x {BASELINE}: step time over full checkpointing's; the measured",
        "figure is the median of per-round ratios (not the ratio of the medians), and",
        "below it the lowest-highest round.",
    ]
    matmuls = next((row for row in rows if row.name.endswith("save matmuls")), None)
    if matmuls is not None and matmuls.ratio.median > 1:
        notes += [
            "save matmuls is slower than full recompute here: a selective policy is asked",
            "about every op, and on a CPU with matmuls this small that per-op dispatch costs",
            "more than the matmuls it saves. The policy is meant for large matmuls.",
        ]
    return notes


def run_plan(options: PlanOptions, stream: TextIO | None = None, width: int | None = None) -> int:
    """Plan the tiny Llama for a few budgets; print the plans and a summary; draw the chart.

    Returns:
        0.
    """
    from tensorhooks.cli._console import make_console  # noqa: PLC0415  # the cli extra
    from tensorhooks.cli._environment import environment  # noqa: PLC0415

    console = make_console(stream, width)
    console.print(f"tensorhooks plan: {environment('cpu')}")
    started = time.perf_counter()
    torch.set_num_threads(1)
    config = LlamaConfig()
    model = TinyLlama(config)
    tokens = make_tokens(config)

    def step() -> None:
        llama_step(model, tokens)

    profile = tensorhooks.profile_step(model, step)
    rows = compare(
        model,
        step,
        profile,
        budgets=options.budgets,
        bandwidth=options.bandwidth,
        min_offload_bytes=options.min_offload_bytes,
        rounds=options.rounds,
        steps=options.steps,
    )
    for row in rows:
        if row.fraction is not None:
            console.print(f"\n[bold]{row.name}[/]")
            console.print(str(row.plan), highlight=False, markup=False, soft_wrap=True)
    console.print()
    title = (
        f"tiny Llama ({config.layers} layers, batch {config.batch} x {config.seq}), one "
        "thread:\nsaved-activation peak and step time"
    )
    console.print(_summary_table(rows, title))
    console.print()
    for line in _notes(rows, options.rounds):
        console.print(line, highlight=False, markup=False)
    options.out.mkdir(parents=True, exist_ok=True)
    chart = options.out / "plan.png"
    write_chart([("tiny Llama", rows)], chart, f"tensorhooks plan: {environment('cpu')}")
    console.print(f"chart: {chart} ({time.perf_counter() - started:.0f}s)")
    return 0
