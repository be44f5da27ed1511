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

4. With ``--cost``, alone: cost and speed (`cost_rows`), on a CPU, per model: the 8-block
   width-256 transformer stack, 100 small MLP blocks, and GPT-2, Mixtral and BERT of
   transformers built from configs (when transformers is installed), each over ``--rounds``
   alternating rounds:
   - planning cost: one ``plan_activations`` (the recorded step, the solve, the confirming
     step), in unplanned steps (target <= 5), the runs of the step it makes (a count, the same
     on any machine load: 2), and the slowest solve from a profile (target < 1 s); the closing
     table has a row per model with the column "planning cost in unplanned steps";
   - stable plans: the plans each round's profile gives for the same budgets, and how many
     budgets got one plan in every round (target: all);
   - least peak: the least budget's measured peak over full checkpointing's (target <= 1);
   - speed: the plan at full checkpointing's peak, step time over full checkpointing's per round
     (target: no slower);
   - against compile: the bytes the step saves under ``torch.compile`` (the min-cut partitioner,
     ``aot_eager_decomp_partition``) with ``activation_memory_budget``, beside the plan's
     measured peak, per budget.

Table and chart (``--out``, default ``plan-out``: ``plan.png`` and ``plan-gpu.png``).

Run: python benchmarks/plan.py [--rounds N] [--quick] [--bandwidth GBPS] [--out DIR] [--cost]
(``--cost``: part 4, alone). Publish only figures from a quiet machine: one thread per process
and nothing else running.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tensorhooks
from tensorhooks.cli._harness import SKIPPED, Spread, check_target, interleaved
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


# Part 4: cost and speed.

COST_BUDGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)


class Mlp(nn.Module):
    """A small residual MLP block (100 of them make the many-blocks case)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _hf_models(quick: bool) -> list[tuple[str, nn.Module]]:
    """GPT-2, Mixtral and BERT of transformers from configs; none without transformers."""
    try:
        import transformers  # noqa: PLC0415  # optional: only this part needs it
    except ImportError:
        print(f"\n{SKIPPED} transformers models: transformers is not installed")
        return []
    width, layers, vocab, seq = (64, 2, 128, 32) if quick else (256, 4, 1024, 128)
    gpt2 = transformers.GPT2Config(
        n_embd=width, n_layer=layers, n_head=4, vocab_size=vocab, n_positions=seq, use_cache=False
    )
    gpt2.attn_pdrop = gpt2.resid_pdrop = gpt2.embd_pdrop = 0.0
    mixtral = transformers.MixtralConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    bert = transformers.BertConfig(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * width,
        vocab_size=vocab,
        max_position_embeddings=seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return [
        ("GPT-2", transformers.GPT2LMHeadModel(gpt2)),
        ("Mixtral", transformers.MixtralForCausalLM(mixtral)),
        ("BERT", transformers.BertForMaskedLM(bert)),
    ]


def cost_models(quick: bool) -> list[tuple[str, nn.Module, Callable[[], None]]]:
    """The models of part 4 with their steps."""
    torch.manual_seed(0)
    width, layers, shape = (64, 4, (2, 32, 64)) if quick else (256, 8, (8, 128, 256))
    stack = Stack(width, 4, layers)
    mlp_blocks, mlp_width = (20, 16) if quick else (100, 32)
    mlp = nn.Sequential(*(Mlp(mlp_width) for _ in range(mlp_blocks)))
    x = torch.randn(64, mlp_width, generator=torch.Generator().manual_seed(1))

    def mlp_step() -> None:
        mlp(x).square().mean().backward()

    models = [
        (f"transformer {layers}x{width}", stack, stack_step(stack, shape, "cpu", torch.float32)),
        (f"{mlp_blocks} MLP blocks", mlp, mlp_step),
    ]
    batch, seq = (2, 32) if quick else (4, 128)
    for name, model in _hf_models(quick):
        tokens = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))

        def hf_step(model: nn.Module = model, tokens: torch.Tensor = tokens) -> None:
            model(input_ids=tokens, labels=tokens).loss.backward()

        models.append((name, model, hf_step))
    return models


def _compiled_peak(model: nn.Module, step: Callable[[], None], budget: float) -> int | None:
    """Bytes the step saves for backward (peak) with the model compiled under ``budget``."""
    import torch._dynamo  # noqa: PLC0415  # only this part compiles
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    from tensorhooks._planner.accounting import (  # noqa: PLC0415  # the planner's own measure
        HeldBytes,
        holding_hooks,
        module_keys,
    )

    torch._dynamo.reset()
    original = model.forward
    model.forward = torch.compile(original, backend="aot_eager_decomp_partition")  # type: ignore[method-assign]
    held = HeldBytes(module_keys(model))
    try:
        with functorch_config.patch(activation_memory_budget=budget), holding_hooks(held):
            step()
    except Exception as error:  # a model torch.compile cannot take is reported
        print(f"  torch.compile at {budget:.0%}: failed ({type(error).__name__}: {error})"[:200])
        return None
    finally:
        model.forward = original  # type: ignore[method-assign]
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    return held.peak[0]


def _planning_rounds(
    model: nn.Module, step: Callable[[], None], rounds: int
) -> tuple[Spread, list[float], list[dict[float, tensorhooks.ActivationPlan]], list[int]]:
    """Planning against the unplanned step, alternating: cost per round, solves, plans, runs.

    Planning is one `plan_activations` at half the unplanned peak: the recorded step, the solve
    and the confirming step. Each round's profile is then solved for every budget of
    `COST_BUDGETS` (timed apart: the slowest solve).
    """
    profiles: list[tensorhooks.StepProfile] = []
    runs: list[int] = []

    def planning() -> None:
        calls = 0

        def counted() -> None:
            nonlocal calls
            calls += 1
            step()

        plan = tensorhooks.plan_activations(model, counted, 0.5)
        runs.append(calls)
        profiles.append(plan.profile)

    def unplanned() -> None:
        step()
        model.zero_grad(set_to_none=True)

    timings = interleaved(
        {"unplanned step": unplanned, "planning": planning}, rounds=rounds, inner=1, warmup=1
    )
    solves: list[float] = []
    plans: list[dict[float, tensorhooks.ActivationPlan]] = []
    for profile in profiles[1:]:  # the warm-up round's are not compared
        found = {}
        for budget in COST_BUDGETS:
            start = time.perf_counter()
            with contextlib.suppress(tensorhooks.PlanBudgetError):
                found[budget] = tensorhooks.plan_activations(model, step, budget, profile=profile)
            solves.append(time.perf_counter() - start)
        plans.append(found)
    return timings.ratio("planning", "unplanned step"), solves, plans, runs


def cost_rows(rounds: int, quick: bool) -> None:
    """Part 4: planning cost, stable plans, least peak, speed, and torch.compile's budget."""
    torch.set_num_threads(1)
    summary: list[str] = []
    for name, model, step in cost_models(quick):
        print(f"\n{name}")
        cost, solves, plans, runs = _planning_rounds(model, step, rounds)
        check_target(f"{name}: planning / unplanned step", cost, at_most=5.0)
        check_target(f"{name}: slowest solve, seconds", max(solves), at_most=1.0, unit=" s")
        stable = [
            budget
            for budget in COST_BUDGETS
            if len({tuple(found[budget].choices) if budget in found else None for found in plans})
            == 1
        ]
        check_target(
            f"{name}: budgets planned alike by every round's profile (of {len(COST_BUDGETS)})",
            len(stable) / len(COST_BUDGETS),
            at_least=1.0,
            exact=True,
            unit="",
        )
        summary.append(
            f"| {name} | {cost.format()} | {min(runs)}-{max(runs)} | {max(solves) * 1e3:.1f} ms "
            f"| {len(stable)} of {len(COST_BUDGETS)} |"
        )
        profile = tensorhooks.profile_step(model, step, rounds=rounds)
        first = tensorhooks.plan_activations(model, step, 1.0, profile=profile)
        full_peak = profile.checkpointed_peak_bytes
        unplanned_peak = first.unplanned_peak_bytes
        rows = compare(
            model,
            step,
            profile,
            budgets=(first.least_peak_bytes / unplanned_peak, full_peak / unplanned_peak),
            rounds=rounds,
            steps=1,
        )
        full = next(row for row in rows if row.name == BASELINE)
        planned = [row for row in rows if row.fraction is not None]
        print_rows(f"{name}: the least budget and full checkpointing's peak", rows)
        check_target(
            f"{name}: least measured peak / full checkpointing's",
            planned[0].peak_bytes / full.peak_bytes,
            at_most=1.0,
            exact=True,
        )
        check_target(
            f"{name}: planned step at full checkpointing's peak / full checkpointing",
            planned[-1].ratio,
            at_most=1.0,
        )
        print(f"| {name}: budget | plan measured MiB | torch.compile saves MiB |")
        print("|---:|---:|---:|")
        for budget in COST_BUDGETS:
            try:
                plan = tensorhooks.plan_activations(model, step, budget, profile=profile)
            except tensorhooks.PlanBudgetError:
                ours = "below the least"
            else:
                with plan:
                    step()
                model.zero_grad(set_to_none=True)
                ours = f"{(plan.measured_peak_bytes or 0) / 2**20:.3f}"
            theirs = _compiled_peak(model, step, budget)
            compiled = "failed" if theirs is None else f"{theirs / 2**20:.3f}"
            print(f"| {budget:.0%} | {ours} | {compiled} |")
    print(
        "\n| model | planning cost in unplanned steps | runs of the step | slowest solve "
        "| budgets planned alike |"
    )
    print("|---|---:|---:|---:|---:|")
    for row in summary:
        print(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, to check the script")
    parser.add_argument(
        "--bandwidth", type=float, default=2.0, help="simulated host link for part 2, GB/s"
    )
    parser.add_argument("--out", type=Path, default=Path("plan-out"))
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU part only (what benchmarks/gpu.py runs)"
    )
    parser.add_argument("--cost", action="store_true", help="part 4 only (cost and speed)")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    if options.cost:
        cost_rows(options.rounds, options.quick)
        return 0
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
