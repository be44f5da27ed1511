"""The explain case: a step whose layers checkpoint their children one by one.

accelerate's FSDP2 wrapping checkpointed each child of a decoder layer instead of the layer, and
the step ran, holding what passes between the children for backward, without a word from torch
(whose memory snapshot, on CUDA only, lists allocations, not why they are held).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

import tensorhooks
from tensorhooks.cli._console import format_bytes

from .case import Case, Demo, Outcome, Result

__all__ = ["EXPLAIN"]


class _Block(nn.Module):
    """A norm, an up-projection, GELU and a down-projection, added to the residual stream."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(functional.gelu(self.up(self.norm(x))))
        return out


class _Checkpointed(nn.Module):
    """A module run through torch's checkpoint, as a checkpoint wrapper runs it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args: Any) -> Any:
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False)


def _model(children: bool) -> nn.Module:
    """Eight blocks, each block's children checkpointed (the trap) or each block whole."""
    torch.manual_seed(0)
    layers = nn.ModuleList(_Block(32) for _ in range(8))
    for index, layer in enumerate(layers):
        if children:
            for name, child in list(layer.named_children()):
                setattr(layer, name, _Checkpointed(child))
        else:
            layers[index] = _Checkpointed(layer)
    return nn.Sequential(*layers)


def _case(demo: Demo) -> Result:
    """The trapped step under torch, then explained by tensorhooks."""
    x = torch.randn(2, 64, 32, requires_grad=True)
    trapped, whole = _model(children=True), _model(children=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trapped(x).square().mean().backward()
    explanation = tensorhooks.explain(trapped, lambda: trapped(x).square().mean().backward())
    fixed = tensorhooks.explain(whole, lambda: whole(x).square().mean().backward())
    ratio = explanation.peak_bytes / max(fixed.peak_bytes, 1)
    theirs = Outcome(
        "says nothing" if not said else "warns",
        f"the step holds {format_bytes(explanation.peak_bytes)} for backward, {ratio:.1f}x what "
        "checkpointing each layer holds; torch's memory snapshot (CUDA only) lists allocations",
        good=False,
    )
    found = [lint for lint in explanation.lints if lint.code == "children-checkpointed"]
    ours = Outcome(
        "names the trap" if found else "misses it",
        (
            f"{format_bytes(found[0].nbytes)} of the peak saved between the children, past "
            "what a checkpoint of each layer keeps: checkpoint the layer itself"
            if found
            else "no lint found"
        ),
        good=bool(found) and ratio > 1,
    )
    return Result(theirs, ours)


EXPLAIN = Case(
    "explain",
    "torch (nothing on a CPU)",
    "a step whose layers checkpoint their children one by one, as accelerate's FSDP2 wrapping did",
    _case,
)
