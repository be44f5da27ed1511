"""checkpoint: what recording what a region read costs, in bytes and time, against torch's.

In one run, tensorhooks' checkpoint against ``torch.utils.checkpoint.checkpoint(use_reentrant=
False)`` on the cases where a check of what a region reads could cost what torch does not
spend:

1. Bytes, from the allocator's events on the CPU (``torch.profiler`` with ``profile_memory``:
   exact, the same on a loaded machine): for each case, the bytes allocated by one step, the
   peak above the start, and the bytes still allocated when the step ends with the collector
   off (a reference cycle would leave its tensors there):
   - 8 blocks each writing a 1 MiB buffer in place (an EMA), with the first step discarded
     (the first call of a block's code copies what it reaches once, to learn what it writes);
   - a 1 MiB table read by one region (a step after the first);
   - 64 blocks reached through a closure over the parent module, with batch norm;
   - a region that writes a tensor it saved in place (torch's checkpoint hands backward the
     changed value; tensorhooks recomputes once more, keeping a copy of that tensor only).
2. Time, interleaved rounds with their spread (benchmarks/harness.py): the step of blocks
   reached through a closure over the parent, per block, at 8, 16 and 64 blocks (the cost of a
   region must not grow with the number of blocks), and the in-place write case.

Targets: bytes allocated and live after the step <= torch's, apart from the copies of state a
region writes (the EMA case keeps one copy of each buffer the step writes, 8 MiB here, while
recomputation reads it); the ratio to torch's step at 64 blocks <= 1.05x its value at 8 (a
region's cost flat in the number of blocks: torch's own step per block grows with them).

Run: python benchmarks/checkpoint_costs.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import check_target, interleaved, print_table

import tensorhooks

MIB = 2**20


def ours(function: Callable[..., Any], *args: Any) -> Any:
    return tensorhooks.checkpoint(function, *args, use_reentrant=False)


def torchs(function: Callable[..., Any], *args: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


CHECKPOINTS = {"torch": torchs, "tensorhooks": ours}


class Ema(nn.Module):
    """A linear layer that keeps a running mean of its output in a 1 MiB buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(MIB // 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.linear(h).relu()
        with torch.no_grad():
            self.mean.mul_(0.9).add_(out.mean() * 0.1)
        return out


class Table(nn.Module):
    """A block reading a 1 MiB table (a buffer it never writes) into its output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("table", torch.linspace(0, 1, MIB // 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (self.linear(h) + self.table[: h.shape[-1]]).tanh()


class Parent(nn.Module):
    """A stack of blocks, each checkpointed through a closure over the parent."""

    def __init__(self, blocks: int, width: int, checkpoint: Callable[..., Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
            for _ in range(blocks)
        )
        self.checkpoint = checkpoint

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for index in range(len(self.layers)):
            h = self.checkpoint(lambda a, i=index: self.layers[i](a), h)
        return h


def _writes_a_saved_tensor(checkpoint: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    def block(a: torch.Tensor) -> torch.Tensor:
        b = a * 2
        c = b.sin()  # saves b
        d = c * 3
        b.add_(1)  # then changes b
        return (d * b).tanh()

    return checkpoint(block, x)


def _step(run: Callable[[], torch.Tensor]) -> None:
    run().sum().backward()


def allocator_bytes(step: Callable[[], None]) -> tuple[int, int, int]:
    """Bytes allocated by one call of ``step``, its peak above the start, and what stays."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, acc_events=True
        ) as profiler:
            step()
    finally:
        gc.enable()
    changes = sorted(
        (event.time_range.start, event.self_cpu_memory_usage)
        for event in profiler.events()
        if event.self_cpu_memory_usage  # an allocation by the op itself, or a free ([memory])
    )
    allocated = live = peak = 0
    for _, change in changes:
        allocated += max(change, 0)
        live += change
        peak = max(peak, live)
    return allocated, peak, live


def _cases(
    width: int, quick: bool
) -> dict[str, Callable[[Callable[..., Any]], Callable[[], None]]]:
    blocks = 8 if quick else 64

    def ema(checkpoint: Callable[..., Any]) -> Callable[[], None]:
        torch.manual_seed(0)
        model = nn.ModuleList(Ema(width) for _ in range(8))
        x = torch.randn(4, width, requires_grad=True)

        def run() -> torch.Tensor:
            h = x
            for layer in model:
                h = checkpoint(layer, h)
            return h

        _step(run)  # a first step: each region learns what it writes
        return lambda: _step(run)

    def table(checkpoint: Callable[..., Any]) -> Callable[[], None]:
        torch.manual_seed(0)
        model = Table(width)
        x = torch.randn(4, width, requires_grad=True)
        _step(lambda: checkpoint(model, x))
        return lambda: _step(lambda: checkpoint(model, x))

    def parent(checkpoint: Callable[..., Any]) -> Callable[[], None]:
        torch.manual_seed(0)
        model = Parent(blocks, width, checkpoint)
        x = torch.randn(8, width, requires_grad=True)
        _step(lambda: model(x))
        return lambda: _step(lambda: model(x))

    def inplace(checkpoint: Callable[..., Any]) -> Callable[[], None]:
        x = torch.randn(64, width, requires_grad=True)
        return lambda: _step(lambda: _writes_a_saved_tensor(checkpoint, x))

    return {
        "8 blocks writing a 1 MiB buffer": ema,
        "a 1 MiB table read by one region": table,
        f"{blocks} blocks through the parent, batch norm": parent,
        "a saved tensor written in the region": inplace,
    }


def bytes_table(width: int, quick: bool) -> None:
    print("\nBytes from the allocator's events, one step (CPU, collector off)")
    print("| case | torch: allocated / peak / live after | tensorhooks | tensorhooks / torch |")
    print("|---|---:|---:|---:|")
    for name, make in _cases(width, quick).items():
        figures = {label: allocator_bytes(make(run)) for label, run in CHECKPOINTS.items()}
        theirs, mine = figures["torch"], figures["tensorhooks"]
        ratio = " / ".join(f"{m / t:.2f}" if t else "-" for m, t in zip(mine, theirs, strict=True))
        print(
            f"| {name} | {' / '.join(f'{v / MIB:.2f}' for v in theirs)} MiB | "
            f"{' / '.join(f'{v / MIB:.2f}' for v in mine)} MiB | {ratio} |"
        )
        if "buffer" not in name:
            check_target(
                f"{name}: live after the step, tensorhooks - torch",
                mine[2] - theirs[2],
                at_most=0,
                exact=True,
                unit=" B",
            )


def time_table(width: int, rounds: int, quick: bool) -> None:
    sizes = (4, 8) if quick else (8, 16, 64)
    ratios: dict[int, float] = {}
    for blocks in sizes:
        variants = {}
        for label, run in CHECKPOINTS.items():
            torch.manual_seed(0)
            model = Parent(blocks, width, run)
            x = torch.randn(8, width, requires_grad=True)
            variants[label] = lambda m=model, a=x: _step(lambda: m(a))
        timings = interleaved(variants, rounds=rounds, warmup=2)
        print_table(f"{blocks} blocks through a closure over the parent", timings, "torch")
        ratio = timings.ratio("tensorhooks", "torch")
        ratios[blocks] = ratio.median
        extra = (timings.median("tensorhooks") - timings.median("torch")) / blocks
        print(f"cost of a region over torch's: {extra * 1e6:.0f} us")
        check_target(
            f"{blocks} blocks through the parent: tensorhooks / torch", ratio, at_most=1.05
        )
    # torch's own step per block grows with the blocks too (weights leave the caches): a
    # region's cost is flat when the ratio to torch is.
    growth = ratios[sizes[-1]] / ratios[sizes[0]]
    print(f"\nratio to torch at {sizes[-1]} blocks / at {sizes[0]}: {growth:.2f}x")
    check_target(f"ratio to torch at {sizes[-1]} / {sizes[0]} blocks", growth, at_most=1.05)
    x = torch.randn(64, width, requires_grad=True)
    variants = {
        label: (lambda run=run: _step(lambda: _writes_a_saved_tensor(run, x)))
        for label, run in CHECKPOINTS.items()
    }
    timings = interleaved(variants, rounds=rounds, warmup=2)
    print_table(
        "a saved tensor written in the region (torch reads it changed; tensorhooks recomputes "
        "once more, keeping that tensor's value)",
        timings,
        "torch",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    options = parser.parse_args()
    torch.set_num_threads(1)
    width = 32 if options.quick else 256
    bytes_table(width, options.quick)
    time_table(width, 3 if options.quick else options.rounds, options.quick)


if __name__ == "__main__":
    main()
