"""``python -m tensorhooks bench``: every feature against torch.autograd.graph, in one run.

# NOTE [How the bench measures]
#
# Ratios, not absolute times: on a shared CPU absolute times drift by tens of percent between
# minutes, but two workloads timed in alternation drift together. Every mode (plain autograd,
# torch's implementation, tensorhooks') is timed for ``steps`` steps per round, the order of the
# modes shuffled in every round, and each figure is the median over rounds of the per-round
# ratio. CPU workloads run on one intra-op thread (the project's reference workload: a
# fwd+bwd step of a 50 x Linear(64, 64) MLP, batch 8). On CUDA a transformer stack is trained
# under save_on_cpu, and step time and peak activation memory are reported in absolute terms as
# well. The scripts in ``benchmarks/`` (each prints its own table) run as subprocesses, and their
# output is copied into the report verbatim.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import graph as torch_graph
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks

from ._console import Console, markdown_table
from ._demo import DemoConfig, TinyTransformer, format_bytes, make_batch

__all__ = ["BenchOptions", "BenchReport", "run_bench"]

MARKDOWN_NAME = "benchmarks.md"
CHART_NAME = "benchmarks.png"


@dataclass(frozen=True)
class BenchOptions:
    """What the bench runs and where it writes."""

    out: Path
    rounds: int = 11
    steps: int = 20
    scripts: Path | None = None
    script_timeout: float = 600.0
    gpu: bool = True


@dataclass
class Comparison:
    """One feature timed under torch and under tensorhooks, relative to plain autograd."""

    mode: str
    torch_ratio: float | None
    ours_ratio: float | None
    ours_over_torch: float | None
    note: str = ""


@dataclass
class GpuRow:
    """One mode of the GPU offload benchmark."""

    mode: str
    step_ms: float
    peak_bytes: int


@dataclass
class ScriptRun:
    """The output of one script of benchmarks/."""

    path: Path
    returncode: int | None
    seconds: float
    output: str


@dataclass
class BenchReport:
    """Everything one bench run measured."""

    cpu: list[Comparison] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)
    gpu_note: str = ""
    scripts: list[ScriptRun] = field(default_factory=list)
    scripts_note: str = ""
    chart_note: str = ""
    device: str = ""  # the GPU's name when the CUDA benchmark ran


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs


class _NoOpMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped __init_subclass__ in torch
    """The floor for any TorchDispatchMode-based feature: intercepts every op, does nothing."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers)


Step = Callable[[], None]


@dataclass(frozen=True)
class _Row:
    """A row of the CPU table: which timed steps it compares (names in the steps dict)."""

    mode: str
    theirs: str | None
    ours: str | None
    versus: str | None = None  # a further reference for tensorhooks' step
    versus_label: str = ""
    note: str = ""


def _cpu_modes() -> tuple[dict[str, Step], list[_Row]]:
    """The timed steps by name, and the rows of the table comparing them."""
    plain_model = _mlp(0)
    batch = torch.randn(8, 64)

    def step_under(
        context: Callable[[], contextlib.AbstractContextManager[Any]], model: nn.Module
    ) -> Step:
        def step() -> None:
            with context():
                loss = model(batch).square().mean()
                _backward(loss)

        return step

    def identity(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    steps: dict[str, Step] = {
        "plain": step_under(contextlib.nullcontext, plain_model),
        "torch hooks": step_under(
            lambda: torch_graph.saved_tensors_hooks(identity, identity), plain_model
        ),
        "ours hooks": step_under(
            lambda: tensorhooks.saved_tensors_hooks(identity, identity), plain_model
        ),
        "torch offload": step_under(torch_graph.save_on_cpu, plain_model),
        "torch mutation": step_under(torch_graph.allow_mutation_on_saved_tensors, plain_model),
        "no-op mode": step_under(_NoOpMode, plain_model),
    }
    # One layer's weight and bias per bucket: 100 parameters in 50 buckets.
    for name, register in (
        ("torch multigrad", torch_graph.register_multi_grad_hook),
        ("ours multigrad", tensorhooks.register_multi_grad_hook),
    ):
        model = _mlp(0)
        parameters = list(model.parameters())
        for index in range(0, len(parameters), 2):
            register(parameters[index : index + 2], lambda grads: None)
        steps[name] = step_under(contextlib.nullcontext, model)

    steps["ours offload"] = step_under(tensorhooks.save_on_cpu, plain_model)
    steps["ours mutation"] = step_under(tensorhooks.allow_mutation_on_saved_tensors, plain_model)
    rows = [
        _Row("saved_tensors_hooks (identity pair)", "torch hooks", "ours hooks"),
        _Row("register_multi_grad_hook (50 buckets)", "torch multigrad", "ours multigrad"),
        _Row(
            "save_on_cpu (CPU tensors)",
            "torch offload",
            "ours offload",
            "ours hooks",
            "identity hooks",
        ),
        _Row(
            "allow_mutation_on_saved_tensors",
            "torch mutation",
            "ours mutation",
            "no-op mode",
            "a no-op TorchDispatchMode",
        ),
    ]
    rows.append(
        _Row("no-op TorchDispatchMode", "no-op mode", None, note="reference: the cost of any mode")
    )
    return steps, rows


def _time_steps(step: Step, count: int, device: str = "cpu") -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(count):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / count


def _interleaved(
    steps: dict[str, Step],
    options: BenchOptions,
    advance: Callable[[str], None],
    device: str = "cpu",
) -> dict[str, list[float]]:
    """Per-round step times of every mode, the order shuffled in every round."""
    order = list(steps)
    for name in order:  # one warm-up step each
        steps[name]()
    times: dict[str, list[float]] = {name: [] for name in order}
    shuffle = random.Random(0)
    for round_index in range(options.rounds):
        shuffle.shuffle(order)
        for name in order:
            times[name].append(_time_steps(steps[name], options.steps, device))
        advance(f"round {round_index + 1}/{options.rounds} done")
    return times


def _median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def run_cpu(options: BenchOptions, advance: Callable[[str], None]) -> list[Comparison]:
    """Time every feature on the CPU reference workload; ratios against plain and torch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps, rows = _cpu_modes()
        times = _interleaved(steps, options, advance)
    finally:
        torch.set_num_threads(threads)
    plain = times["plain"]
    comparisons = []
    for row in rows:
        torch_ratio = _median_ratio(times[row.theirs], plain) if row.theirs else None
        ours_ratio = _median_ratio(times[row.ours], plain) if row.ours else None
        ours_over = None
        if row.ours and row.theirs:
            ours_over = _median_ratio(times[row.ours], times[row.theirs])
        note = row.note
        if row.ours and row.versus:
            versus = _median_ratio(times[row.ours], times[row.versus])
            note = f"tensorhooks at {versus:.2f}x {row.versus_label}"
        comparisons.append(Comparison(row.mode, torch_ratio, ours_ratio, ours_over, note))
    return comparisons


OFFLOAD_CONFIG = DemoConfig(batch=8, seq=512, d_model=1024, heads=16, layers=12, device="cuda")


def run_offload(
    options: BenchOptions, advance: Callable[[str], None], config: DemoConfig = OFFLOAD_CONFIG
) -> list[GpuRow]:
    """Train a transformer stack under save_on_cpu: step time, and peak memory on CUDA.

    Runs on any device (the tests run it on CPU, where the peak memory reads 0); the bench runs
    it on CUDA with :data:`OFFLOAD_CONFIG`. Steps per round are a quarter of the CPU bench's,
    since one step of the CUDA workload is far longer.
    """
    cuda = config.device.startswith("cuda")
    torch.manual_seed(config.seed)
    model = TinyTransformer(config).to(config.device)
    batch = make_batch(config, 0)
    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "plain autograd": contextlib.nullcontext,
        f"torch save_on_cpu(pin_memory={cuda})": partial(torch_graph.save_on_cpu, pin_memory=cuda),
    }
    contexts[f"tensorhooks save_on_cpu(pin_memory={cuda})"] = partial(
        tensorhooks.save_on_cpu, pin_memory=cuda
    )

    def step_under(context: Callable[[], contextlib.AbstractContextManager[Any]]) -> Step:
        def step() -> None:
            model.zero_grad(set_to_none=False)
            with context():
                loss = model(*batch)
                _backward(loss)

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
    quarter = BenchOptions(options.out, options.rounds, max(1, options.steps // 4))
    times = _interleaved(steps, quarter, advance, device=config.device)
    return [GpuRow(name, 1000 * statistics.median(times[name]), peaks[name]) for name in contexts]


def run_scripts(
    directory: Path, timeout: float, advance: Callable[[str], None], scripts: Sequence[Path]
) -> list[ScriptRun]:
    """Run each benchmark script with this interpreter; capture its output."""
    runs = []
    root = directory.resolve().parent
    env = dict(os.environ)
    # Scripts import tensorhooks from the source tree they sit in, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    for path in scripts:
        started = time.perf_counter()
        try:
            done = subprocess.run(  # runs this project's own scripts
                [sys.executable, str(path)],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            output, returncode = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as expired:
            captured = expired.stdout or b""
            text = captured.decode() if isinstance(captured, bytes) else captured
            output, returncode = text + f"\n[stopped after {timeout:.0f}s]", None
        runs.append(ScriptRun(path, returncode, time.perf_counter() - started, output))
        advance(f"{path.name} done")
    return runs


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _cpu_table(rows: Sequence[Comparison]) -> tuple[list[str], list[list[str]]]:
    columns = ["mode", "torch (x plain)", "tensorhooks (x plain)", "tensorhooks / torch", "note"]
    return columns, [
        [
            row.mode,
            _ratio(row.torch_ratio),
            _ratio(row.ours_ratio),
            _ratio(row.ours_over_torch),
            row.note,
        ]
        for row in rows
    ]


def _gpu_table(rows: Sequence[GpuRow]) -> tuple[list[str], list[list[str]]]:
    columns = ["mode", "step time", "x plain", "peak activation memory", "x plain"]
    plain = rows[0]
    return columns, [
        [
            row.mode,
            f"{row.step_ms:.1f} ms",
            f"{row.step_ms / plain.step_ms:.2f}x",
            format_bytes(row.peak_bytes),
            f"{row.peak_bytes / max(plain.peak_bytes, 1):.2f}x",
        ]
        for row in rows
    ]


def write_chart(report: BenchReport, path: Path) -> str:
    """Draw the bench's chart with matplotlib; return a note when it cannot."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415  # optional dependency
    except ImportError:
        return (
            "matplotlib is not installed, so no chart was drawn "
            "(pip install 'tensorhooks[cli]' adds it)"
        )
    panels = 2 if report.gpu else 1
    figure = Figure(figsize=(7 * panels, 4.5), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    compared = [row for row in report.cpu if row.ours_ratio is not None]
    references = [row for row in report.cpu if row.ours_ratio is None and row.torch_ratio]
    width = 0.38
    cpu = axes[0]
    for offset, label, values in (
        (-width / 2, "torch.autograd.graph", [row.torch_ratio or 0.0 for row in compared]),
        (width / 2, "tensorhooks", [row.ours_ratio or 0.0 for row in compared]),
    ):
        bars = cpu.bar([i + offset for i in range(len(compared))], values, width, label=label)
        cpu.bar_label(bars, fmt="%.2f", fontsize=7)
    # Modes measured under torch only (references): grey.
    bars = cpu.bar(
        [len(compared) + i for i in range(len(references))],
        [row.torch_ratio or 0.0 for row in references],
        width,
        color="tab:gray",
        label="torch only",
    )
    cpu.bar_label(bars, fmt="%.2f", fontsize=7)
    compared += references
    cpu.axhline(1.0, color="grey", linewidth=0.8)
    labels = [row.mode.split(" (")[0] for row in compared]
    cpu.set_xticks(range(len(compared)), labels, rotation=20, ha="right")
    cpu.set_ylabel("step time / plain autograd")
    cpu.set_title("CPU: 50 x Linear(64, 64), batch 8, one thread")
    cpu.legend()
    if report.gpu:
        gpu = axes[1]
        names = [row.mode.replace(" save_on_cpu", "\nsave_on_cpu") for row in report.gpu]
        gpu.bar(names, [row.peak_bytes / 2**20 for row in report.gpu], color="tab:green")
        gpu.set_ylabel("peak activation memory (MiB)", color="tab:green")
        twin = gpu.twinx()
        twin.plot(names, [row.step_ms for row in report.gpu], "o-", color="tab:red")
        twin.set_ylabel("step time (ms)", color="tab:red")
        twin.set_ylim(bottom=0)
        gpu.set_title("CUDA: transformer stack under save_on_cpu")
    figure.savefig(path, dpi=120)
    return ""


def write_markdown(
    report: BenchReport, options: BenchOptions, path: Path, config: DemoConfig = OFFLOAD_CONFIG
) -> None:
    """Write the bench's Markdown report; ``config`` is the offload benchmark's model."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = report.device or platform.processor() or "CPU"
    lines = [
        "# tensorhooks benchmarks",
        "",
        (
            f"tensorhooks {tensorhooks.__version__}, torch {torch.__version__}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({device}), {when}."
        ),
        (
            f"Command: `python -m tensorhooks bench --rounds {options.rounds} --steps "
            f"{options.steps}`. Ratios are medians over {options.rounds} interleaved rounds of "
            f"{options.steps} steps each; see docs/performance.md for how to read them."
        ),
        "",
        "## CPU: every feature against torch.autograd.graph",
        "",
        (
            "Workload: forward + backward of a 50 x Linear(64, 64) MLP, batch 8, one thread. "
            "Lower is better; `tensorhooks / torch` below 1.00x means tensorhooks is faster."
        ),
        "",
        markdown_table(*_cpu_table(report.cpu)),
        "",
        "## CUDA: save_on_cpu on a transformer stack",
        "",
    ]
    if report.gpu:
        lines += [
            (
                f"{config.layers} blocks, d_model {config.d_model}, {config.heads} heads, batch "
                f"{config.batch} x {config.seq} tokens, fp32, on {config.device}. Peak activation "
                "memory is the peak of a training step over the memory held before it (CUDA only)."
            ),
            "",
            markdown_table(*_gpu_table(report.gpu)),
        ]
    else:
        lines.append(report.gpu_note)
    lines += ["", "## Chart", ""]
    lines.append(report.chart_note or f"![benchmarks]({CHART_NAME})")
    lines += ["", "## Scripts in benchmarks/", ""]
    if report.scripts_note:
        lines.append(report.scripts_note)
    for run in report.scripts:
        status = "timed out" if run.returncode is None else f"exit status {run.returncode}"
        lines += [
            "",
            f"### {run.path.name}",
            "",
            f"`python {run.path.parent.name}/{run.path.name}`: {status}, {run.seconds:.0f}s.",
            "",
            "```text",
            run.output.rstrip(),
            "```",
        ]
    path.write_text("\n".join(lines) + "\n")


def _script_list(options: BenchOptions, report: BenchReport) -> list[Path]:
    if options.scripts is None:
        report.scripts_note = "Skipped (--no-scripts)."
        return []
    if not options.scripts.is_dir():
        report.scripts_note = (
            f"No benchmark scripts found: {options.scripts} is not a directory "
            "(the scripts ship with the source tree, not with the installed package)."
        )
        return []
    # A script has a main guard; other modules there (shared timing helpers) are imported by them.
    scripts = sorted(
        path
        for path in options.scripts.glob("*.py")
        if re.search(r"""^if __name__ == ["']__main__["']:""", path.read_text(), re.M)
    )
    if not scripts:
        report.scripts_note = f"No benchmark scripts in {options.scripts} in this build."
    return scripts


@contextlib.contextmanager
def _progress(console: Console, total: int) -> Iterator[Callable[[str], None]]:
    with console.progress(total, "CPU: warming up") as progress:
        yield progress.advance


def run_bench(options: BenchOptions, console: Console) -> int:
    """Run every benchmark, print the tables, write the Markdown report and the chart.

    Args:
        options: what to run and where to write.
        console: where progress and tables go.

    Returns:
        0 when every benchmark script exited 0, else 1.
    """
    report = BenchReport()
    scripts = _script_list(options, report)
    gpu = options.gpu and torch.cuda.is_available()
    if not gpu:
        report.gpu_note = "Skipped: no CUDA device." if options.gpu else "Skipped (--no-gpu)."
    options.out.mkdir(parents=True, exist_ok=True)
    console.line(
        f"tensorhooks {tensorhooks.__version__} bench (torch {torch.__version__}): "
        f"{options.rounds} rounds x {options.steps} steps per mode"
        + (f", then {_count(len(scripts), 'script')} from {options.scripts}" if scripts else "")
    )
    total = options.rounds * (2 if gpu else 1) + len(scripts)
    with _progress(console, total) as advance:
        report.cpu = run_cpu(options, lambda done: advance(f"CPU {done}"))
        if gpu:
            report.device = torch.cuda.get_device_name()
            report.gpu = run_offload(options, lambda done: advance(f"CUDA {done}"))
        report.scripts = run_scripts(
            options.scripts or Path("benchmarks"), options.script_timeout, advance, scripts
        )
    console.table("CPU: step time relative to plain autograd", *_cpu_table(report.cpu))
    if report.gpu:
        console.table("CUDA: save_on_cpu on a transformer stack", *_gpu_table(report.gpu))
    else:
        console.line(f"CUDA offload benchmark: {report.gpu_note}")
    report.chart_note = write_chart(report, options.out / CHART_NAME)
    write_markdown(report, options, options.out / MARKDOWN_NAME)
    if report.scripts_note:
        console.line(f"Benchmark scripts: {report.scripts_note}")
    failed = [run.path.name for run in report.scripts if run.returncode != 0]
    for run in report.scripts:
        status = "ok" if run.returncode == 0 else "FAILED"
        console.line(f"  {run.path.name}: {status} ({run.seconds:.0f}s)")
    written = [options.out / MARKDOWN_NAME]
    if not report.chart_note:
        written.append(options.out / CHART_NAME)
    else:
        console.line(f"Chart: {report.chart_note}.")
    console.line("Wrote " + " and ".join(str(path) for path in written) + ".")
    return 1 if failed else 0
