"""``python -m tensorhooks bench``: every feature against its torch counterpart, in one run.

Timed with the one harness (see NOTE [How tensorhooks times things]): every variant of the CPU
reference workload (fwd+bwd of 50 x Linear(64, 64) + ReLU, batch 8, one intra-op thread) and of
a tiny Llama/Mixtral-style transformer (`TinyLlama`) in interleaved rounds, ratios per round,
medians shown with their range; on CUDA a transformer stack under save_on_cpu as well (step
time and peak activation memory), skipped without CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.table import Table
from torch.autograd import graph as torch_graph

import tensorhooks

from ._demo import format_bytes
from ._harness import Spread, Timings, interleaved
from ._models import (
    LlamaConfig,
    ModelConfig,
    NoOpMode,
    TinyLlama,
    TinyTransformer,
    backward,
    make_batch,
    make_tokens,
    mlp,
)
from ._render import environment, make_console, progress

__all__ = ["BenchOptions", "BenchReport", "run_bench"]

MARKDOWN_NAME = "benchmarks.md"
CHART_NAME = "benchmarks.png"
OFFLOAD_CONFIG = ModelConfig(batch=8, seq=512, d_model=1024, heads=16, layers=12, device="cuda")


@dataclass(frozen=True)
class BenchOptions:
    """What the bench runs and where it writes."""

    out: Path
    rounds: int = 11
    steps: int = 20
    gpu: bool = True


@dataclass(frozen=True)
class Target:
    """A bound on a ratio: ``ratio(name, reference) <= at_most``."""

    name: str
    reference: str
    at_most: float
    label: str

    def check(self, timings: Timings) -> tuple[float, bool]:
        """The median ratio and whether it meets the bound."""
        median = timings.ratio(self.name, self.reference).median
        return median, median <= self.at_most


@dataclass(frozen=True)
class Comparison:
    """One row of the CPU table: a feature under torch and under tensorhooks."""

    mode: str
    torch: Spread | None  # step time over plain autograd's, per round
    ours: Spread | None
    ours_over_torch: Spread | None
    targets: tuple[tuple[str, float, bool, float], ...] = ()  # (label, median, met, at most)
    reference: bool = False  # a floor measured for comparison, not a feature


@dataclass
class GpuRow:
    """One mode of the CUDA offload benchmark."""

    mode: str
    step: Spread  # milliseconds
    peak_bytes: int


@dataclass
class BenchReport:
    """Everything one bench run measured."""

    cpu: list[Comparison] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)
    gpu_skipped: str = ""
    environment: str = ""

    @property
    def missed(self) -> list[str]:
        """The targets missed, in words."""
        return [
            f"{row.mode}: {label} {median:.2f}"
            for row in self.cpu
            for label, median, met, _ in row.targets
            if not met
        ]


def _cpu_variants() -> dict[str, Callable[[], None]]:
    model = mlp(50)
    batch = torch.randn(8, 64)

    def step_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]], net: Any
    ) -> Callable[[], None]:
        def step() -> None:
            with context():
                backward(net(batch).square().mean())

        return step

    def identity(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    variants = {
        "plain": step_under(contextlib.nullcontext, model),
        "torch hooks": step_under(
            lambda: torch_graph.saved_tensors_hooks(identity, identity), model
        ),
        "ours hooks": step_under(
            lambda: tensorhooks.saved_tensors_hooks(identity, identity), model
        ),
        "torch offload": step_under(torch_graph.save_on_cpu, model),
        "ours offload": step_under(tensorhooks.save_on_cpu, model),
        "torch mutation": step_under(torch_graph.allow_mutation_on_saved_tensors, model),
        "ours mutation": step_under(tensorhooks.allow_mutation_on_saved_tensors, model),
        "no-op mode": step_under(NoOpMode, model),
    }
    # One layer's weight and bias per bucket: 100 parameters in 50 buckets, hooks kept registered.
    for name, register in (
        ("torch multigrad", torch_graph.register_multi_grad_hook),
        ("ours multigrad", tensorhooks.register_multi_grad_hook),
    ):
        hooked = mlp(50)
        parameters = list(hooked.parameters())
        for index in range(0, len(parameters), 2):
            register(parameters[index : index + 2], lambda grads: None)
        variants[name] = step_under(contextlib.nullcontext, hooked)
    # The tiny Llama/Mixtral-style transformer: more operators per saved tensor, in-place writes.
    config = LlamaConfig()
    llama = TinyLlama(config)
    tokens = make_tokens(config)

    def llama_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Callable[[], None]:
        def step() -> None:
            llama.zero_grad(set_to_none=True)
            with context():
                backward(llama(tokens))

        return step

    variants |= {
        "plain llama": llama_under(contextlib.nullcontext),
        "torch hooks llama": llama_under(
            lambda: torch_graph.saved_tensors_hooks(identity, identity)
        ),
        "ours hooks llama": llama_under(
            lambda: tensorhooks.saved_tensors_hooks(identity, identity)
        ),
        "torch offload llama": llama_under(torch_graph.save_on_cpu),
        "ours offload llama": llama_under(tensorhooks.save_on_cpu),
        "torch mutation llama": llama_under(torch_graph.allow_mutation_on_saved_tensors),
        "ours mutation llama": llama_under(tensorhooks.allow_mutation_on_saved_tensors),
    }
    return variants


# (mode, torch's variant, ours, targets[, plain autograd's variant]); targets from the
# project's design. Rows without a fifth entry are on the MLP, whose plain variant is "plain".
ROWS: list[tuple[Any, ...]] = [
    ("saved_tensors_hooks", "torch hooks", "ours hooks",
     (Target("ours hooks", "torch hooks", 1.10, "x torch"),)),
    ("register_multi_grad_hook", "torch multigrad", "ours multigrad",
     (Target("ours multigrad", "torch multigrad", 1.10, "x torch"),)),
    ("save_on_cpu (CPU tensors)", "torch offload", "ours offload",
     (Target("ours offload", "ours hooks", 1.05, "x identity hooks"),)),
    ("allow_mutation_on_saved_tensors", "torch mutation", "ours mutation",
     (Target("ours mutation", "torch mutation", 1 / 1.6, "x torch"),
      Target("ours mutation", "no-op mode", 1.15, "x no-op mode"))),
    ("reference: no-op TorchDispatchMode", "no-op mode", None, ()),
    ("transformer: saved_tensors_hooks", "torch hooks llama", "ours hooks llama",
     (Target("ours hooks llama", "torch hooks llama", 1.10, "x torch"),), "plain llama"),
    ("transformer: save_on_cpu (CPU tensors)", "torch offload llama", "ours offload llama",
     (Target("ours offload llama", "torch offload llama", 1.00, "x torch"),), "plain llama"),
    ("transformer: allow_mutation_on_saved_tensors", "torch mutation llama",
     "ours mutation llama",
     (Target("ours mutation llama", "torch mutation llama", 1 / 1.6, "x torch"),),
     "plain llama"),
]  # fmt: skip


def run_cpu(
    options: BenchOptions, advance: Callable[[int], None] | None = None
) -> list[Comparison]:
    """Time every feature on the CPU reference workload, one intra-op thread."""
    timings = interleaved(
        _cpu_variants(), rounds=options.rounds, inner=options.steps, progress=advance
    )
    rows = []
    for mode, theirs, ours, targets, *rest in ROWS:
        plain = rest[0] if rest else "plain"
        checked = tuple(
            (target.label, *target.check(timings), target.at_most) for target in targets
        )
        rows.append(
            Comparison(
                mode,
                timings.ratio(theirs, plain) if theirs else None,
                timings.ratio(ours, plain) if ours else None,
                timings.ratio(ours, theirs) if ours and theirs else None,
                checked,
                reference=ours is None,
            )
        )
    return rows


def run_offload(
    options: BenchOptions,
    config: ModelConfig = OFFLOAD_CONFIG,
    advance: Callable[[int], None] | None = None,
) -> list[GpuRow]:
    """A transformer stack under no offload, torch's save_on_cpu and tensorhooks'.

    Runs on any device (the tests run it on CPU, where peak memory reads 0); the bench runs it
    on CUDA with `OFFLOAD_CONFIG`, a quarter of the CPU bench's steps per round.
    """
    cuda = config.device.startswith("cuda")
    torch.manual_seed(config.seed)
    model = TinyTransformer(config).to(config.device)
    batch = make_batch(config)
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "no offload": contextlib.nullcontext,
        "torch save_on_cpu": partial(torch_graph.save_on_cpu, pin_memory=cuda),
        "tensorhooks save_on_cpu": partial(tensorhooks.save_on_cpu, pin_memory=cuda),
    }

    def step_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=False)
            with context():
                backward(model(*batch))

        return step

    steps = {name: step_under(context) for name, context in contexts.items()}
    peaks = dict.fromkeys(steps, 0)
    for name, step in steps.items():
        step()  # warm-up; gradients stay allocated, so they are not counted as activations
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - before
    timings = interleaved(
        steps, rounds=options.rounds, inner=max(1, options.steps // 4), progress=advance
    )
    return [GpuRow(name, timings.spread(name), peaks[name]) for name in contexts]


def _cell(spread: Spread | None) -> str:
    return "-" if spread is None else f"{spread.median:.2f}x\n{spread.low:.2f}-{spread.high:.2f}"


def _target_lines(rows: Sequence[Comparison]) -> list[str]:
    return [
        f"{'target met' if met else '[bold red]TARGET MISSED[/]'}: {row.mode} at {median:.2f}"
        f"{label} (at most {bound:.2f})"
        for row in rows
        for label, median, met, bound in row.targets
    ]


def markdown(
    report: BenchReport, options: BenchOptions, config: ModelConfig = OFFLOAD_CONFIG
) -> str:
    """The bench's report in Markdown."""
    lines = [
        "# tensorhooks benchmarks",
        "",
        f"{report.environment}.",
        "",
        (
            f"Command: `python -m tensorhooks bench --rounds {options.rounds} "
            f"--steps {options.steps}`. Each figure is the median over {options.rounds} "
            f"interleaved rounds of {options.steps} steps, with the lowest and highest round "
            "in brackets. Lower is better."
        ),
        "",
        "## CPU: step time relative to plain autograd",
        "",
        (
            "Forward + backward of 50 x Linear(64, 64) + ReLU, batch 8, one intra-op thread; "
            "the transformer rows: a tiny Llama/Mixtral-style model (4 layers, d_model 64, "
            "rotary attention, RMSNorm, SwiGLU, 2 layers of 4 experts top-2), batch 2 x 32 "
            "tokens, causal-LM loss, relative to its own plain autograd step."
        ),
        "",
        "| mode | torch (x plain) | tensorhooks (x plain) | tensorhooks / torch | targets |",
        "|---|---:|---:|---:|---|",
    ]
    for row in report.cpu:
        cells = [
            "-" if spread is None else spread.format()
            for spread in (row.torch, row.ours, row.ours_over_torch)
        ]
        targets = "; ".join(
            f"{'met' if met else '**missed**'}: {median:.2f}{label} (at most {bound:.2f})"
            for label, median, met, bound in row.targets
        ) or ("reference (not a feature)" if row.reference else "")
        lines.append(f"| {row.mode} | {' | '.join(cells)} | {targets} |")
    lines += ["", "## CUDA: save_on_cpu on a transformer stack", ""]
    if report.gpu:
        lines += [
            (
                f"{config.layers} blocks, d_model {config.d_model}, {config.heads} heads, batch "
                f"{config.batch} x {config.seq} tokens, fp32. Peak activation memory: the peak "
                "of a step over the memory held before it."
            ),
            "",
            "| mode | step time (ms) | x no offload | peak activation memory |",
            "|---|---:|---:|---:|",
        ]
        base = report.gpu[0].step.median
        for gpu in report.gpu:
            lines.append(
                f"| {gpu.mode} | {gpu.step.format(' ms', scale=1e3, digits=1)} | "
                f"{gpu.step.median / base:.2f}x | {format_bytes(gpu.peak_bytes)} |"
            )
    else:
        lines.append(f"Skipped: {report.gpu_skipped}.")
    lines += ["", "## Chart", "", f"![benchmarks]({CHART_NAME})", ""]
    return "\n".join(lines)


def write_chart(report: BenchReport, path: Path) -> None:
    """Draw the bench's chart: ratios with their range as error bars; lower is better."""
    from matplotlib.figure import Figure  # noqa: PLC0415  # slow to import
    from matplotlib.patches import Patch  # noqa: PLC0415

    panels = 2 if report.gpu else 1
    figure = Figure(figsize=(7.5 * panels, 5), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    cpu = axes[0]
    width = 0.38
    rows = report.cpu
    for offset, color, which in (
        (-width / 2, "tab:blue", "torch"),
        (width / 2, "tab:orange", "ours"),
    ):
        picked = [(index, getattr(row, which)) for index, row in enumerate(rows)]
        shown: list[tuple[int, Spread]] = [(i, s) for i, s in picked if s is not None]
        positions = [index + (0 if rows[index].reference else offset) for index, _ in shown]
        spreads = [spread for _, spread in shown]
        colors = ["tab:gray" if rows[index].reference else color for index, _ in shown]
        bars = cpu.bar(
            positions,
            [s.median for s in spreads],
            width,
            color=colors,
            yerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
            capsize=3,
        )
        cpu.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    cpu.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    cpu.set_xticks(
        range(len(rows)),
        [row.mode.replace("reference: ", "reference:\n") for row in rows],
        rotation=20,
        ha="right",
        fontsize=8,
    )
    cpu.set_ylabel("step time / plain autograd (lower is better)")
    cpu.set_title(
        "CPU: 50 x Linear(64, 64), batch 8, one thread\nbars: median; whiskers: min-max of rounds",
        fontsize=9,
    )
    cpu.legend(
        handles=[
            Patch(color=color, label=label)
            for color, label in (
                ("tab:blue", "torch.autograd.graph"),
                ("tab:orange", "tensorhooks"),
                ("tab:gray", "reference (not a feature)"),
            )
        ],
        fontsize=8,
    )
    if report.gpu:
        gpu = axes[1]
        names = [row.mode.replace(" save_on_cpu", "\nsave_on_cpu") for row in report.gpu]
        gpu.bar(names, [row.peak_bytes / 2**20 for row in report.gpu], color="tab:green")
        gpu.set_ylabel("peak activation memory, MiB (lower is better)", color="tab:green")
        twin = gpu.twinx()
        steps = [row.step for row in report.gpu]
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
        gpu.set_title("CUDA: transformer stack under save_on_cpu", fontsize=9)
    figure.suptitle(f"tensorhooks bench: {report.environment}", fontsize=8, wrap=True)
    figure.savefig(path, dpi=120)


def _cpu_table(rows: Sequence[Comparison]) -> Table:
    table = Table(
        title="CPU: step time relative to plain autograd (lower is better)", title_justify="left"
    )
    table.add_column("mode", no_wrap=True)
    for title in ("torch", "tensorhooks", "ours/torch"):
        table.add_column(title, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(row.mode, _cell(row.torch), _cell(row.ours), _cell(row.ours_over_torch))
    return table


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
    gpu = options.gpu and torch.cuda.is_available()
    report = BenchReport(environment=environment("cuda" if gpu else "cpu"))
    if not gpu:
        report.gpu_skipped = "no CUDA device" if options.gpu else "--no-gpu"
    console.print(f"tensorhooks bench: {report.environment}")
    total = options.rounds * (2 if gpu else 1)
    with progress(console, total, "CPU rounds") as advance:
        report.cpu = run_cpu(options, lambda done: advance(f"CPU round {done}"))
        if gpu:
            report.gpu = run_offload(options, advance=lambda done: advance(f"CUDA round {done}"))
    console.print(_cpu_table(report.cpu))
    console.print("Each cell: the median ratio over the rounds, and below it the lowest-highest.")
    if not report.gpu:
        console.print(f"CUDA offload benchmark: skipped ({report.gpu_skipped}).")
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / MARKDOWN_NAME).write_text(markdown(report, options))
    write_chart(report, options.out / CHART_NAME)
    for line in _target_lines(report.cpu):
        console.print(line)
    console.print(f"Wrote {options.out / MARKDOWN_NAME} and {options.out / CHART_NAME}.")
    return 0
