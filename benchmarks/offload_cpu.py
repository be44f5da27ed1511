"""What save_on_cpu costs when every saved tensor is already on the CPU.

Times one fwd+bwd step of a 50-layer Linear(64, 64)+ReLU MLP at batch 8 on one thread under
six settings, in interleaved rounds, and prints medians and ratios:

- ``plain``: no hooks;
- ``identity``: tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t), the floor any pair of
  hooks pays. This pair keeps a reference cycle through every output saved by its own node, so a
  graph dropped without backward is never freed;
- ``identity, detach``: the same with ``lambda t: t.detach()`` as pack, the pair torch's docs
  recommend to avoid that cycle; save_on_cpu is cycle-free too (it detaches saved outputs only);
- ``tensorhooks``: tensorhooks.save_on_cpu() (``pin_memory=True`` takes the same path here);
- ``torch``: torch.autograd.graph.save_on_cpu() (which does not copy CPU tensors either, and
  does not guard them against in-place changes);
- ``torch pinned``: torch.autograd.graph.save_on_cpu(pin_memory=True), which copies them.

Run: python benchmarks/offload_cpu.py [--rounds 30] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import mlp

import tensorhooks


def step_fn(
    model: torch.nn.Module, x: torch.Tensor, context: Callable[[], AbstractContextManager[object]]
) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        with context():
            loss = model(x).sum()
        torch.autograd.grad(loss, params)

    return step


def time_steps(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = mlp(args.layers, args.width)
    x = torch.randn(args.batch, args.width)
    identity = tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)
    identity_detach = tensorhooks.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)
    variants: dict[str, Callable[[], AbstractContextManager[object]]] = {
        "plain": nullcontext,
        "identity": lambda: identity,
        "identity, detach": lambda: identity_detach,
        "tensorhooks": tensorhooks.save_on_cpu,
        "torch": torch.autograd.graph.save_on_cpu,
        "torch pinned": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    }
    steps = {name: step_fn(model, x, context) for name, context in variants.items()}
    for step in steps.values():  # warm up
        time_steps(step, args.steps)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(time_steps(step, args.steps))
    median = {name: statistics.median(values) for name, values in times.items()}

    print(
        f"fwd+bwd of {args.layers}x(Linear({args.width}, {args.width}) + ReLU), "
        f"batch {args.batch}, 1 thread, median of {args.rounds} interleaved rounds "
        f"of {args.steps} steps"
    )
    for name, value in median.items():
        print(f"  {name:20s} {value * 1e6:9.1f} us/step   {value / median['plain']:.3f}x plain")
    print(f"tensorhooks / identity hooks:        {median['tensorhooks'] / median['identity']:.3f}")
    print(
        "tensorhooks / identity hooks, detach: "
        f"{median['tensorhooks'] / median['identity, detach']:.3f}"
    )
    print(f"tensorhooks / torch save_on_cpu:     {median['tensorhooks'] / median['torch']:.3f}")
    print(
        f"tensorhooks / torch pinned:          {median['tensorhooks'] / median['torch pinned']:.3f}"
    )


if __name__ == "__main__":
    main()
