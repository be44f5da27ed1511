"""allow_mutation_on_saved_tensors: cost of one fwd+bwd step against torch and a bare mode.

Model: 50 x Linear(64, 64) with ReLU between, batch 8, one intra-op thread. Each variant enters
its context once per step, as a training loop would. Variants run interleaved, one after the
other in every round, and the median over rounds is reported:

- ``plain``: no context at all (for reference).
- ``bare mode``: a no-op TorchDispatchMode whose ``__torch_dispatch__`` only calls
  ``func(*args, **(kwargs or {}))``.
- ``bare mode, no dynamo wrapper``: the same mode opting out of the ``torch._disable_dynamo``
  wrapper that TorchDispatchMode puts around every subclass's handler (what tensorhooks does).
- ``torch``: ``torch.autograd.graph.allow_mutation_on_saved_tensors``.
- ``tensorhooks``: ``tensorhooks.allow_mutation_on_saved_tensors``.

Run: ``python benchmarks/mutation.py [--rounds 31] [--steps 10]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks


class BareMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class BareModeNoDynamoWrapper(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def build(depth: int = 50, width: int = 64) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    options = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build()
    x = torch.randn(8, 64)

    variants: dict[str, Callable[[], Any]] = {
        "plain": contextlib.nullcontext,
        "bare mode": BareMode,
        "bare mode, no dynamo wrapper": BareModeNoDynamoWrapper,
        "torch": torch.autograd.graph.allow_mutation_on_saved_tensors,
        "tensorhooks": tensorhooks.allow_mutation_on_saved_tensors,
    }

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    def run(enter: Callable[[], Any]) -> float:
        start = time.perf_counter()
        for _ in range(options.steps):
            with enter():
                step()
        return (time.perf_counter() - start) / options.steps

    gc.collect()
    gc.freeze()  # objects made at import time are not rescanned by every collection
    for enter in variants.values():  # warm up caches and allocator
        run(enter)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(options.rounds):
        for name, enter in variants.items():
            times[name].append(run(enter))
    median = {name: statistics.median(values) for name, values in times.items()}

    print(f"fwd+bwd, 50 x Linear(64, 64) + ReLU, batch 8, 1 thread, median of {options.rounds}")
    for name, value in median.items():
        print(f"  {name:30s} {value * 1e6:9.1f} us")
    ours = median["tensorhooks"]
    print(f"speedup over torch's context: {median['torch'] / ours:.2f}x (target >= 1.6x)")
    print(
        f"cost relative to a bare no-op mode: {ours / median['bare mode']:.3f}x (target <= 1.15x)"
    )
    print(
        "cost relative to the bare mode without its dynamo wrapper: "
        f"{ours / median['bare mode, no dynamo wrapper']:.3f}x"
    )


if __name__ == "__main__":
    main()
