"""The plan_activations case: a memory budget for an eager training step.

torch chooses what to save or recompute under a budget only in the graphs ``torch.compile``
partitions (``activation_memory_budget``); an eager step ignores it.
"""

from __future__ import annotations

import torch
from torch import nn

import tensorhooks
from tensorhooks.cli._console import format_bytes

from .case import Case, Demo, Outcome, Result

__all__ = ["PLAN_ACTIVATIONS"]

BUDGET = 0.4  # of the activations the unplanned step saves


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = nn.Sequential(
        *(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4))
    )
    return layers, torch.randn(64, 32)


def _activation_bytes(model: nn.Module, inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages an eager step saves for backward, parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs).square().mean().backward()
    return sum(storages.values())


def _torch_budget(unplanned: int) -> Outcome:
    """The eager step under torch's activation_memory_budget: what it still saves."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415  # the compiler's config

    model, inputs = _model()
    with functorch_config.patch(activation_memory_budget=BUDGET):
        kept = _activation_bytes(model, inputs)
    budget = int(BUDGET * unplanned)
    if kept <= budget:
        return Outcome("within the budget", f"{format_bytes(kept)} saved", good=True)
    detail = (
        f"saves all {format_bytes(kept)} (budget {format_bytes(budget)}): the budget applies "
        "only to graphs torch.compile partitions"
    )
    return Outcome("ignores the budget", detail, good=False)


def _planned() -> Outcome:
    """The same step under tensorhooks.plan_activations, measured."""
    model, inputs = _model()

    def step() -> None:
        model(inputs).square().mean().backward()

    profile = tensorhooks.profile_step(model, step)  # one recorded step: the demo's cost
    plan = tensorhooks.plan_activations(model, step, BUDGET, profile=profile)
    with plan:
        step()
    measured, budget = plan.measured_peak_bytes or 0, plan.budget_bytes
    blocks = ", ".join(block.choice for block in plan.blocks)
    detail = f"holds at most {format_bytes(measured)} (budget {format_bytes(budget)}): {blocks}"
    return Outcome("within the budget", detail, good=measured <= budget)


def _budget(demo: Demo) -> Result:
    """An eager step asked to save at most 40% of its activations."""
    model, inputs = _model()
    unplanned = _activation_bytes(model, inputs)
    return Result(_torch_budget(unplanned), _planned())


PLAN_ACTIVATIONS = Case(
    "plan_activations",
    "torch.compile's memory budget",
    f"an eager training step of 4 MLP blocks, to save at most {BUDGET:.0%} of its activations",
    _budget,
)
