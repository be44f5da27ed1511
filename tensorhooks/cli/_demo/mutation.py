"""The allow_mutation_on_saved_tensors case: a write through a view of a saved tensor."""

from __future__ import annotations

from functools import partial

import torch
from torch.autograd import graph as torch_graph

import tensorhooks
from tensorhooks.cli._models import backward

from .case import Case, Context, Demo, Result, gradient_or_error

__all__ = ["ALLOW_MUTATION"]


def _write_view_of_saved(context: Context) -> torch.Tensor:
    a = torch.ones(4, 6, requires_grad=True)
    with context():
        b = a * 1
        out = (b**2).sum()  # saves b
        b[1:].mul_(2)  # writes a view of it
        backward(out)
    assert a.grad is not None
    return a.grad


def _write_through_view(demo: Demo) -> Result:
    """A write through a view of a saved tensor; a step with in-place residual adds is timed."""
    expected = torch.full((4, 6), 2.0)
    return Result(
        gradient_or_error(
            partial(_write_view_of_saved, torch_graph.allow_mutation_on_saved_tensors), expected
        ),
        gradient_or_error(
            partial(_write_view_of_saved, tensorhooks.allow_mutation_on_saved_tensors), expected
        ),
        demo.ratio(
            demo.step(torch_graph.allow_mutation_on_saved_tensors, inplace=True),
            demo.step(tensorhooks.allow_mutation_on_saved_tensors, inplace=True),
        ),
        "tensorhooks / torch, a step with in-place residual adds",
    )


ALLOW_MUTATION = Case(
    "allow_mutation_on_saved_tensors",
    "torch.autograd.graph",
    "b is saved for backward, then b[1:] (a view of it) is changed in place",
    _write_through_view,
)
