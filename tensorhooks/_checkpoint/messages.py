"""How checkpoint's errors name what a region read."""

from __future__ import annotations

import torch

from tensorhooks._core.guards import modified_message

__all__ = [
    "changed_message",
    "describe",
    "not_written_message",
    "replaced_message",
    "saved_then_written_message",
]


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
        "(module.weight = nn.Parameter(...), weights swapped, layers reordered in a ModuleList). "
        "Replace it after backward, or pass it to checkpoint as an argument."
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


def changed_message(tensor: torch.Tensor, version: int, what: str) -> str:
    """The error for a tensor read from outside the arguments and changed in place since.

    ``what``: how the region read it ("reads the weight of a Linear"), completing "the
    checkpointed function ...".
    """
    return modified_message(tensor.type(), list(tensor.shape), tensor._version, version) + (
        f" Hint: the checkpointed function {what} from outside its arguments, and it was changed "
        "in place between the forward pass and backward, so recomputation would use the changed "
        "value. Change it after backward, pass it to checkpoint as an argument, or run the "
        "forward pass and backward inside tensorhooks.allow_mutation_on_saved_tensors() (which "
        "keeps its value)."
    )


def saved_then_written_message(tensor: torch.Tensor, version: int, name: str) -> str:
    """The error for a tensor from outside the arguments that the region saved, then wrote."""
    return modified_message(tensor.type(), list(tensor.shape), tensor._version, version) + (
        f" Hint: the checkpointed function saved {name} and then changed it in place in its "
        "forward pass, as plain autograd would refuse too. Run the forward pass and backward "
        "inside tensorhooks.allow_mutation_on_saved_tensors() to keep its value, or write to a "
        "copy."
    )
