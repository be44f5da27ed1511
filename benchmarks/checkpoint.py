"""checkpoint: step time against torch's non-reentrant checkpoint, and what each policy keeps.

In one run:

1. Step time (fwd+bwd) of ``tensorhooks.checkpoint`` over
   ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, interleaved (benchmarks/harness.py):
   on the 50-layer MLP (Linear(64, 64) + ReLU, batch 8, each layer a region) and on a small
   transformer (each block a region). Median step with its range, and the median of the
   per-round ratios against the target: at most 1.05x.
2. Saved-activation bytes kept between forward and backward by the transformer under each
   policy (no checkpoint, full recompute, save matmuls, offload matmuls): the bytes of every
   tensor the forward pass made that is still alive when it ends. On a CPU, offloaded outputs
   stay in place, so "offload matmuls" keeps what "save matmuls" keeps; on a GPU they are in
   host memory (part 3).
3. With CUDA: peak device memory above the weights and step time (CUDA events) for the same
   four settings on a larger transformer. Without CUDA this part says it is skipped.

Run: python benchmarks/checkpoint.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FusedAttentionBlock as Block
from harness import check_target, interleaved, mlp, print_table

import tensorhooks
from tensorhooks import CheckpointPolicy

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _policy(choice: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return choice if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


POLICIES: dict[str, Callable[[], Any] | None] = {
    "full recompute": None,
    "save matmuls": functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _policy(CheckpointPolicy.MUST_SAVE)
    ),
    "offload matmuls": functools.partial(
        tensorhooks.create_selective_checkpoint_contexts,
        _policy(CheckpointPolicy.MUST_CPU_OFFLOAD),
    ),
}


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpoint: Any, **options: Any) -> Any:
    h = x
    for block in blocks:
        h = block(h) if checkpoint is None else checkpoint(block, h, **options)
    return h


def torch_ckpt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def ours_ckpt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return tensorhooks.checkpoint(function, *args, use_reentrant=False, **kwargs)


def step_fn(blocks: nn.ModuleList, x: torch.Tensor, checkpoint: Any, **options: Any):
    def step() -> None:
        run_blocks(blocks, x, checkpoint, **options).sum().backward()
        for param in blocks.parameters():
            param.grad = None

    return step


class _Outputs(TorchDispatchMode):
    """Weak references to every tensor the ops under it produce."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.refs.append(weakref.ref(item))
        return out


def kept_bytes(blocks: nn.ModuleList, x: torch.Tensor, checkpoint: Any, **options: Any) -> int:
    """Bytes of the storages the forward pass made that are alive when it ends (not the output)."""
    with _Outputs() as outputs:
        out = run_blocks(blocks, x, checkpoint, **options)
    skip = out.untyped_storage().data_ptr()
    storages = {}
    for ref in outputs.refs:
        tensor = ref()
        if tensor is not None and tensor.untyped_storage().data_ptr() != skip:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    out.sum().backward()
    return sum(storages.values())


def _time_against_torch(
    name: str, title: str, blocks: nn.ModuleList, x: torch.Tensor, rounds: int
) -> None:
    """Time a step of ``blocks`` checkpointed by torch and by tensorhooks; check the target."""
    timings = interleaved(
        {
            "torch": step_fn(blocks, x, torch_ckpt),
            "tensorhooks": step_fn(blocks, x, ours_ckpt),
        },
        rounds=rounds,
        warmup=3,
    )
    print_table(title, timings, "torch")
    check_target(
        f"{name}: tensorhooks / torch checkpoint",
        timings.ratio("tensorhooks", "torch"),
        at_most=1.05,
    )


def time_ratios(rounds: int, quick: bool) -> None:
    torch.set_num_threads(1)
    layers = mlp(10 if quick else 50)
    mlp_blocks = nn.ModuleList(
        nn.Sequential(layers[i], layers[i + 1]) for i in range(0, len(layers), 2)
    )
    x = torch.randn(8, 64, requires_grad=True)
    title = f"MLP, {len(mlp_blocks)} checkpointed layers, batch 8, {rounds} rounds"
    _time_against_torch("MLP", title, mlp_blocks, x, rounds)
    torch.manual_seed(0)
    d, seq, n = (32, 16, 2) if quick else (128, 64, 4)
    blocks = nn.ModuleList(Block(d, 4) for _ in range(n))
    h = torch.randn(4, seq, d, requires_grad=True)
    title = f"transformer, {n} blocks, d={d}, seq={seq}, batch 4, {rounds} rounds"
    _time_against_torch("transformer", title, blocks, h, rounds)
    print("\nSaved-activation bytes kept between forward and backward (transformer, CPU)")
    print("| policy | bytes | vs no checkpoint |")
    print("|---|---:|---:|")
    base = kept_bytes(blocks, h, None)
    print(f"| no checkpoint | {base} | 1.000 |")
    for name, context_fn in POLICIES.items():
        options = {} if context_fn is None else {"context_fn": context_fn}
        kept = kept_bytes(blocks, h, ours_ckpt, **options)
        print(f"| {name} | {kept} | {kept / base:.3f} |")


def gpu_rows(quick: bool) -> None:
    if not torch.cuda.is_available():
        print("\nGPU part (peak memory, step time) not run: no CUDA device.")
        return
    torch.manual_seed(0)
    d, seq, n, batch = (256, 128, 2, 2) if quick else (1024, 2048, 8, 4)
    blocks = nn.ModuleList(Block(d, 16) for _ in range(n)).cuda().to(torch.bfloat16)
    x = torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    settings: dict[str, tuple[Any, dict[str, Any]]] = {"no checkpoint": (None, {})}
    for name, context_fn in POLICIES.items():
        settings[name] = (
            ours_ckpt,
            {} if context_fn is None else {"context_fn": context_fn},
        )
    steps = {name: step_fn(blocks, x, run, **options) for name, (run, options) in settings.items()}

    timings = interleaved(steps, rounds=10, inner=3, warmup=1, cuda_events=True)
    print_table(
        f"GPU transformer, {n} blocks, d={d}, seq={seq}, batch {batch}", timings, "no checkpoint"
    )
    print("\n| setting | peak activation memory (MiB) |")
    print("|---|---:|")
    for name, step in steps.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        print(f"| {name} | {(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    options = parser.parse_args()
    time_ratios(options.rounds, options.quick)
    gpu_rows(options.quick)


if __name__ == "__main__":
    main()
