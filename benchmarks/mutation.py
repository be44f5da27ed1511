"""allow_mutation_on_saved_tensors: cost of a fwd+bwd step, against torch and a bare mode.

Model: 50 x Linear(64, 64) with ReLU between, batch 8, one intra-op thread. Every variant enters
its context once per step, as a training loop would; variants are interleaved round by round
(benchmarks/harness.py) and medians compared:

- ``plain autograd``: no context (for reference).
- ``bare mode``: a no-op TorchDispatchMode, ``__torch_dispatch__`` only calling
  ``func(*args, **(kwargs or {}))``: the floor for any TorchDispatchMode written that way.
- ``bare mode, no dynamo wrapper``: the same mode opting out of the ``torch._disable_dynamo``
  wrapper TorchDispatchMode puts around every subclass's handler, as tensorhooks does.
- ``torch``: ``torch.autograd.graph.allow_mutation_on_saved_tensors``.
- ``tensorhooks``: ``tensorhooks.allow_mutation_on_saved_tensors``.

Two scenarios: gradients set to None before each step (backward writes nothing in place), and
gradients accumulated across steps (backward adds into ``.grad`` in place: 100 writing ops per
step that the contexts must check).

Run: python benchmarks/mutation.py [--rounds N]
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.autograd.graph as torch_graph
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved_medians, mlp, print_table

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


CONTEXTS: dict[str, Callable[[], Any] | None] = {
    "plain autograd": None,
    "bare mode": BareMode,
    "bare mode, no dynamo wrapper": BareModeNoDynamoWrapper,
    "torch": torch_graph.allow_mutation_on_saved_tensors,
    "tensorhooks": tensorhooks.allow_mutation_on_saved_tensors,
}


def scenario(title: str, rounds: int, *, accumulate: bool) -> dict[str, float]:
    model = mlp(50, last_relu=False)
    batch = torch.randn(8, 64)
    params = list(model.parameters())

    def step(context: Callable[[], Any] | None) -> Callable[[], None]:
        def run() -> None:
            if not accumulate:
                for param in params:  # what zero_grad(set_to_none=True) does, 10x cheaper
                    param.grad = None
            if context is None:
                model(batch).sum().backward()
                return
            with context():
                model(batch).sum().backward()

        return run

    medians = interleaved_medians(
        {name: step(context) for name, context in CONTEXTS.items()}, rounds=rounds
    )
    print_table(title, medians, "torch")
    ours = medians["tensorhooks"]
    print(f"speedup over torch's context: {medians['torch'] / ours:.2f}x (target >= 1.6x)")
    print(f"ratio to the bare mode: {ours / medians['bare mode']:.3f} (target <= 1.15)")
    print(
        "ratio to the bare mode without its dynamo wrapper: "
        f"{ours / medians['bare mode, no dynamo wrapper']:.3f}"
    )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Objects made at import time are not rescanned by every collection, for every variant.
    gc.collect()
    gc.freeze()
    scenario(
        "fwd+bwd of 50 x Linear(64, 64) + ReLU, batch 8, gradients set to None before each step",
        args.rounds,
        accumulate=False,
    )
    scenario(
        "the same, gradients accumulated in place across steps",
        args.rounds,
        accumulate=True,
    )


if __name__ == "__main__":
    main()
