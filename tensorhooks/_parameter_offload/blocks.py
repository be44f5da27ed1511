"""The blocks `offload_parameters` streams, and the checks of its arguments."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tensorhooks._core.errors import (
    ParameterOffloadDeviceError,
    ParameterOffloadTypeError,
    ParameterOffloadValueError,
)

from .slots import Block, Slot
from .transfers import CudaTransfer, ParameterTransfer

__all__ = ["build_blocks", "check_on_host", "resolve_transfer"]


def _default_blocks(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, nn.ModuleList):
        return list(module)
    blocks: list[nn.Module] = []
    for child in module.children():
        blocks += list(child) if isinstance(child, nn.ModuleList) else [child]
    return blocks


def _check_blocks(module: nn.Module, blocks: list[nn.Module]) -> None:
    if not blocks:
        raise ParameterOffloadValueError(
            f"offload_parameters: no blocks to stream in {type(module).__name__} (it has no "
            "children); pass blocks=[...] with the submodules whose parameters move together"
        )
    submodules = {id(m) for m in module.modules()}
    seen: dict[int, int] = {}
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise ParameterOffloadTypeError(
                f"offload_parameters: blocks[{index}] is {block!r} of type "
                f"{type(block).__name__}, not an nn.Module; pass submodules of the model"
            )
        if id(block) not in submodules:
            raise ParameterOffloadValueError(
                f"offload_parameters: blocks[{index}] ({type(block).__name__}) is not a "
                "submodule of the module given; pass only modules found in module.modules()"
            )
        if id(block) in seen:
            raise ParameterOffloadValueError(
                f"offload_parameters: blocks[{index}] is blocks[{seen[id(block)]}] again; list "
                "each block once"
            )
        seen[id(block)] = index
    for index, block in enumerate(blocks):
        for inner in block.modules():
            other = seen.get(id(inner))
            if other is not None and other != index:
                raise ParameterOffloadValueError(
                    f"offload_parameters: blocks[{other}] ({type(inner).__name__}) is inside "
                    f"blocks[{index}] ({type(block).__name__}), so its parameters would be in "
                    "two blocks; pass blocks that do not contain one another (a parameter "
                    "shared by two separate blocks is a tied weight, which is fine)"
                )


def build_blocks(
    module: nn.Module, blocks: Sequence[nn.Module] | None, prefetch: int
) -> list[Block]:
    """Check the arguments and build the blocks, one slot per distinct parameter or buffer."""
    if not isinstance(module, nn.Module):
        raise ParameterOffloadTypeError(
            f"offload_parameters: module must be an nn.Module, got {module!r} of type "
            f"{type(module).__name__}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ParameterOffloadValueError(
            f"offload_parameters: prefetch must be an int >= 0, got {prefetch!r}; pass 0 to copy "
            "each block only when it starts"
        )
    modules = _default_blocks(module) if blocks is None else list(blocks)
    _check_blocks(module, modules)
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    slots: dict[int, Slot] = {}
    result = []
    for index, block_module in enumerate(modules):
        block_slots: dict[int, Slot] = {}
        for owner in block_module.modules():
            prefix = names[id(owner)] + "." if names[id(owner)] else ""
            held = [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
            for name, tensor in held:
                slot = slots.get(id(tensor))
                if slot is None:
                    slot = slots[id(tensor)] = Slot(tensor, prefix + name)
                if (owner, name) not in slot.locations:
                    slot.locations.append((owner, name))
                block_slots.setdefault(id(slot), slot)
        block = Block(index, block_module, list(block_slots.values()))
        for slot in block.slots:
            slot.blocks.append(block)
        result.append(block)
    return result


def resolve_transfer(
    device: torch.device | str | int | None,
    pin_memory: bool,
    transfer: ParameterTransfer | None,
) -> ParameterTransfer | None:
    """The transfer given, a `CudaTransfer` to ``device``, or None: nothing to stream (the CPU).

    ``device=None`` is the current CUDA device, or the CPU (with a warning) when there is none.
    """
    if transfer is not None:
        return transfer
    if device is None:
        if not torch.cuda.is_available():
            warnings.warn(_NO_CUDA_WARNING, UserWarning, stacklevel=3)
            return None
        device = torch.cuda.current_device()
    target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if target.type == "cpu":
        return None
    if target.type != "cuda":
        raise ParameterOffloadValueError(
            f"offload_parameters: device={device!r} is neither a CUDA device nor the CPU; "
            "parameters are streamed to an accelerator from host memory: pass a CUDA device, "
            f"device='cpu' (nothing streamed), or transfer=... implementing ParameterTransfer "
            f"for {target.type!r}"
        )
    if not torch.cuda.is_available():
        raise ParameterOffloadDeviceError(
            f"offload_parameters: device={device!r} was asked for but no CUDA device is "
            "available (torch.cuda.is_available() is False); run where one is visible, or pass "
            "device='cpu' (or device=None) to run on the CPU, where nothing is streamed"
        )
    index = torch.cuda.current_device() if target.index is None else target.index
    return CudaTransfer(torch.device("cuda", index), pin_memory=bool(pin_memory))


_NO_CUDA_WARNING = (
    "offload_parameters: no CUDA device is available, so device=None runs the model on the CPU "
    "and nothing is streamed: parameters and gradients stay where they are, and the blocks run "
    "there. Pass device='cpu' to ask for this without the warning"
)


def check_on_host(blocks: list[Block]) -> None:
    """On the CPU nothing is streamed: every parameter and buffer must already be there."""
    for block in blocks:
        for slot in block.slots:
            if slot.tensor.device.type != "cpu":
                raise ParameterOffloadValueError(
                    f"offload_parameters: on the CPU (device='cpu', or no CUDA device) nothing "
                    f"is streamed and blocks run where their tensors are, but {slot.name} is on "
                    f"{slot.tensor.device}; move the model to the CPU first, or pass the "
                    "device it is on"
                )
