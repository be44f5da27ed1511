"""plan_activations: budget → measured peak and step time, against the hand choices.

In one run:

1. CPU, one thread: the demo's tiny Llama and a small transformer stack (fused attention), each
   profiled once and planned for budgets from the least feasible to 100%. Every plan and every
   hand choice (no checkpointing, full checkpointing, torch's selective "save matmuls") is
   measured: the peak of bytes autograd holds for backward (recomputation included) and the
   step time, interleaved over rounds (median with the range; ratios per round against full
   checkpointing). Predicted and measured peaks are compared (target: within the budget and
   within 5%).
2. The same transformer with a simulated host link (``--bandwidth``, GB/s): offloading enters
   the plans, and the table shows where. On a CPU offloaded tensors stay in place (they count
   as host bytes), so measured times carry no copies; predicted times do.
3. With CUDA (`gpu_rows`): a bf16 transformer stack, the measured pinned bandwidth, plans
   against every hand choice including boundary offload and offload everything. Targets: at
   full checkpointing's peak the plan is at least 5% faster than it; at every budget it is no
   slower than the best hand choice that fits the budget. Without CUDA this part says it is
   skipped.

Table and chart (``--out``, default ``plan-out``: ``plan.png`` and ``plan-gpu.png``).

Run: python benchmarks/plan.py [--rounds N] [--quick] [--bandwidth GBPS] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tensorhooks
from tensorhooks.cli._harness import SKIPPED, check_target
from tensorhooks.cli._models import FusedAttentionBlock, LlamaConfig, TinyLlama, make_tokens
from tensorhooks.cli._plan.run import BASELINE, Measured, compare, write_chart

BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Stack(nn.Module):
    """Blocks of `FusedAttentionBlock` over an input that needs no gradient."""

    def __init__(self, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FusedAttentionBlock(width, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def stack_step(
    model: nn.Module, shape: tuple[int, int, int], device: str, dtype: torch.dtype
) -> Callable[[], None]:
    """A step of ``model`` on a fixed random input: forward, mean, backward."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    def step() -> None:
        model(x).float().square().mean().backward()

    return step


def print_rows(title: str, rows: Sequence[Measured]) -> None:
    """A Markdown table of what each plan and hand choice measured."""
    print(f"\n{title}")
    print(
        "| plan | budget MiB | peak MiB predicted | measured | host MiB | step ms predicted "
        f"| measured (min-max) | over {BASELINE}: predicted | measured (min-max) | blocks |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    baseline = next(row for row in rows if row.name.endswith(BASELINE)).plan
    for row in rows:
        plan = row.plan
        choices = " / ".join(block.choice for block in plan.blocks)
        predicted = plan.predicted_step_seconds / baseline.predicted_step_seconds
        print(
            f"| {row.name} | {plan.budget_bytes / 2**20:.3f} | "
            f"{plan.predicted_peak_bytes / 2**20:.3f} | {row.peak_bytes / 2**20:.3f} | "
            f"{row.host_bytes / 2**20:.3f} | {plan.predicted_step_seconds * 1e3:.2f} | "
            f"{row.step.format(' ms', scale=1e3)} | {predicted:.2f}x | {row.ratio.format()} | "
            f"{choices} |"
        )


def check_peaks(label: str, rows: Sequence[Measured]) -> bool:
    """Measured peaks within the budget and within 5% of the prediction (every plan)."""
    planned = [row for row in rows if row.fraction is not None]
    over = max(row.peak_bytes / row.plan.budget_bytes for row in planned)
    error = max(
        abs(row.peak_bytes - row.plan.predicted_peak_bytes) / row.plan.predicted_peak_bytes
        for row in rows
    )
    within = check_target(f"{label}: largest measured peak / budget", over, at_most=1.0, exact=True)
    close = check_target(
        f"{label}: largest |measured - predicted| / predicted", error, at_most=0.05, exact=True
    )
    return within and close


def cpu_rows(rounds: int, quick: bool, bandwidth: float) -> list[tuple[str, list[Measured]]]:
    """The CPU part: the tiny Llama, the transformer, the transformer with a simulated link."""
    torch.set_num_threads(1)
    series = []
    config = LlamaConfig()
    llama = TinyLlama(config)
    tokens = make_tokens(config)

    def llama_step() -> None:
        llama(tokens).backward()

    profile = tensorhooks.profile_step(llama, llama_step, rounds=rounds)
    rows = compare(llama, llama_step, profile, budgets=BUDGETS, rounds=rounds, steps=3)
    print_rows(f"tiny Llama ({config.layers} layers, batch {config.batch} x {config.seq})", rows)
    check_peaks("tiny Llama", rows)
    series.append(("tiny Llama", rows))

    torch.manual_seed(0)
    width, heads, layers, shape = (64, 4, 4, (4, 64, 64)) if quick else (128, 4, 6, (8, 128, 128))
    stack = Stack(width, heads, layers)
    step = stack_step(stack, shape, "cpu", torch.float32)
    profile = tensorhooks.profile_step(stack, step, rounds=rounds)
    rows = compare(stack, step, profile, budgets=BUDGETS, rounds=rounds, steps=3)
    title = f"transformer stack ({layers} blocks, width {width}, batch {shape[0]} x {shape[1]})"
    print_rows(title, rows)
    check_peaks("transformer", rows)
    series.append(("transformer", rows))

    linked = compare(
        stack,
        step,
        profile,
        budgets=(0.2, 0.25, *BUDGETS),
        bandwidth=bandwidth,
        min_offload_bytes=64 << 10,
        rounds=rounds,
        steps=3,
        prefix="link: ",
    )
    print_rows(
        f"{title}, simulated {bandwidth / 1e9:.1f} GB/s link (tensors of 64 KiB and more; "
        "on a CPU the copies are not made, so measured times carry none)",
        linked,
    )
    check_peaks("transformer with a link", linked)
    series.append((f"transformer, {bandwidth / 1e9:.1f} GB/s link", linked))
    return series


def gpu_rows(rounds: int, quick: bool, out: Path) -> None:
    """The GPU part: a bf16 transformer stack; the targets against the hand choices."""
    if not torch.cuda.is_available():
        print(f"\n{SKIPPED} GPU part: no CUDA")
        return
    torch.manual_seed(0)
    width, heads, layers, shape = (
        (256, 4, 4, (2, 256, 256)) if quick else (2048, 16, 8, (4, 2048, 2048))
    )
    stack = Stack(width, heads, layers).cuda().to(torch.bfloat16)
    step = stack_step(stack, shape, "cuda", torch.bfloat16)
    profile = tensorhooks.profile_step(stack, step, rounds=rounds)
    assert profile.bandwidth is not None
    print(
        f"\nGPU: {torch.cuda.get_device_name()}, measured pinned host<->device bandwidth "
        f"{profile.bandwidth / 1e9:.1f} GB/s"
    )
    rows = compare(stack, step, profile, budgets=BUDGETS, rounds=rounds, steps=3, cuda_events=True)
    full = next(row for row in rows if row.name == BASELINE)
    at_full = compare(
        stack,
        step,
        profile,
        budgets=(full.plan.predicted_peak_bytes / full.plan.unplanned_peak_bytes,),
        rounds=rounds,
        steps=3,
        cuda_events=True,
        prefix="at full peak: ",
    )
    title = f"GPU bf16 transformer ({layers} blocks, width {width}, batch {shape[0]} x {shape[1]})"
    print_rows(title, rows + at_full)
    check_peaks("GPU transformer", rows)
    planned_at_full = [row for row in at_full if row.fraction is not None]
    if planned_at_full:
        check_target(
            "GPU: planned step / full checkpointing at its peak",
            planned_at_full[0].step.median / full.step.median,
            at_most=0.95,
        )
    hand = [row for row in rows if row.fraction is None]
    worst = 0.0
    for row in rows:
        if row.fraction is None:
            continue
        fits = [other.step.median for other in hand if other.peak_bytes <= row.plan.budget_bytes]
        if fits:
            worst = max(worst, row.step.median / min(fits))
    check_target(
        "GPU: largest planned step / best hand choice within its budget", worst, at_most=1.02
    )
    write_chart([("GPU transformer", rows)], out / "plan-gpu.png", title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, to check the script")
    parser.add_argument(
        "--bandwidth", type=float, default=2.0, help="simulated host link for part 2, GB/s"
    )
    parser.add_argument("--out", type=Path, default=Path("plan-out"))
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU part only (what benchmarks/gpu.py runs)"
    )
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    if options.gpu:
        gpu_rows(options.rounds, options.quick, options.out)
        return 0
    series = cpu_rows(options.rounds, options.quick, options.bandwidth * 1e9)
    caption = "plan_activations on CPU (one thread): " + "; ".join(label for label, _ in series)
    write_chart(series, options.out / "plan.png", caption)
    print(f"\nchart: {options.out / 'plan.png'}")
    gpu_rows(options.rounds, options.quick, options.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
