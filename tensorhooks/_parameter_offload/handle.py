"""`offload_parameters` and the handle it returns; which tensors live handles stream.

See NOTE [Streaming parameters with hooks] in `streaming`.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorhooks._core.errors import ParameterOffloadValueError
from tensorhooks._core.late_grads import LateGrads

from .blocks import build_blocks, check_on_host, resolve_transfer
from .slots import Block
from .streaming import Streamer
from .transfers import ParameterTransfer

__all__ = ["ParameterOffloadHandle", "offload_parameters"]


class _Claim:
    """The tensors one handle streams, so that a second `offload_parameters` on them is refused.

    Applied twice, two handles would each install their own copies into the same parameters and
    put back what the other left; nothing good can come of it. Held weakly, thread-safe.
    """

    _claimed: ClassVar[dict[int, weakref.ref[torch.Tensor]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, blocks: list[Block]) -> None:
        slots = {id(s): s for b in blocks for s in b.slots}.values()
        with self._lock:
            for slot in slots:
                ref = self._claimed.get(id(slot.tensor))
                if ref is not None and ref() is slot.tensor:
                    raise ParameterOffloadValueError(
                        f"offload_parameters: {slot.name} is already streamed by another "
                        "offload_parameters handle; call that handle's remove() first (a "
                        "model is offloaded once), or pass blocks=[...] that leave it out"
                    )
            self._keys = [(id(s.tensor), weakref.ref(s.tensor)) for s in slots]
            self._claimed.update(self._keys)

    def release(self) -> None:
        """Let the tensors be streamed again. Calling it again does nothing."""
        keys, self._keys = self._keys, []
        with self._lock:
            for key, ref in keys:
                if self._claimed.get(key) is ref:
                    del self._claimed[key]


_NAMES_SHOWN = 8
"""Block names a handle's repr lists before it counts the rest."""


class ParameterOffloadHandle:
    """What `offload_parameters` returns: the blocks it streams, and ``remove()`` to stop.

    Attributes:
        blocks: the modules whose parameters move together, in the order they run.
        block_names: their qualified names in the module (``"layers.0"``); its repr lists them,
            so ``print(handle)`` says which blocks the default chose.
        device: the device parameters are copied to while their block runs (the CPU when
            nothing is streamed).
    """

    def __init__(
        self,
        blocks: list[Block],
        device: torch.device,
        claim: _Claim,
        streamer: Streamer | None = None,
        handles: Sequence[RemovableHandle] = (),
    ) -> None:
        self._streamer = streamer
        self._claim = claim
        self._handles = list(handles)
        params = (s.tensor for b in blocks for s in b.slots if s.is_param)
        self._late = LateGrads(params if streamer is not None else ())
        self.blocks: tuple[nn.Module, ...] = tuple(b.module for b in blocks)
        self.block_names: tuple[str, ...] = tuple(b.name for b in blocks)
        self.device: torch.device = device

    def __repr__(self) -> str:
        shown = ", ".join(self.block_names[:_NAMES_SHOWN])
        more = len(self.block_names) - _NAMES_SHOWN
        if more > 0:
            shown += f", and {more} more"
        where = "nothing streamed" if self._streamer is None else f"streamed to {self.device}"
        return f"<offload_parameters: {len(self.blocks)} blocks ({shown}), {where}>"

    def remove(self) -> None:
        """Put every parameter and buffer back where it was, with its value and ``.grad``; unhook.

        Each goes back to the device it was on when `offload_parameters` was called, with its
        current value and dtype (those changed meanwhile included). Call it outside forward and
        backward. A graph built before cannot be used for backward any more (it raises
        `ParameterOffloadStateError`): run backward first, or drop the graph and run forward
        again.

        Raises:
            Exception: the first error met putting a tensor back (such as a device out of
                memory), after every other one was put back. Calling ``remove()`` again retries
                those that failed; once all are back it does nothing.
        """
        streamer = self._streamer
        if streamer is None:
            self._claim.release()
            return
        if not streamer.removed:
            streamer.removed = True
            self._late.remove()
            for handle in self._handles:
                handle.remove()
        failures = streamer.restore()
        if failures:
            error = failures[0][1]
            if sys.version_info >= (3, 11):
                names = ", ".join(s.name for s, _ in failures)
                error.add_note(
                    f"offload_parameters: remove() could not put back {names}; every other "
                    "parameter and buffer is back. Call remove() again to retry"
                )
            raise error
        self._streamer = None
        self._claim.release()


def offload_parameters(
    module: nn.Module,
    *,
    blocks: Sequence[nn.Module] | None = None,
    device: torch.device | str | int | None = None,
    prefetch: int = 1,
    pin_memory: bool = True,
    transfer: ParameterTransfer | None = None,
) -> ParameterOffloadHandle:
    """Keep ``module``'s parameters in host memory, copying each block's to the device as it runs.

    Between uses every parameter and buffer of the blocks lives in (pinned) host memory. When a
    block's forward starts its parameters are copied in (the next ``prefetch`` blocks' copies
    start meanwhile) and when it ends they leave again; backward brings each block back before
    its first node needs it, and as soon as all of the block's gradients are accumulated they go
    to the host ``.grad`` and the device copies are freed. So the device holds about
    ``1 + prefetch`` blocks' parameters at a time. The ``nn.Parameter`` objects stay the same, so
    an optimizer built on ``module.parameters()`` steps on the host tensors.
    Gradient accumulation, ``retain_graph``, weights tied between blocks, frozen parameters,
    autocast, ``save_on_cpu`` around the forward and ``torch.autograd.grad`` over the inputs all
    work. On an accelerator the parameters get their gradients through ``backward()`` only:
    ``torch.autograd.grad`` or ``backward(inputs=...)`` over them does not reach them (see the
    limits in docs/offload_parameters.md).

    The model may change between steps as a resident one does: values written in place or
    assigned (``param.data = ...``, ``vector_to_parameters``, ``load_state_dict``), dtype
    conversions (``model.double()``), ``requires_grad`` turned on or off, buffers replaced, and
    writes a block makes to its own weights while it runs (``nn.Embedding(max_norm=...)``) are
    all kept. An optimizer step in a ``register_post_accumulate_grad_hook`` hook sees the host
    parameter with its host gradient. On the CPU (``device="cpu"``, or no CUDA device with
    ``device=None``) nothing is streamed, so one training script runs on both.

    Example:
        >>> import torch, tensorhooks
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> handle = tensorhooks.offload_parameters(model, device=device)
        >>> model(torch.ones(2, 4, device=device)).sum().backward()
        >>> model[0].weight.device, model[0].weight.grad.device
        (device(type='cpu'), device(type='cpu'))
        >>> handle.remove()

    Args:
        module: the model. Its own parameters outside every block are left where they are.
        blocks: the submodules whose parameters move together, in the order they run forward
            (backward prefetches in reverse). Default: the children of ``module``, each item of
            an ``nn.ModuleList`` child (or of ``module`` itself) a block of its own. Blocks must
            not contain one another; a parameter in two blocks is a tied weight.
        device: where blocks run; default the current CUDA device, or the CPU (with a warning)
            when there is none. On the CPU nothing is streamed: the blocks run where their
            parameters are, which must then be host memory.
        prefetch: how many blocks ahead to start copying (0: copy each block when it starts).
        pin_memory: keep host copies in page-locked memory, so copies run asynchronously.
        transfer: how to copy between host and device (`ParameterTransfer`); default CUDA
            side streams. ``device`` and ``pin_memory`` are then ignored.

    Returns:
        A `ParameterOffloadHandle`; its ``remove()`` puts everything back.

    Raises:
        ParameterOffloadValueError: for a block that is not a submodule of ``module``, a block
            listed twice or inside another, no blocks, a negative ``prefetch``, a device that is
            neither CUDA nor the CPU, a parameter not on the CPU when nothing is streamed,
            tensors another live handle streams, or a module sharded by FSDP2 (``fully_shard``:
            use its ``CPUOffloadPolicy``) (a ``ValueError``).
        ParameterOffloadDeviceError: when a CUDA device is asked for and none is available (a
            ``RuntimeError``).
        ParameterOffloadTypeError: when ``module`` or a block is not an ``nn.Module`` (a
            ``TypeError``).
        ParameterOffloadStateError: when a block starts and the module holds a new object in
            place of a streamed parameter (``load_state_dict(assign=True)``); in backward, over a
            graph built before ``remove()``, or when a weight it saved had its data replaced
            since forward (a ``RuntimeError``).

    Warns:
        UserWarning: with ``device=None`` and no CUDA device: nothing is streamed.

    Threads: one forward or backward of the model at a time. Parameters used outside the
    forward of a block that holds them are on the host then.
    """
    block_list = build_blocks(module, blocks, prefetch)
    resolved = resolve_transfer(device, pin_memory, transfer)
    if resolved is None:
        check_on_host(block_list)
        return ParameterOffloadHandle(block_list, torch.device("cpu"), _Claim(block_list))
    claim = _Claim(block_list)
    streamer = Streamer(block_list, resolved, prefetch)
    try:
        streamer.offload()
        handles = streamer.register(module)
    except BaseException:
        streamer.restore()
        claim.release()
        raise
    return ParameterOffloadHandle(block_list, resolved.device, claim, streamer, handles)
