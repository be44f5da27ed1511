"""Data-parallel training with tensorhooks.distributed.sync_gradients, started by torchrun.

Each process trains the same MLP on its own random batches; after every backward the gradients
are averaged across processes, so the replicas stay identical. Gradient accumulation uses
``handle.no_sync()``. gloo on CPU by default; NCCL, one GPU per process, when CUDA is available.

Run (two processes on this machine):
    torchrun --nproc-per-node 2 examples/train_ddp_torchrun.py --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tensorhooks.distributed import sync_gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every process
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    model.append(nn.Linear(256, 1))
    model.to(device)
    handle = sync_gradients(model, bucket_cap_mb=0.25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1 + rank)  # different data on every process
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0)).to(device)

    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(args.accumulate):
            x = torch.randn(64, 32, generator=generator).to(device)
            last = micro == args.accumulate - 1
            # Communicate only on the last micro-batch; the others accumulate locally.
            with contextlib.nullcontext() if last else handle.no_sync():
                loss = nn.functional.mse_loss(model(x), x @ target) / args.accumulate
                loss.backward()
            total += loss.item()
        optimizer.step()
        mean_loss = torch.tensor([total], device=device)
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step}: loss {mean_loss.item() / world:.4f}", flush=True)

    # The replicas received the same averaged gradients, so they are still identical.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    checksums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(checksums, checksum)
    assert all(torch.equal(c, checksums[0]) for c in checksums), "replicas diverged"
    handle.remove()
    dist.destroy_process_group()
    if rank == 0:
        print(f"replicas identical after {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
    # torch 2.13's gloo can release the last collective's tensors from a worker thread after
    # interpreter shutdown began, which aborts the exit ("terminate called without an active
    # exception") although all the work is done; it happens without tensorhooks too. Leave
    # without the interpreter shutdown.
    sys.stdout.flush()
    os._exit(0)
