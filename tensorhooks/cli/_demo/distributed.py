"""The sync_gradients case: two local gloo processes, a parameter that gets no gradient.

DDP with its default settings raises at the second step; ``sync_gradients`` trains and leaves the
unused parameter's gradient as None. Each process also times a step of a small MLP under both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import tensorhooks
from tensorhooks.cli._models import backward, mlp
from tensorhooks.cli._two_processes import run_on_two_processes

from .case import Case, Demo, DemoConfig, Outcome, Result, time_pair, what_went_wrong

__all__ = ["SYNC_GRADIENTS"]


class _OneUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _sync_worker(rank: int, config: DemoConfig) -> dict[str, Any]:
    """One of two gloo processes: DDP and sync_gradients on a model with an unused parameter."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415  # only they need it

    x = torch.full((1, 4), float(rank + 1))
    outcomes: dict[str, Outcome] = {}
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_OneUnused())
    try:
        for _ in range(2):
            backward(ddp(x).sum())
        outcomes["torch"] = Outcome("trains", "no error", good=True)
    except RuntimeError as error:
        outcomes["torch"] = Outcome("raises at step 2", what_went_wrong(error), good=False)
    torch.manual_seed(0)
    ours = _OneUnused()
    handle = tensorhooks.distributed.sync_gradients(ours)
    for _ in range(2):
        backward(ours(x).sum())
    grad = ours.used.weight.grad
    right = grad is not None and torch.allclose(grad, torch.full((1, 4), 2 * 1.5))
    detail = "2 steps, gradients averaged, the unused one left as None"
    outcomes["ours"] = Outcome("trains", detail, good=right and ours.unused.weight.grad is None)
    handle.remove()

    torch.manual_seed(0)
    base = mlp(4, 256)
    batch = torch.randn(16, 256)
    reference = DistributedDataParallel(copy.deepcopy(base))
    synced = copy.deepcopy(base)
    handle = tensorhooks.distributed.sync_gradients(synced)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            backward(model(batch).sum())
            model.zero_grad(set_to_none=True)

        return run

    timing = time_pair(step(reference), step(synced), config)
    handle.remove()
    return {"outcomes": outcomes, "timing": timing}


def _unused_parameter(demo: Demo) -> Result:
    """Two local gloo processes; a parameter that gets no gradient."""
    if not demo.config.processes:
        skipped = Outcome("not run", "skipped (--no-processes)", good=True)
        return Result(skipped, skipped)
    result = run_on_two_processes(_sync_worker, demo.config)
    outcomes = result["outcomes"]
    return Result(
        outcomes["torch"],
        outcomes["ours"],
        result["timing"],
        "sync_gradients / DDP, a step of 4 x Linear(256, 256)",
    )


SYNC_GRADIENTS = Case(
    "distributed.sync_gradients",
    "DDP",
    "two gloo processes; one parameter gets no gradient (DDP's default settings)",
    _unused_parameter,
)
