"""The checkpoint cases, against ``torch.utils.checkpoint``.

A write inside a checkpointed region; state the region writes (``spectral_norm``);
``torch.autograd.grad`` through a checkpoint (refused by the
reentrant checkpoints of torch, DeepSpeed and fairscale); a selective policy that asks to offload
matmuls, in eager mode.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import graph as torch_graph
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tensorhooks
from tensorhooks._core.torch_compat import TorchDispatchMode
from tensorhooks.cli._models import TinyTransformer, backward

from .case import Case, Demo, Outcome, Result, gradient_or_error

__all__ = ["CHECKPOINT_GRAD", "CHECKPOINT_OFFLOAD_POLICY", "CHECKPOINT_STATE", "CHECKPOINT_WRITE"]

PEER = "torch.utils.checkpoint"


class _Checkpointed(nn.Module):
    """A transformer block run through a checkpoint function."""

    def __init__(self, block: nn.Module, checkpoint: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, causal: torch.Tensor, inplace: bool) -> torch.Tensor:
        """The block's forward, without keeping its activations."""
        return self.checkpoint(self.block, x, causal, inplace)


def _checkpointed(
    model: TinyTransformer, checkpoint: Callable[..., torch.Tensor]
) -> TinyTransformer:
    """A copy of ``model`` whose every block is checkpointed with ``checkpoint``."""
    copied = copy.deepcopy(model)
    for index, block in enumerate(copied.blocks):
        copied.blocks[index] = _Checkpointed(block, checkpoint)
    return copied


_torch_checkpoint = partial(torch_checkpoint.checkpoint, use_reentrant=False)


def _checkpoint(function: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensorhooks.checkpoint(function, *args, use_reentrant=False, **kwargs)


# ---------------------------------------------------------------------------------------------
# a write inside the region


def _write_inside_region(checkpoint: Callable[..., torch.Tensor]) -> torch.Tensor:
    """A region that saves b and then changes it in place; returns the weight's gradient."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def region(a: torch.Tensor) -> torch.Tensor:
        b = a * 2
        c = b * w  # saves b
        b.add_(1)  # then changes it
        return c * b.sin()

    x = torch.ones(3, requires_grad=True)
    (grad,) = torch.autograd.grad(checkpoint(region, x).sum(), [w])
    return grad


def _write(demo: Demo) -> Result:
    """A write inside the region; every block of the model checkpointed is timed here."""
    with torch_graph.allow_mutation_on_saved_tensors():  # torch's own answer for the write
        expected = _write_inside_region(lambda function, *args: function(*args))
    theirs = _checkpointed(demo.model, _torch_checkpoint)
    ours = _checkpointed(demo.model, _checkpoint)
    return Result(
        gradient_or_error(partial(_write_inside_region, _torch_checkpoint), expected),
        gradient_or_error(partial(_write_inside_region, _checkpoint), expected),
        demo.ratio(
            demo.step(contextlib.nullcontext, theirs), demo.step(contextlib.nullcontext, ours)
        ),
        "tensorhooks / torch's use_reentrant=False, every block checkpointed",
    )


CHECKPOINT_WRITE = Case(
    "checkpoint",
    PEER,
    "use_reentrant=False; the region saves b, then changes b in place",
    _write,
)

# ---------------------------------------------------------------------------------------------
# state the region writes: spectral_norm's power iteration


def _spectral_norm_grad(checkpoint: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """The input's gradient through a spectral-normed layer, checkpointed or not."""
    torch.manual_seed(0)
    layer = torch.nn.utils.spectral_norm(nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    out = layer(x) if checkpoint is None else checkpoint(layer, x)
    (grad,) = torch.autograd.grad(out.sum(), [x])
    return grad


def _written_state(demo: Demo) -> Result:
    """spectral_norm updates its vectors in forward; recomputation must not do it again."""
    expected = _spectral_norm_grad(None)
    right = "the gradient without checkpointing (the state replayed as it was)"
    return Result(
        gradient_or_error(partial(_spectral_norm_grad, _torch_checkpoint), expected),
        gradient_or_error(partial(_spectral_norm_grad, _checkpoint), expected, right=right),
    )


CHECKPOINT_STATE = Case(
    "checkpoint",
    PEER,
    "use_reentrant=False around torch.nn.utils.spectral_norm, whose forward updates its power "
    "iteration's vectors in place",
    _written_state,
)

# ---------------------------------------------------------------------------------------------
# torch.autograd.grad through a checkpoint


def _grad_through(checkpoint: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``torch.autograd.grad`` of a checkpointed region with respect to its input."""
    x = torch.linspace(0.0, 1.0, 5, requires_grad=True)
    (grad,) = torch.autograd.grad(checkpoint(torch.sin, x).sum(), [x])
    return grad


def _grad(demo: Demo) -> Result:
    """torch.autograd.grad through a checkpointed region."""
    reference = torch.cos(torch.linspace(0.0, 1.0, 5))
    return Result(
        gradient_or_error(
            partial(_grad_through, partial(torch_checkpoint.checkpoint, use_reentrant=True)),
            reference,
            raising_is_right=False,
        ),
        gradient_or_error(
            partial(_grad_through, _checkpoint),
            reference,
            raising_is_right=False,
            right="the gradient without checkpointing",
        ),
    )


CHECKPOINT_GRAD = Case(
    "checkpoint",
    PEER,
    "torch.autograd.grad through a checkpointed region (torch: use_reentrant=True, as "
    "DeepSpeed's and fairscale's checkpoints)",
    _grad,
)

# ---------------------------------------------------------------------------------------------
# an offload policy in eager mode


class _CountOp(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """How many times an operator runs."""

    def __init__(self, op: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.op = op
        self.runs = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.runs += func == self.op
        return func(*args, **(kwargs or {}))


def _offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


def _backward_matmuls(checkpoint: Callable[..., torch.Tensor], device: str) -> int:
    """Matmuls a backward runs when a policy asks to offload them (torch's contexts)."""
    torch.manual_seed(0)
    w1, w2 = (torch.randn(64, 64, device=device, requires_grad=True) for _ in range(2))
    x = torch.randn(32, 64, device=device, requires_grad=True)
    context_fn = partial(torch_checkpoint.create_selective_checkpoint_contexts, _offload_matmuls)
    y = checkpoint(lambda a: (a @ w1).relu() @ w2, x, context_fn=context_fn)
    counter = _CountOp(torch.ops.aten.mm.default)
    with counter:
        backward(y.sum())
    return counter.runs


def _matmuls_run_again(checkpoint: Callable[..., torch.Tensor], demo: Demo) -> Outcome:
    """Whether a backward runs again a matmul whose output the policy said to offload."""
    device = demo.config.model.device
    plain = _backward_matmuls(lambda function, *args, **kwargs: function(*args), device)
    again = _backward_matmuls(checkpoint, device) - plain
    if again:
        detail = f"{again} matmul run again in backward: the policy is read as recompute"
        return Outcome("recomputes", detail, good=False)
    where = "pinned host memory" if demo.cuda else "host memory (on CPU: where it was)"
    return Outcome("offloads", f"none run again: kept in {where}, read back", good=True)


def _offload_policy(demo: Demo) -> Result:
    """A selective policy asks to offload matmuls; does backward run them again?"""
    return Result(
        _matmuls_run_again(_torch_checkpoint, demo),
        _matmuls_run_again(_checkpoint, demo),
    )


CHECKPOINT_OFFLOAD_POLICY = Case(
    "checkpoint",
    PEER,
    "selective: a policy says MUST_CPU_OFFLOAD for matmuls (torch's "
    "create_selective_checkpoint_contexts), eager mode",
    _offload_policy,
)
