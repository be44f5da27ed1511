"""Parameter offloading on one GPU: tensorhooks.offload_parameters against its peers.

Trains a transformer stack (default 24 layers, d=2048, fp32 weights, bf16 autocast) one
fwd+bwd+AdamW step at a time, under each setting that can run, all in one process:

- ``resident``: the model and AdamW state on the device (skipped when it does not fit);
- ``tensorhooks``: tensorhooks.offload_parameters(model, prefetch=1);
- ``fairscale``: fairscale's OffloadModel on the same layers as an nn.Sequential, one slice per
  layer (when fairscale is installed);
- ``fsdp2``: torch's fully_shard(layer, offload_policy=CPUOffloadPolicy()) per layer and on the
  root, on a one-process group.

Prints, per setting: the median step time over interleaved rounds (harness.py, CUDA events) with
its range, and its per-round ratio to ``tensorhooks``; the peak device memory of a step; and the
two largest blocks' parameter bytes, the target bound for the parameters' share of the peak.
Without CUDA it prints ``skipped:`` and why, and exits 0.

Run: python benchmarks/offload_parameters.py [--layers 24] [--d 2048] [--seq 1024] [--batch 4]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch
from harness import FusedAttentionBlock as Block
from harness import interleaved, print_table, skip
from torch import nn

import tensorhooks

MiB = 1 << 20


def stack(layers: int, d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(d, max(1, d // 128)) for _ in range(layers)))


def make_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step


def peak_of(step: Callable[[], None]) -> float:
    """Peak device MiB of one step (after a warm-up step)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    return torch.cuda.max_memory_allocated() / MiB


def resident(model: nn.Module, x: torch.Tensor) -> Callable[[], None] | None:
    try:
        step = make_step(copy.deepcopy(model).cuda(), x)
        step()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return step


def ours(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    model = copy.deepcopy(model)
    tensorhooks.offload_parameters(model, device="cuda", prefetch=1)
    return make_step(model, x)


def fairscale(model: nn.Sequential, x: torch.Tensor) -> Callable[[], None] | None:
    try:
        from fairscale.experimental.nn.offload import OffloadModel  # noqa: PLC0415
    except ImportError:
        print("fairscale is not installed: its OffloadModel is skipped")
        return None
    offloaded = OffloadModel(
        copy.deepcopy(model),
        device=torch.device("cuda"),
        offload_device=torch.device("cpu"),
        num_slices=len(model),
        checkpoint_activation=False,
    )
    return make_step(offloaded, x)


def fsdp2(model: nn.Module, x: torch.Tensor) -> Callable[[], None] | None:
    try:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: PLC0415
    except ImportError:
        print("torch.distributed.fsdp is not available: FSDP2 is skipped")
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    model = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return make_step(model, x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        skip("offload_parameters.py needs a CUDA device; none is available, nothing was measured")
    model = stack(args.layers, args.d)
    x = torch.randn(args.batch, args.seq, args.d, device="cuda")
    block_bytes = sorted(
        (sum(p.numel() * p.element_size() for p in block.parameters()) for block in model),
        reverse=True,
    )
    print(f"parameters: {sum(block_bytes) / MiB:.0f} MiB in {args.layers} blocks")
    print(f"two largest blocks' parameters: {sum(block_bytes[:2]) / MiB:.0f} MiB")
    builders: dict[str, Callable[[], Callable[[], None] | None]] = {
        "resident": lambda: resident(model, x),
        "tensorhooks": lambda: ours(model, x),
        "fairscale": lambda: fairscale(model, x),
        "fsdp2": lambda: fsdp2(model, x),
    }
    steps: dict[str, Callable[[], None]] = {}
    peaks: dict[str, float] = {}
    for name, build in builders.items():
        step = build()
        if step is None:
            continue
        peaks[name] = peak_of(step)
        steps[name] = step
    print("\n| variant | peak device memory (MiB) |")
    print("|---|---:|")
    for name, peak in peaks.items():
        print(f"| {name} | {peak:.0f} |")
    # CUDA events rather than Timer: Timer would pin the host to one thread, and the offloaded
    # variants run AdamW on the host.
    timings = interleaved(steps, rounds=args.rounds, inner=1, warmup=1, cuda_events=True)
    print_table("step time (fwd + bwd + AdamW)", timings, baseline="tensorhooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
