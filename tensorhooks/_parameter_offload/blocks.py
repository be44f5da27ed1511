"""The blocks `offload_parameters` streams, and the checks of its arguments."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tensorhooks._core.blocks import check_blocks, children_blocks
from tensorhooks._core.errors import (
    ParameterOffloadDeviceError,
    ParameterOffloadTypeError,
    ParameterOffloadValueError,
)
from tensorhooks._core.torch_compat import fsdp2_modules

from .slots import Block, Slot
from .transfers import CudaTransfer, ParameterTransfer

__all__ = ["build_blocks", "check_on_host", "resolve_transfer"]


def build_blocks(
    module: nn.Module, blocks: Sequence[nn.Module] | None, prefetch: int
) -> list[Block]:
    """Check the arguments and build the blocks, one slot per distinct parameter or buffer."""
    if not isinstance(module, nn.Module):
        raise ParameterOffloadTypeError(
            f"offload_parameters: module must be an nn.Module, got {module!r} of type "
            f"{type(module).__name__}"
        )
    sharded = fsdp2_modules(module)
    if sharded:
        raise ParameterOffloadValueError(
            f"offload_parameters: {type(sharded[0]).__name__} is sharded by FSDP2 (fully_shard), "
            "whose parameters are DTensor shards that FSDP2 gathers and frees itself: streaming "
            "them too is not supported. Let FSDP2 keep them in host memory: "
            "fully_shard(module, offload_policy=CPUOffloadPolicy()) "
            "(from torch.distributed.fsdp import CPUOffloadPolicy)"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ParameterOffloadValueError(
            f"offload_parameters: prefetch must be an int >= 0, got {prefetch!r}; pass 0 to copy "
            "each block only when it starts"
        )
    modules = children_blocks(module) if blocks is None else list(blocks)
    check_blocks(
        "offload_parameters",
        module,
        modules,
        type_error=ParameterOffloadTypeError,
        value_error=ParameterOffloadValueError,
    )
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
        block = Block(index, block_module, list(block_slots.values()), names[id(block_module)])
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
