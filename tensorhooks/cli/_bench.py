"""``python -m tensorhooks bench``: every feature against its torch counterpart, in one run.

Timed with the one harness (see NOTE [How tensorhooks times things]): every variant of the CPU
reference workload (fwd+bwd of 50 x Linear(64, 64) + ReLU, batch 8, one intra-op thread; also
under tensorhooks' and torch's non-reentrant checkpoint, one region per layer) and of a tiny
Llama/Mixtral-style transformer (`TinyLlama`) in interleaved rounds, ratios per round, medians
shown with their range; sync_gradients against DDP on two local gloo processes
(`run_two_processes`, unless ``--no-processes``); on CUDA a transformer stack under save_on_cpu
(step time and peak activation memory) and under offload_parameters (step time and peak device
memory), each part skipped without CUDA, saying so.
"""

from __future__ import annotations

import contextlib
import copy
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.table import Table
from torch import nn
from torch.autograd import graph as torch_graph
from torch.utils import checkpoint as torch_checkpoint

import tensorhooks

from ._demo import format_bytes
from ._harness import (
    NOISE_MARGIN,
    SKIPPED,
    TARGET_MET,
    TARGET_MISSED,
    Spread,
    Timings,
    interleaved,
    verdict,
)
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
from ._sync_bench import SyncConfig, run_two_processes

__all__ = ["BenchOptions", "BenchReport", "run_bench"]

MARKDOWN_NAME = "benchmarks.md"
CHART_NAME = "benchmarks.png"
OFFLOAD_CONFIG = ModelConfig(batch=8, seq=512, d_model=1024, heads=16, layers=12, device="cuda")
# Smaller than benchmarks/sync_gradients.py's default (6 x Linear(1024, 1024)): the bench's steps
# per round apply here too, and the whole bench should take about a minute on two cores.
SYNC_CONFIG = SyncConfig(layers=4, width=512, batch=32)


@dataclass(frozen=True)
class BenchOptions:
    """What the bench runs and where it writes."""

    out: Path
    rounds: int = 11
    steps: int = 20
    gpu: bool = True
    processes: bool = True  # run sync_gradients on two gloo processes


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
    """One mode of a CUDA benchmark."""

    mode: str
    step: Spread  # seconds
    peak_bytes: int


# The parts of the bench besides the CPU table, by the name the report gives them.
SYNC = "sync_gradients"
SAVE_ON_CPU = "CUDA save_on_cpu"
OFFLOAD_PARAMETERS = "CUDA offload_parameters"


@dataclass
class BenchReport:
    """Everything one bench run measured, and what it skipped and why."""

    cpu: list[Comparison] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)  # save_on_cpu on a transformer stack
    params: list[GpuRow] = field(default_factory=list)  # offload_parameters, against resident
    skipped: dict[str, str] = field(default_factory=dict)  # part: why
    sync: str = ""  # the two-process setting in words, when it ran
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


def _checkpointed_step(
    model: nn.Sequential, batch: torch.Tensor, checkpoint: Callable[..., Any]
) -> Callable[[], None]:
    """A step of ``model`` (Linear, ReLU, ...) with each Linear + ReLU one checkpointed region."""
    regions = [nn.Sequential(model[i], model[i + 1]) for i in range(0, len(model), 2)]

    def step() -> None:
        hidden = batch
        for region in regions:
            hidden = checkpoint(region, hidden)
        backward(hidden.square().mean())

    return step


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
        "torch checkpoint": _checkpointed_step(
            model, batch, partial(torch_checkpoint.checkpoint, use_reentrant=False)
        ),
        "ours checkpoint": _checkpointed_step(model, batch, tensorhooks.checkpoint),
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
    ("checkpoint (non-reentrant)", "torch checkpoint", "ours checkpoint",
     (Target("ours checkpoint", "torch checkpoint", 1.05, "x torch"),)),
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


def compare(
    timings: Timings,
    mode: str,
    theirs: str,
    ours: str | None,
    targets: Sequence[Target] = (),
    *,
    plain: str = "plain",
) -> Comparison:
    """One row of the table: torch's and ours over ``plain``, ours over torch, the targets."""
    checked = tuple((target.label, *target.check(timings), target.at_most) for target in targets)
    return Comparison(
        mode,
        timings.ratio(theirs, plain),
        timings.ratio(ours, plain) if ours else None,
        timings.ratio(ours, theirs) if ours else None,
        checked,
        reference=ours is None,
    )


def run_cpu(
    options: BenchOptions, advance: Callable[[int], None] | None = None
) -> list[Comparison]:
    """Time every feature on the CPU reference workload, one intra-op thread."""
    timings = interleaved(
        _cpu_variants(), rounds=options.rounds, inner=options.steps, progress=advance
    )
    return [
        compare(timings, mode, theirs, ours, targets, plain=rest[0] if rest else "plain")
        for mode, theirs, ours, targets, *rest in ROWS
    ]


def run_sync(options: BenchOptions, config: SyncConfig = SYNC_CONFIG) -> tuple[Comparison, str]:
    """sync_gradients against DDP on two gloo processes: the table's row, the setting in words.

    Both over the same step without synchronisation, which stands for plain autograd here.
    """
    config = SyncConfig(
        layers=config.layers,
        width=config.width,
        batch=config.batch,
        bucket_cap_mb=config.bucket_cap_mb,
        rounds=options.rounds,
        inner=options.steps,
        warmup=config.warmup,
    )
    result = run_two_processes(config)
    target = Target("sync_gradients", "DDP", 1.10, "x DDP")
    row = compare(
        result.timings,
        "sync_gradients vs DDP (2 processes)",
        "DDP",
        "sync_gradients",
        (target,),
        plain="no sync (local)",
    )
    return row, result.describe(config)


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
            peaks[name] = _peak_bytes(step, above_allocated=True)
    timings = interleaved(
        steps, rounds=options.rounds, inner=max(1, options.steps // 4), progress=advance
    )
    return [GpuRow(name, timings.spread(name), peaks[name]) for name in contexts]


def _peak_bytes(step: Callable[[], None], *, above_allocated: bool) -> int:
    """Peak CUDA memory of one ``step``, optionally above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if above_allocated else 0
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_offload_parameters(
    options: BenchOptions,
    config: ModelConfig = OFFLOAD_CONFIG,
    transfer: tensorhooks.ParameterTransfer | None = None,
    advance: Callable[[int], None] | None = None,
) -> list[GpuRow]:
    """A transformer stack with its parameters resident and under offload_parameters.

    Peak device memory is the whole of a step's peak (weights, gradients and activations), as
    offloading parameters is what lowers it. Runs on any device with ``transfer`` (the tests run
    it on CPU with host copies, where peak memory reads 0); the bench runs it on CUDA with
    `OFFLOAD_CONFIG` and CUDA side streams, a quarter of the CPU bench's steps per round.
    """
    cuda = config.device.startswith("cuda")
    torch.manual_seed(config.seed)
    resident = TinyTransformer(config).to(config.device)
    offloaded = copy.deepcopy(resident)
    if transfer is None:
        handle = tensorhooks.offload_parameters(offloaded, device=config.device)
    else:
        handle = tensorhooks.offload_parameters(offloaded, transfer=transfer)
    batch = make_batch(config)

    def step_of(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=False)
            backward(model(*batch))

        return step

    steps = {
        "resident": step_of(resident),
        "tensorhooks offload_parameters": step_of(offloaded),
    }
    try:
        peaks = dict.fromkeys(steps, 0)
        for name, step in steps.items():
            step()  # warm-up: gradients are allocated from here on
            if cuda:
                peaks[name] = _peak_bytes(step, above_allocated=False)
        timings = interleaved(
            steps, rounds=options.rounds, inner=max(1, options.steps // 4), progress=advance
        )
    finally:
        handle.remove()
    return [GpuRow(name, timings.spread(name), peaks[name]) for name in steps]


def _cell(spread: Spread | None) -> str:
    return "-" if spread is None else f"{spread.median:.2f}x\n{spread.low:.2f}-{spread.high:.2f}"


def _target_lines(rows: Sequence[Comparison]) -> list[str]:
    return [
        f"{TARGET_MET if met else f'[bold red]{TARGET_MISSED}[/]'} {row.mode} at {median:.3f}"
        f"{label} (at most {bound:g})"
        for row in rows
        for label, median, met, bound in row.targets
    ]


def _gpu_table(rows: Sequence[GpuRow], memory: str) -> list[str]:
    lines = [
        f"| mode | step time (ms) | x {rows[0].mode} | {memory} |",
        "|---|---:|---:|---:|",
    ]
    base = rows[0].step.median
    lines.extend(
        f"| {row.mode} | {row.step.format(' ms', scale=1e3, digits=1)} | "
        f"{row.step.median / base:.2f}x | {format_bytes(row.peak_bytes)} |"
        for row in rows
    )
    return lines


def _cpu_markdown(report: BenchReport) -> list[str]:
    lines = [
        "| mode | torch (x plain) | tensorhooks (x plain) | tensorhooks / torch | targets |",
        "|---|---:|---:|---:|---|",
    ]
    for row in report.cpu:
        cells = [
            "-" if spread is None else spread.format()
            for spread in (row.torch, row.ours, row.ours_over_torch)
        ]
        targets = "; ".join(
            f"{'met' if met else '**missed**'}: {median:.3f}{label} (at most {bound:g})"
            for label, median, met, bound in row.targets
        ) or ("reference (not a feature)" if row.reference else "")
        lines.append(f"| {row.mode} | {' | '.join(cells)} | {targets} |")
    return lines


def markdown(
    report: BenchReport, options: BenchOptions, config: ModelConfig = OFFLOAD_CONFIG
) -> str:
    """The bench's report in Markdown."""
    flags = "" if options.processes else " --no-processes"
    flags += "" if options.gpu else " --no-gpu"
    lines = [
        "# tensorhooks benchmarks",
        "",
        f"{report.environment}.",
        "",
        (
            f"Command: `python -m tensorhooks bench --rounds {options.rounds} "
            f"--steps {options.steps}{flags}`. Each figure is the median over {options.rounds} "
            f"interleaved rounds of {options.steps} steps, with the lowest and highest round "
            "in brackets. Lower is better."
        ),
        "",
        "## CPU: step time relative to plain autograd",
        "",
        (
            "Forward + backward of 50 x Linear(64, 64) + ReLU, batch 8, one intra-op thread "
            "(checkpoint: each Linear + ReLU one region, against torch's "
            "`checkpoint(use_reentrant=False)`); the transformer rows: a tiny Llama/Mixtral-style "
            "model (4 layers, d_model 64, rotary attention, RMSNorm, SwiGLU, 2 layers of 4 "
            "experts top-2), batch 2 x 32 tokens, causal-LM loss, relative to its own plain "
            "autograd step."
        ),
    ]
    if report.sync:
        lines += [
            "",
            (
                "sync_gradients vs DDP: forward + backward + `p.grad = None` on each of two "
                "local gloo processes, one thread each, relative to the same step without "
                f"synchronisation (rank 0's timings). {report.sync}."
            ),
        ]
    lines += ["", *_cpu_markdown(report)]
    if SYNC in report.skipped:
        lines += ["", f"sync_gradients against DDP: skipped: {report.skipped[SYNC]}."]
    model = (
        f"{config.layers} blocks, d_model {config.d_model}, {config.heads} heads, batch "
        f"{config.batch} x {config.seq} tokens, fp32"
    )
    lines += ["", "## CUDA: save_on_cpu on a transformer stack", ""]
    if report.gpu:
        lines += [
            f"{model}. Peak activation memory: the peak of a step over the memory held before it.",
            "",
            *_gpu_table(report.gpu, "peak activation memory"),
        ]
    else:
        lines.append(f"Skipped: {report.skipped[SAVE_ON_CPU]}.")
    lines += ["", "## CUDA: offload_parameters on a transformer stack", ""]
    if report.params:
        lines += [
            (
                f"{model}; every block's parameters streamed from pinned host memory on side "
                "streams, prefetch 1. Peak device memory: the whole peak of a step (weights, "
                "gradients, activations)."
            ),
            "",
            *_gpu_table(report.params, "peak device memory"),
        ]
    else:
        lines.append(f"Skipped: {report.skipped[OFFLOAD_PARAMETERS]}.")
    lines += ["", "## Chart", "", f"![benchmarks]({CHART_NAME})", ""]
    return "\n".join(lines)


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


VERDICT_COLORS = {"faster": "tab:green", "slower": "tab:red", "same (within noise)": "tab:gray"}


def _ratio_panel(axes: Any, rows: Sequence[Comparison]) -> None:
    """The ratio tensorhooks / torch per feature, coloured by how to read it (see `verdict`)."""
    from matplotlib.patches import Patch  # noqa: PLC0415  # slow to import

    shown = [(row.mode, row.ours_over_torch) for row in rows if row.ours_over_torch is not None]
    spreads = [spread for _, spread in shown]
    positions = range(len(shown))
    axes.barh(
        positions,
        [s.median for s in spreads],
        color=[VERDICT_COLORS[verdict(s)] for s in spreads],
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
        "faster": f"faster: every round below {low:.2f}",
        "slower": f"slower: every round above {high:.2f}",
        "same (within noise)": "same, within noise",
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


def _cpu_table(rows: Sequence[Comparison]) -> Table:
    table = Table(
        title="CPU: step time relative to plain autograd (lower is better)", title_justify="left"
    )
    table.add_column("mode")  # the column that wraps on a narrow terminal
    for title in ("torch", "tensorhooks", "ours/torch"):
        table.add_column(title, justify="right", no_wrap=True, min_width=len(title))
    for row in rows:
        table.add_row(row.mode, _cell(row.torch), _cell(row.ours), _cell(row.ours_over_torch))
    return table


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
    with progress(console, total, "CPU rounds") as advance:
        report.cpu = run_cpu(options, lambda done: advance(f"CPU round {done}"))
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
    console.print("Each cell: the median ratio over the rounds, and below it the lowest-highest.")
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
    console.print(f"Wrote {options.out / MARKDOWN_NAME} and {options.out / CHART_NAME}.")
    return 0
