"""Step time of tensorhooks.distributed.sync_gradients against DistributedDataParallel.

Two gloo ranks on this machine train the same MLP (forward + backward + zero_grad per step),
once wrapped in DDP and once with sync_gradients, interleaved round by round in one run; rank 0
prints the median step time of each and their ratio. A third variant, the same step without any
synchronisation, shows how much of the step is communication.

Run: python benchmarks/sync_gradients.py [--rounds 30] [--width 1024] [--layers 6]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tensorhooks.cli._harness import Spread, check_target
from tensorhooks.cli._models import mlp
from tensorhooks.distributed import sync_gradients

WORLD_SIZE = 2


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=300),
    )
    base = mlp(args.layers, args.width)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ours = copy.deepcopy(base)
    handle = sync_gradients(ours, bucket_cap_mb=args.bucket_cap_mb)
    local = copy.deepcopy(base)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            model(batch).sum().backward()
            for p in model.parameters():
                p.grad = None

        return run

    variants = {"DDP": step(ddp), "sync_gradients": step(ours), "no sync (local)": step(local)}
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.warmup + args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.inner):
                variants[name]()
            elapsed = (time.perf_counter() - start) / args.inner
            if round_index >= args.warmup:
                samples[name].append(elapsed)

    # The two synchronised variants must agree, or the timing compares different work.
    ddp(batch).sum().backward()
    ours(batch).sum().backward()
    difference = max(
        (a.grad - b.grad).abs().max().item()  # type: ignore[operator]
        for a, b in zip(ddp.module.parameters(), ours.parameters(), strict=True)
    )
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in samples.items()}
        params = sum(p.numel() for p in base.parameters())
        print(
            f"MLP {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, "
            f"{params * 4 / 2**20:.1f} MiB of float32 gradients, {WORLD_SIZE} gloo ranks, "
            f"{len(handle.buckets)} buckets, {args.rounds} rounds x {args.inner} steps"
        )
        print("| variant | median step (ms) | ratio to DDP |")
        print("|---|---:|---:|")
        for name, seconds in medians.items():
            print(f"| {name} | {seconds * 1e3:.1f} | {seconds / medians['DDP']:.3f} |")
        # Each round measures both variants a few milliseconds apart, so the ratio within a round
        # is less exposed to load drifting on a shared machine than the ratio of medians.
        paired = Spread.of(
            [
                ours_time / ddp_time
                for ours_time, ddp_time in zip(
                    samples["sync_gradients"], samples["DDP"], strict=True
                )
            ]
        )
        print(f"max |grad difference| sync_gradients vs DDP: {difference:.2e}")
        print(f"per-round ratios sync_gradients / DDP: {paired.format(digits=3)}")
        print(f"sync_gradients / DDP: {medians['sync_gradients'] / medians['DDP']:.3f}x")
        check_target("sync_gradients / DDP step", paired.median, at_most=1.10)
    handle.remove()
    del ddp
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter finalisation: torch 2.13's gloo threads can abort it after the work is done.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port, args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    passed = sys.argv[1:]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *passed, "--rank", str(rank), "--port", str(port)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(WORLD_SIZE)
    ]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
