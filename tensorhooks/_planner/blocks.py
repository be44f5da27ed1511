"""Which modules a plan decides for: the blocks, by default the layers of every repeated stack."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tensorhooks._core.blocks import check_blocks, children_blocks
from tensorhooks._core.errors import PlanArgumentTypeError, PlanArgumentValueError

__all__ = ["default_blocks", "repeated_stacks", "resolve_blocks"]


def _repeated(container: nn.Module) -> list[nn.Module] | None:
    """The members of a ModuleList or Sequential of two or more modules of one class."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return None
    members = list(container)
    if len(members) < 2 or len({type(member) for member in members}) != 1:
        return None
    return members


def repeated_stacks(model: nn.Module) -> list[list[nn.Module]]:
    """Every stack of repeated layers in ``model``, in the order the model registers them.

    A stack is a ``nn.ModuleList`` or ``nn.Sequential`` of two or more modules of one class
    that hold parameters, not inside another stack: ``model.model.layers`` of a Hugging Face
    causal LM; both ``encoder.block`` and ``decoder.block`` of T5. The experts of a
    mixture-of-experts layer are inside the layers' stack, so they are not a stack of their own.

    Example:
        >>> import torch
        >>> stack = lambda: torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        >>> model = torch.nn.ModuleDict({"encoder": stack(), "decoder": stack()})
        >>> [len(found) for found in repeated_stacks(model)]
        [2, 2]
    """
    stacks: list[list[nn.Module]] = []
    pending = [model]
    while pending:
        module = pending.pop(0)
        members = _repeated(module)
        if members is not None and any(True for _ in module.parameters()):
            stacks.append(members)
        else:
            pending.extend(module.children())
    order = {id(module): index for index, module in enumerate(model.modules())}
    return sorted(stacks, key=lambda members: order[id(members[0])])


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The layers of every stack of repeated layers in ``model`` (`repeated_stacks`).

    Without one, the children of ``model`` (a ModuleList among them expanded), as
    `offload_parameters` takes them. Profiling puts the blocks in the order the step runs them.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.ModuleList(
        ...     torch.nn.Linear(4, 4) for _ in range(3)))
        >>> len(default_blocks(model))
        3
    """
    found = [member for members in repeated_stacks(model) for member in members]
    return found or children_blocks(model)


def resolve_blocks(
    model: object, blocks: Sequence[nn.Module] | None, caller: str
) -> list[tuple[str, nn.Module]]:
    """Check ``model`` and ``blocks``; return each block with its qualified name in the model.

    Raises:
        PlanArgumentTypeError: if ``model`` or a block is not an ``nn.Module``.
        PlanArgumentValueError: if there are no blocks, a block is not a submodule of the model,
            is listed twice, or contains another block.
    """
    if not isinstance(model, nn.Module):
        raise PlanArgumentTypeError(
            f"{caller}: model must be an nn.Module, got {model!r} of type {type(model).__name__}"
        )
    chosen = default_blocks(model) if blocks is None else list(blocks)
    check_blocks(
        caller, model, chosen, type_error=PlanArgumentTypeError, value_error=PlanArgumentValueError
    )
    names = {id(module): name for name, module in model.named_modules()}
    return [(names[id(block)] or "(model)", block) for block in chosen]
