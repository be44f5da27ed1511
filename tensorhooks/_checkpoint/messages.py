"""How checkpoint's errors name what a region read."""

from __future__ import annotations

import torch

__all__ = ["describe", "not_written_message", "replaced_message"]


def describe(tensor: torch.Tensor) -> str:
    """A tensor named by its kind and shape, for a message."""
    kind = "a Parameter" if isinstance(tensor, torch.nn.Parameter) else "a tensor"
    return f"{kind} of shape {list(tensor.shape)}"


def replaced_message(what: str, now: torch.Tensor, before: torch.Tensor | None) -> str:
    """The error for a tensor read in recomputation in place of the one the forward pass read."""
    was = "" if before is None else f" where the forward pass read {describe(before)}"
    return (
        "tensorhooks.checkpoint: recomputation read a different tensor than the forward pass: "
        f"{what} came from {describe(now)}{was}, so the recomputed values, and the gradient, "
        "would differ from plain autograd's. Something the checkpointed function reads from "
        "outside its arguments was replaced between the forward pass and backward "
        "(module.weight = nn.Parameter(...), layers or weights swapped, a module swapped in a "
        "dict or a global). Replace it after backward, or pass it to checkpoint as an argument."
    )


def not_written_message(name: str) -> str:
    """The error for a watched tensor whose storage was swapped (``.data = ...``)."""
    return (
        f"tensorhooks.checkpoint: the data of {name}, which the checkpointed function reads "
        "from outside its arguments, was replaced between the forward pass and backward "
        "(tensor.data = ..., or set_ under no_grad), so recomputation would read other values "
        "than the forward pass did. Replace it after backward, or pass it to checkpoint as an "
        "argument."
    )
