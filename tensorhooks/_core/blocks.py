"""The blocks of a model that a feature works on block by block, and the checks of a block list.

`offload_parameters` streams a block's parameters together and the planner decides per block;
both take a list of submodules and check it the same way here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["check_blocks", "children_blocks"]


def children_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of ``model``, a ModuleList among them expanded (itself too, if it is one).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(
        ...     [torch.nn.Tanh(), torch.nn.Tanh()]))
        >>> [type(block).__name__ for block in children_blocks(model)]
        ['Linear', 'Tanh', 'Tanh']
    """
    if isinstance(model, nn.ModuleList):
        return list(model)
    blocks: list[nn.Module] = []
    for child in model.children():
        blocks += list(child) if isinstance(child, nn.ModuleList) else [child]
    return blocks


def check_blocks(
    caller: str,
    model: nn.Module,
    blocks: Sequence[object],
    *,
    type_error: type[Exception],
    value_error: type[Exception],
) -> None:
    """Check that ``blocks`` are distinct submodules of ``model``, none inside another.

    Raises:
        type_error: if a block is not an ``nn.Module``.
        value_error: if there are no blocks, or a block is not a submodule of ``model``, is
            listed twice, or contains another block.
    """
    if not blocks:
        raise value_error(
            f"{caller}: no blocks in {type(model).__name__} (it has no children); pass "
            "blocks=[...] with the submodules to work on block by block"
        )
    submodules = {id(module) for module in model.modules()}
    seen: dict[int, int] = {}
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise type_error(
                f"{caller}: blocks[{index}] is {block!r} of type {type(block).__name__}, not an "
                "nn.Module; pass submodules of the model"
            )
        if id(block) not in submodules:
            raise value_error(
                f"{caller}: blocks[{index}] ({type(block).__name__}) is not a submodule of the "
                "model given; pass only modules found in its modules()"
            )
        if id(block) in seen:
            raise value_error(
                f"{caller}: blocks[{index}] is blocks[{seen[id(block)]}] again; list each block "
                "once"
            )
        seen[id(block)] = index
    for index, block in enumerate(blocks):
        assert isinstance(block, nn.Module)
        for inner in block.modules():
            other = seen.get(id(inner))
            if other is not None and other != index:
                raise value_error(
                    f"{caller}: blocks[{other}] ({type(inner).__name__}) is inside "
                    f"blocks[{index}] ({type(block).__name__}); pass blocks that do not contain "
                    "one another (a parameter shared by two separate blocks is a tied weight, "
                    "which is fine)"
                )
