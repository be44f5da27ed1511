"""Activation offloading on a GPU: tensorhooks.save_on_cpu against torch's and no offloading.

Trains a pre-LayerNorm transformer stack (default 12 layers, d=1024, 16 heads, bf16, causal
flash attention) for one fwd+bwd step at a time under three settings, all in one run:

- ``none``: no offloading;
- ``torch``: torch.autograd.graph.save_on_cpu(pin_memory=True);
- ``tensorhooks``: tensorhooks.save_on_cpu(pin_memory=True).

Prints, per setting: the median step time over interleaved rounds (the harness of
``tensorhooks.cli._harness``, CUDA events) with its range, and its per-round ratio to ``none``;
the peak device memory above the weights and inputs (the activations) and its reduction
against ``none``; the bytes moved each way per step; and the achieved device-to-host and
host-to-device bandwidth (bytes moved over the time the profiler saw the copies run), next to
a plain pinned-copy measurement of 256 MiB. Without CUDA it prints ``skipped:`` and why.

Run: python benchmarks/offload_gpu.py [--layers 12] [--d 1024] [--seq 4096] [--batch 4]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

import tensorhooks
from tensorhooks.cli._harness import Timings, interleaved, print_table, skip
from tensorhooks.cli._models import FusedAttentionBlock as Block

MiB = 1 << 20
GB = 1e9


def pinned_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of a plain pinned copy, device-to-host and host-to-device (medians)."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    timings = interleaved(
        {
            "D2H": lambda: host.copy_(device, non_blocking=True),
            "H2D": lambda: device.copy_(host, non_blocking=True),
        },
        rounds=repeats,
        inner=1,
        cuda_events=True,
    )
    return nbytes / timings.median("D2H"), nbytes / timings.median("H2D")


class SavedBytes:
    """Counts what torch's save_on_cpu moves: every saved tensor at pack and at each unpack."""

    def __init__(self) -> None:
        self.packed = 0
        self.unpacked = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.packed += t.numel() * t.element_size()
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            self.unpacked += t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def memcpy_seconds(step: Callable[[], None]) -> tuple[float, float]:
    """Device time the profiler sees device-to-host and host-to-device copies take in a step."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    d2h = h2d = 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "Memcpy DtoH" in event.name:
            d2h += event.time_range.elapsed_us() / 1e6
        elif "Memcpy HtoD" in event.name:
            h2d += event.time_range.elapsed_us() / 1e6
    return d2h, h2d


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--max-in-flight", type=int, default=4)
    return parser.parse_args()


def build(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """One fwd+bwd step function per setting, over the same model and input."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = nn.Sequential(*[Block(args.d, args.heads) for _ in range(args.layers)])
    model = model.to("cuda", dtype)
    x = torch.randn(args.batch, args.seq, args.d, device="cuda", dtype=dtype, requires_grad=True)
    params = list(model.parameters())
    variants: dict[str, Callable[[], AbstractContextManager[Any]]] = {
        "none": nullcontext,
        "torch": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "tensorhooks": lambda: tensorhooks.save_on_cpu(
            pin_memory=True, prefetch=args.prefetch, max_in_flight=args.max_in_flight
        ),
        # Counts what torch's save_on_cpu moves, for the bytes column.
        "count": COUNTER.hooks,
    }

    def make_step(context: Callable[[], AbstractContextManager[Any]]) -> Callable[[], None]:
        def step() -> None:
            with context():
                loss = model(x).float().square().mean()
            torch.autograd.grad(loss, [x, *params])

        return step

    return {name: make_step(context) for name, context in variants.items()}


COUNTER = SavedBytes()


def step_times(steps: dict[str, Callable[[], None]], rounds: int, per_round: int) -> Timings:
    """Seconds per step of each setting, in interleaved rounds timed by CUDA events."""
    return interleaved(steps, rounds=rounds, inner=per_round, cuda_events=True)


def peak_activation_bytes(step: Callable[[], None]) -> int:
    """Peak device memory a step allocates above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bytes_moved(steps: dict[str, Callable[[], None]]) -> dict[str, tuple[int, int]]:
    """Bytes copied device-to-host and host-to-device in one step of each setting."""
    COUNTER.packed = COUNTER.unpacked = 0
    steps["count"]()
    before = tensorhooks.save_on_cpu.stats("cuda")
    steps["tensorhooks"]()
    torch.cuda.synchronize()
    after = tensorhooks.save_on_cpu.stats("cuda")
    return {
        "none": (0, 0),
        "torch": (COUNTER.packed, COUNTER.unpacked),
        "tensorhooks": (
            after.bytes_to_host - before.bytes_to_host,
            after.bytes_to_device - before.bytes_to_device,
        ),
    }


def bandwidth(moved: int, seconds: float, pinned: float) -> str:
    if not seconds:
        return "-"
    return f"{moved / seconds / GB:5.1f} ({moved / seconds / pinned:4.0%})"


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        skip("offload_gpu.py needs a CUDA device; none is available, nothing was measured")
    steps = build(args)
    for step in steps.values():  # warm up: kernels, allocator, pinned pools
        step()
        step()
    timed = {name: steps[name] for name in ("none", "torch", "tensorhooks")}
    timings = step_times(timed, args.rounds, args.steps)
    median = {name: timings.median(name) for name in timed}
    peak = {name: peak_activation_bytes(step) for name, step in timed.items()}
    moved = bytes_moved(steps)
    copy_time = {name: memcpy_seconds(steps[name]) for name in ("torch", "tensorhooks")}
    pinned_d2h, pinned_h2d = pinned_bandwidth()

    print(
        f"{torch.cuda.get_device_name()}: {args.layers} layers, d={args.d}, {args.heads} heads, "
        f"seq {args.seq}, batch {args.batch}, bf16; median of {args.rounds} interleaved rounds "
        f"x {args.steps} steps"
    )
    print_table("step time, median (min-max) over the rounds", timings, "none")
    print(f"plain pinned copy of 256 MiB: D2H {pinned_d2h / GB:.1f} GB/s, "
          f"H2D {pinned_h2d / GB:.1f} GB/s")  # fmt: skip
    print(
        f"{'':12s} {'step ms':>8s} {'x none':>7s} {'peak act MiB':>13s} {'saved':>6s} "
        f"{'D2H GB':>7s} {'H2D GB':>7s} {'D2H GB/s (pinned)':>18s} {'H2D GB/s (pinned)':>18s}"
    )
    for name in timed:
        d2h, h2d = moved[name]
        d2h_s, h2d_s = copy_time.get(name, (0.0, 0.0))
        print(
            f"{name:12s} {median[name] * 1e3:8.1f} {median[name] / median['none']:7.3f} "
            f"{peak[name] / MiB:13.0f} {1 - peak[name] / peak['none']:6.0%} "
            f"{d2h / GB:7.2f} {h2d / GB:7.2f} {bandwidth(d2h, d2h_s, pinned_d2h):>18s} "
            f"{bandwidth(h2d, h2d_s, pinned_h2d):>18s}"
        )
    ratio = timings.ratio("tensorhooks", "torch")
    print(f"tensorhooks / torch step time, per round: {ratio.format(digits=3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
