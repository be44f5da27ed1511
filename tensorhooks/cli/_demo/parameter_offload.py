"""The offload_parameters case: parameters on the host between uses; .grad() through them.

Its peers, fairscale's ``OffloadModel`` and FSDP2's ``CPUOffloadPolicy``, are not run here
(fairscale is not a dependency; FSDP2 needs a process group): the peer's side says what they do.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

import tensorhooks
from tensorhooks.cli._console import format_bytes
from tensorhooks.cli._models import TinyTransformer

from .case import Case, Demo, Outcome, Result

__all__ = ["OFFLOAD_PARAMETERS"]


class _HostTransfer:
    """A synchronous `tensorhooks.ParameterTransfer` whose "device" is the host itself.

    What the differences page uses to run offload_parameters without an accelerator: every copy
    is real (a block's parameters are fresh tensors while it runs), only none of them crosses a
    bus. On CUDA the demo uses `tensorhooks.CudaTransfer` instead.
    """

    device = torch.device("cpu")

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        return host.clone(), None

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        pass

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor.detach().clone(), None

    def synchronize(self, token: object) -> None:
        pass


def _streamed(model: nn.Module) -> list[nn.Parameter]:
    """The parameters offload_parameters streams: those of the model's blocks (its children)."""
    own = {id(param) for param in model.parameters(recurse=False)}
    return [param for param in model.parameters() if id(param) not in own]


def _copied_bytes(params: list[nn.Parameter], host: set[int]) -> int:
    """Bytes of ``params`` whose data is not their host tensor: the copies a block runs on."""
    return sum(p.nbytes for p in params if p.untyped_storage().data_ptr() not in host)


def _grad_on_the_host(
    demo: Demo, model: TinyTransformer, handle: tensorhooks.ParameterOffloadHandle
) -> Outcome:
    """torch.autograd.grad through the offloaded model; where its parameters are, and when."""
    params = _streamed(model)
    host = {param.untyped_storage().data_ptr() for param in params}
    copied: list[bool] = []  # per block run: did it run on copies of its parameters?

    def running(module: nn.Module, args: Any) -> None:
        copied.append(_copied_bytes(list(module.parameters()), host) > 0)

    hooks = [block.register_forward_pre_hook(running) for block in handle.blocks]
    try:
        grads = torch.autograd.grad(model(*demo.batch), params)
    finally:
        for hook in hooks:
            hook.remove()
    expected = torch.autograd.grad(demo.model(*demo.batch), _streamed(demo.model))
    right = all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected, strict=True))
    kept = _copied_bytes(params, host)
    total = format_bytes(sum(p.nbytes for p in params))
    if demo.cuda:
        where = "device copies"
        after = f"{format_bytes(kept)} of {total} of parameters stay on the device"
    else:  # no device: the copies are made within host memory (see _HostTransfer)
        where = "fresh copies of their parameters (no device here: made in host memory)"
        after = f"{format_bytes(kept)} of {total} of parameters are left as copies"
    detail = (
        f"torch.autograd.grad gives {'the' if right else 'a WRONG'} gradient; "
        f"{copied.count(True)} of {len(copied)} blocks ran on {where}; after it {after}"
    )
    good = right and kept == 0 and all(copied)
    return Outcome("on the host" if kept == 0 else "kept", detail, good=good)


def _streamed_blocks(demo: Demo) -> Result:
    """Parameters on the host between uses; torch.autograd.grad through them."""
    ours = copy.deepcopy(demo.model)
    if demo.cuda:
        handle = tensorhooks.offload_parameters(ours, device=demo.config.model.device)
    else:
        handle = tensorhooks.offload_parameters(ours, transfer=_HostTransfer())
    try:
        outcome = _grad_on_the_host(demo, ours, handle)
        timing = demo.ratio(
            demo.step(contextlib.nullcontext), demo.step(contextlib.nullcontext, ours)
        )
    finally:
        handle.remove()
    resident = format_bytes(sum(p.nbytes for p in _streamed(demo.model)))
    where = "on the device" if demo.cuda else "resident"
    theirs = Outcome(
        "no counterpart",
        "fairscale's OffloadModel (not installed here) refuses torch.autograd.grad (reentrant "
        f"backward); without offload all {resident} of parameters stay {where}",
        good=True,
    )
    transfer = "CUDA side streams" if demo.cuda else "synchronous copies in host memory"
    return Result(theirs, outcome, timing, f"every block streamed ({transfer}) / no offload")


OFFLOAD_PARAMETERS = Case(
    "offload_parameters",
    "fairscale / FSDP2 offload",
    "each block's parameters stay in host memory and are copied in only while the block runs; "
    "torch.autograd.grad over all of them",
    _streamed_blocks,
)
