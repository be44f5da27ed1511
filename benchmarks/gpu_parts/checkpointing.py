"""checkpoint on a GPU: peak memory and step time per policy, against torch's checkpoint.

A stack of pre-norm blocks with causal flash attention (bf16), each block one checkpointed
region, one fwd+bwd step (``.backward()``, gradients then set to None), under: no checkpoint;
full recompute, save matmuls and offload matmuls (``MUST_CPU_OFFLOAD``) with
``tensorhooks.checkpoint``; and the same three policies with
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. The policies are those of
``benchmarks/checkpoint.py`` (matmuls: ``mm``, ``addmm``, ``bmm``; everything else recomputed).
Torch's eager checkpoint has the ``*_CPU_OFFLOAD`` policies in its enum but recomputes those
outputs (only its compiled path offloads), so its "offload matmuls" row shows that.

Recorded: the gradients of every setting against no checkpoint's; peak device memory above
the weights and input; step time in interleaved rounds (CUDA events); the targets: offload
matmuls with at least 30% less peak activation memory than save matmuls, and faster than full
recompute.

Size on the GPU: 8 blocks, d=1024, 16 heads, sequence 2048, batch 4 (8,192 tokens): about 2.3 GB
of activations without checkpoint, 1.2 GB of matmul outputs to offload. A dry run uses 2 blocks
of d=32 on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import checkpoint as script
import torch
import torch.utils.checkpoint as torch_checkpoint
from harness import FusedAttentionBlock, Timings
from torch import nn

from tensorhooks import CheckpointPolicy

from . import common
from .common import GRADIENT_COLUMNS, attempt, gradient_row, mib, peak_above
from .record import FAILED, OK, Recorder, evaluate

PART = "checkpoint"


@dataclass(frozen=True)
class Size:
    """The stack, its batch, and how long to time it."""

    blocks: int
    d: int
    heads: int
    seq: int
    batch: int
    rounds: int
    inner: int

    def describe(self) -> str:
        return (
            f"{self.blocks} blocks (each a checkpointed region), d={self.d}, {self.heads} heads, "
            f"sequence {self.seq}, batch {self.batch}, bf16"
        )


GPU_SIZE = Size(blocks=8, d=1024, heads=16, seq=2048, batch=4, rounds=6, inner=3)
DRY_SIZE = Size(blocks=2, d=32, heads=4, seq=16, batch=2, rounds=2, inner=1)


def _torch_policy(choice: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return choice if op in script.MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


TORCH_POLICIES: dict[str, Callable[[], Any] | None] = {
    "full recompute": None,
    "save matmuls": functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts,
        _torch_policy(CheckpointPolicy.MUST_SAVE),
    ),
    "offload matmuls": functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts,
        _torch_policy(CheckpointPolicy.MUST_CPU_OFFLOAD),
    ),
}


def settings() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each setting: the checkpoint function (None: none) and its keyword arguments."""
    chosen: dict[str, tuple[Any, dict[str, Any]]] = {"no checkpoint": (None, {})}
    for owner, function, policies in (
        ("tensorhooks", script.ours_ckpt, script.POLICIES),
        ("torch", script.torch_ckpt, TORCH_POLICIES),
    ):
        for name, context_fn in policies.items():
            options = {} if context_fn is None else {"context_fn": context_fn}
            chosen[f"{owner}: {name}"] = (function, options)
    return chosen


def build(size: Size, device: str) -> tuple[nn.ModuleList, torch.Tensor]:
    """The blocks and their input, seeded."""
    torch.manual_seed(0)
    with torch.device(device):
        blocks = nn.ModuleList(FusedAttentionBlock(size.d, size.heads) for _ in range(size.blocks))
        x = torch.randn(size.batch, size.seq, size.d)
    return blocks.to(torch.bfloat16), x.to(torch.bfloat16).requires_grad_()


def gradients(
    blocks: nn.ModuleList, x: torch.Tensor, function: Any, options: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    """The gradients of the step's loss with respect to the input and every parameter."""
    loss = script.run_blocks(blocks, x, function, **options).float().square().mean()
    return torch.autograd.grad(loss, [x, *blocks.parameters()])


def run(rec: Recorder, ctx: Any) -> None:
    """Measure, record the tables, evaluate the targets."""
    device = ctx.device
    size = DRY_SIZE if ctx.dry_run else GPU_SIZE
    rec.note(
        f"{size.describe()}. Policies as in benchmarks/checkpoint.py: matmul outputs (mm, addmm, "
        "bmm) saved or offloaded, everything else recomputed. torch's eager checkpoint "
        "recomputes what its policy marks *_CPU_OFFLOAD (only its compiled path offloads)."
    )
    blocks, x = build(size, device)
    chosen = settings()
    errors: dict[str, str] = {}
    steps: dict[str, Callable[[], object]] = {}
    for name, (function, options) in chosen.items():
        step = script.step_fn(blocks, x, function, **options)
        if attempt(name, errors, lambda s=step: (s(), s())) is not None:  # warm up
            steps[name] = step
    verdicts = attempt(
        "gradients", errors, lambda: _gradients(rec, blocks, x, chosen, steps, errors=errors)
    )
    peaks = {name: peak_above(step, device)[0] for name, step in steps.items()}
    timings = common.timed_rounds(steps, rounds=size.rounds, inner=size.inner, device=device)
    _tables(rec, size, peaks, timings)
    _targets(rec, peaks, timings, verdicts or {})
    if errors:
        rec.table("Settings that failed", ["setting", "error"], list(map(list, errors.items())))
        rec.finish(FAILED, reason="failed: " + ", ".join(errors))
    else:
        rec.finish(OK)


def _gradients(
    rec: Recorder,
    blocks: nn.ModuleList,
    x: torch.Tensor,
    chosen: dict[str, tuple[Any, dict[str, Any]]],
    steps: dict[str, Callable[[], object]],
    *,
    errors: dict[str, str],
) -> dict[str, str]:
    reference = gradients(blocks, x, None, {})
    noise = common.max_difference(gradients(blocks, x, None, {}), reference)
    rows, verdicts = [], {}
    for name in steps:
        if name == "no checkpoint":
            continue
        function, options = chosen[name]
        got = attempt(
            f"{name} gradients", errors, lambda f=function, o=options: gradients(blocks, x, f, o)
        )
        if got is not None:
            row, verdicts[name] = gradient_row(name, got, reference, noise)
            rows.append(row)
    rec.table(
        "Gradients against no checkpoint's (input and every parameter)", GRADIENT_COLUMNS, rows
    )
    return verdicts


def _tables(rec: Recorder, size: Size, peaks: dict[str, int | None], timings: Timings) -> None:
    base = peaks.get("no checkpoint")
    rows = []
    for name, peak in peaks.items():
        owner, _, policy = name.partition(": ")
        theirs = f"torch: {policy}"
        rows.append(
            [
                name,
                mib(peak),
                "-" if peak is None or not base else f"{peak / base:.2f}",
                common.spread_ms(timings, name),
                common.ratio(timings, name, "no checkpoint")
                if "no checkpoint" in timings.samples
                else "-",
                common.ratio(timings, name, theirs)
                if owner == "tensorhooks" and theirs in timings.samples
                else "-",
            ]
        )
    rounds = len(next(iter(timings.samples.values()), []))
    rec.table(
        f"Peak activation memory and step time, median (min-max) of {rounds} interleaved "
        f"rounds x {size.inner} steps",
        [
            "setting",
            "peak above weights and input (MiB)",
            "x no checkpoint",
            "step",
            "step x no checkpoint",
            "step x torch's same policy",
        ],
        rows,
    )
    rec.put("peak_bytes", peaks)
    rec.put("step_seconds", timings.samples)


def _targets(
    rec: Recorder,
    peaks: dict[str, int | None],
    timings: Timings,
    verdicts: dict[str, str],
) -> None:
    offload, save = (
        peaks.get("tensorhooks: offload matmuls"),
        peaks.get("tensorhooks: save matmuls"),
    )
    less = 1 - offload / save if offload is not None and save else None
    rec.target(
        evaluate(
            PART,
            "offload matmuls: peak activation memory, less than save matmuls",
            less,
            at_least=0.30,
            fmt="{:.0%}",
            detail=f"{mib(offload)} MiB against {mib(save)} MiB",
        )
    )
    names = ("tensorhooks: offload matmuls", "tensorhooks: full recompute")
    ratio = timings.ratio(*names) if all(name in timings.samples for name in names) else None
    rec.target(
        evaluate(
            PART,
            "offload matmuls: step over full recompute's",
            ratio.median if ratio else None,
            at_most=1.0,
            fmt="{:.3f}x",
            detail=f"per-round range {ratio.format(digits=3)}" if ratio else "a setting failed",
        )
    )
    different = [name for name, verdict in verdicts.items() if verdict == "DIFFERENT"]
    ours = [verdict for name, verdict in verdicts.items() if name.startswith("tensorhooks")]
    worst = next((v for v in ("DIFFERENT", "within noise", "equal") if v in ours), None)
    rec.target(
        common.gradient_target(
            PART,
            "gradients of every tensorhooks policy equal to no checkpoint's",
            worst,
            "no tensorhooks policy ran",
        )
    )
    summary = []
    if less is not None:
        summary.append(f"offload matmuls {less:.0%} less memory than save matmuls")
    if ratio is not None:
        summary.append(f"{ratio.median:.2f}x full recompute's step")
    if different:
        summary.append("gradients DIFFERENT: " + ", ".join(different))
    rec.summary(", ".join(summary))
