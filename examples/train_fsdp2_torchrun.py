"""Sharded training with FSDP2 (fully_shard) and tensorhooks' selective checkpoint, by torchrun.

Each block of a small transformer-style MLP stack is sharded with ``fully_shard`` and runs under
``tensorhooks.checkpoint`` with a selective policy: on a GPU the matmul outputs are offloaded to
pinned host memory (copied on a side stream, prefetched back in backward) and everything else is
recomputed; on the CPU there is nowhere to offload to, so the matmul outputs are kept. Gradient
accumulation skips FSDP2's reduce-scatter on all but the last micro-batch. gloo on CPU; NCCL,
one GPU per process, when CUDA is available. The same script runs unchanged on both.

Why not ``plan_activations`` here: under ``fully_shard`` its budget does not yet hold on every
rank (see docs/scaling-out.md); this script stays with what gives one process's gradients.

Run (two processes on this machine):
    torchrun --nproc-per-node 2 examples/train_fsdp2_torchrun.py --steps 5
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tensorhooks as th

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class Block(nn.Module):
    """Pre-norm residual MLP block; its body runs under tensorhooks' selective checkpoint."""

    def __init__(self, width: int, context_fn: Any) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.context_fn = context_fn

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Checkpoint inside the sharded block: FSDP2 gathers the weights before the region runs,
        # and again before backward recomputes it.
        return th.checkpoint(self.body, x, context_fn=self.context_fn)


def policy(offload: bool, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> th.CheckpointPolicy:
    """Matmul outputs: offloaded on a GPU, kept on the CPU; everything else recomputed."""
    if op in MATMULS:
        return th.CheckpointPolicy.MUST_CPU_OFFLOAD if offload else th.CheckpointPolicy.MUST_SAVE
    return th.CheckpointPolicy.PREFER_RECOMPUTE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    context_fn = functools.partial(
        th.create_selective_checkpoint_contexts, functools.partial(policy, use_cuda)
    )
    torch.manual_seed(0)  # the same initial weights on every process before sharding
    model = nn.Sequential(*(Block(args.width, context_fn) for _ in range(args.blocks)))
    model.append(nn.Linear(args.width, 1))
    model.to(device)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)  # each block gathers and frees its own weights
    fully_shard(model, mesh=mesh)  # the root: the head, and the whole step's bookkeeping
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    generator = torch.Generator().manual_seed(1 + rank)  # different data on every process
    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for micro in range(args.accumulate):
            last = micro == args.accumulate - 1
            # Reduce-scatter the gradients on the last micro-batch only; the others accumulate
            # unsharded gradients locally.
            model.set_requires_gradient_sync(last)
            x = torch.randn(32, args.width, generator=generator).to(device)
            loss = nn.functional.mse_loss(model(x), torch.tanh(x @ target)) / args.accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = torch.tensor([total], device=device)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    dist.destroy_process_group()
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks, {device.type}", flush=True)


if __name__ == "__main__":
    main()
    # torch 2.13's gloo can release the last collective's tensors from a worker thread after
    # interpreter shutdown began, which aborts the exit ("terminate called without an active
    # exception") although all the work is done; it happens without tensorhooks too. Leave
    # without the interpreter shutdown.
    sys.stdout.flush()
    os._exit(0)
