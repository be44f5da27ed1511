"""Sharded training with FSDP2 (fully_shard) under an activation plan, started by torchrun.

Each block of a small transformer-style MLP stack and the root are sharded with
``fully_shard``. ``plan_activations`` profiles one training step on every rank, the ranks agree
on one profile (each figure its worst case over them), and every rank gets the same plan: per
block and op, what to keep, recompute, or offload to host memory, the fastest whose peak of
activations held for backward fits the budget. The planner offloads only where the measured
host link hides the copies behind compute: on a GPU; on the CPU there is no link, so it keeps
or recomputes. The budget counts activations only (FSDP2's gathered weights are parameters).
The loop trains under the plan, and gradient accumulation skips FSDP2's reduce-scatter on all
but the last micro-batch. gloo on CPU; NCCL, one GPU per process, when CUDA is available. The
same script runs unchanged on both.

Run (two processes on this machine):
    torchrun --nproc-per-node 2 examples/train_fsdp2_torchrun.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tensorhooks as th


class Block(nn.Module):
    """Pre-norm residual MLP block: one unit of the plan and of FSDP2's sharding."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch and rank")
    parser.add_argument(
        "--budget", type=float, default=0.5, help="fraction of the unplanned activation peak"
    )
    return parser.parse_args()


def report_peaks(plan: th.ActivationPlan, rank: int, world: int, device: torch.device) -> None:
    """Print, on rank 0, what each rank held for backward at most against the shared budget.

    The peak is the one measured over the whole loop under ``with plan:``, activations only.
    """
    assert plan.measured_peak_bytes is not None
    peaks = torch.tensor([plan.measured_peak_bytes], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    if rank == 0:
        for other, peak in enumerate(gathered):
            print(
                f"rank {other}: activation peak {int(peak.item()):,} bytes, "
                f"budget {plan.budget_bytes:,}",
                flush=True,
            )


def main() -> None:
    args = arguments()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every process before sharding
    blocks = [Block(args.width) for _ in range(args.blocks)]
    model = nn.Sequential(*blocks, nn.Linear(args.width, 1)).to(device)
    for block in blocks:
        fully_shard(block, mesh=mesh)  # each block gathers and frees its own weights
    fully_shard(model, mesh=mesh)  # the root: the head, and the whole step's bookkeeping
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    generator = torch.Generator().manual_seed(1 + rank)  # different data on every process
    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(0)).to(device)

    def micro_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.batch, args.width, generator=generator).to(device)
        return x, torch.tanh(x @ target)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y) / args.accumulate

    # Plan from one step of the shapes the loop trains with (every rank calls it: a collective).
    sample = micro_batch()
    plan = th.plan_activations(
        model, lambda: loss_of(*sample).backward(), args.budget, blocks=blocks
    )
    if rank == 0:
        print(plan, flush=True)

    losses = []
    with plan:  # every block runs as the plan says; what autograd holds is measured
        for step in range(args.steps):
            total = 0.0
            for micro in range(args.accumulate):
                # Reduce-scatter the gradients on the last micro-batch only; the others
                # accumulate unsharded gradients locally.
                model.set_requires_gradient_sync(micro == args.accumulate - 1)
                loss = loss_of(*micro_batch())
                loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = torch.tensor([total], device=device)
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            if rank == 0:
                print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    report_peaks(plan, rank, world, device)
    assert (plan.measured_peak_bytes or 0) <= plan.budget_bytes, "over budget"
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
