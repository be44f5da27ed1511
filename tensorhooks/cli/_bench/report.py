"""The bench's report in Markdown: the CPU table, the CUDA tables, what was skipped, the chart."""

from __future__ import annotations

from collections.abc import Sequence

from tensorhooks.cli._console import format_bytes
from tensorhooks.cli._models import ModelConfig
from tensorhooks.cli._verdict import TargetVerdict

from .cuda import OFFLOAD_CONFIG
from .results import (
    OFFLOAD_PARAMETERS,
    SAVE_ON_CPU,
    SYNC,
    BenchOptions,
    BenchReport,
    GpuRow,
    word,
)

__all__ = ["CHART_NAME", "MARKDOWN_NAME", "markdown"]

MARKDOWN_NAME = "benchmarks.md"
CHART_NAME = "benchmarks.png"


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


_WORDS = {
    TargetVerdict.MET: "met",
    TargetVerdict.MISSED: "**missed**",
    TargetVerdict.NOT_DECIDABLE: "not decidable at this noise",
}


def _cpu_markdown(report: BenchReport) -> list[str]:
    lines = [
        (
            "| mode | torch (x plain) | tensorhooks (x plain) | tensorhooks / torch, per round | "
            "targets |"
        ),
        "|---|---:|---:|---:|---|",
    ]
    for row in report.cpu:
        cells = [
            "-" if spread is None else spread.format()
            for spread in (row.torch, row.ours, row.ours_over_torch)
        ]
        if row.ours_over_torch is not None:
            cells[2] += f" {word(row.ours_over_torch)}"
        targets = "; ".join(
            f"{_WORDS[checked.verdict]}: {checked.describe()}" for checked in row.targets
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
