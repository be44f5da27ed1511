"""A streamed parameter or buffer (a slot) and the block that moves it: their records.

A slot: where its value is, and how a change made by the user is seen.

See NOTE [The value of a slot, and changes made under it].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tensorhooks._core.moves import note_moved

from .transfers import ParameterTransfer

if TYPE_CHECKING:
    from torch.autograd.graph import Node
    from torch.utils.hooks import RemovableHandle

__all__ = ["Block", "Slot", "accumulate", "signature"]

# NOTE [The value of a slot, and changes made under it]
#
# A slot's value is ``host`` while no block holds it, and the installed device copy (``device``)
# while one does. ``offload_parameters`` changes ``tensor.data`` only through `Slot.assign`, which
# records the tensor's *signature* (data pointer, dtype, shape, strides); the version counter
# counts in-place writes. So every way a user changes a model under it is seen:
#   * ``param.data = ...`` (directly, through ``vector_to_parameters``, ``model.double()``,
#     ``model.to(...)``): the signature differs from the one recorded. The user's tensor is then
#     the value (`Slot.follow`): copied into host memory when no block holds the slot, or taken as
#     the installed copy (written back when released) when one does. ``generation`` counts these,
#     so that a weight saved for backward before such a change is not silently replaced by it.
#   * in-place writes while no block holds the slot (``load_state_dict``, an optimizer, any
#     ``with torch.no_grad(): p.mul_(...)``) write ``host`` itself; the version counter tells a
#     staged copy made before that it is stale.
#   * in-place writes while a block holds it (``nn.Embedding(max_norm=...)``, a module
#     renormalising its weight): the version counter differs from ``device_version``, and
#     releasing the slot copies the device copy back. Buffers are always copied back: kernels
#     such as ``batch_norm`` write running statistics without bumping the version.
# Only writes autograd does not count, through ``param.data`` while a block holds the slot, are
# not seen (documented). The module holding a different object (``load_state_dict(assign=True)``,
# ``module.weight = nn.Parameter(...)``) and ``requires_grad`` changes are checked by the
# streamer, which owns the slot's hooks.


def signature(tensor: torch.Tensor) -> tuple[object, ...]:
    """What tells one ``tensor.data`` from another: where it starts, its dtype and layout."""
    return (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride())


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A plain (unpinned, on the host) copy of ``tensor`` on ``device``, strides kept."""
    if tensor.layout != torch.strided:  # a sparse gradient (``nn.Embedding(sparse=True)``)
        return tensor.detach().to(device, copy=True)
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return copy.copy_(tensor)


def accumulate(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old + new``, written into ``old`` where it can, as autograd accumulates ``.grad``."""
    if old.layout != torch.strided and new.layout == torch.strided:
        return new + old  # a dense gradient added to a sparse one is dense
    return old.add_(new)


def _fits(host: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` can be copied into ``host`` as it is (same dtype and layout)."""
    return (host.dtype, host.shape, host.stride()) == (value.dtype, value.shape, value.stride())


class Slot:
    """One parameter or buffer streamed between host and device (see `streaming`).

    ``tensor`` is the object the model holds; ``host`` its value while no block holds it;
    ``device`` the copy installed while ``holders`` blocks hold it; ``staged`` a device copy
    started ahead of use, valid while ``tensor``'s version is still ``staged_version``. See NOTE
    [The value of a slot, and changes made under it] for the other fields.
    """

    __slots__ = (
        "accumulator",
        "blocks",
        "device",
        "device_version",
        "dirty",
        "generation",
        "holders",
        "hooks",
        "host",
        "host_signature",
        "is_param",
        "locations",
        "name",
        "original",
        "parked",
        "requires_grad",
        "signature",
        "staged",
        "staged_token",
        "staged_version",
        "tensor",
    )

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor = tensor
        self.name = name
        self.is_param = isinstance(tensor, nn.Parameter)
        self.requires_grad = self.is_param and tensor.requires_grad
        self.original = tensor.device
        self.host = tensor.data
        self.signature = self.host_signature = signature(tensor)
        self.holders = 0
        self.device: torch.Tensor | None = None
        self.device_version = -1
        self.dirty = False  # the installed copy replaced by the user's: write back on release
        self.parked = False  # tensor.data is host while ``device`` is still held: see `park`
        self.generation = 0
        self.staged: torch.Tensor | None = None
        self.staged_token: object = None
        self.staged_version = -1
        self.accumulator: Node | None = None  # the one the last forward's graph uses
        self.hooks: list[RemovableHandle] = []
        self.locations: list[tuple[nn.Module, str]] = []  # (module, attribute) holding tensor
        self.blocks: list[Block] = []

    def assign(self, value: torch.Tensor) -> None:
        """Make ``value`` the tensor's data, and remember it as ours."""
        self.tensor.data = value
        self.signature = signature(self.tensor)

    def make_host(self, value: torch.Tensor) -> None:
        """Make ``value`` (host memory) the value and the tensor's data."""
        self.host = value
        self.assign(value)
        self.host_signature = self.signature

    def to_host(self) -> None:
        """Make ``host`` the tensor's data again (its signature is known already)."""
        self.tensor.data = self.host
        self.signature = self.host_signature
        note_moved(self.tensor)

    def replaced(self) -> bool:
        """Whether the tensor's data was replaced since `assign` (by ``.data = ...``)."""
        return signature(self.tensor) != self.signature

    def unstage(self) -> None:
        """Drop the staged copy, if any."""
        self.staged = self.staged_token = None
        self.staged_version = -1

    def offload(self, transfer: ParameterTransfer) -> None:
        """Move the value (and ``.grad``) into host memory the transfer can copy from."""
        tensor = self.tensor
        grad = tensor.grad if self.is_param else None
        host = transfer.host_copy(tensor.data)
        if grad is not None:
            tensor.grad = None
        self.make_host(host)
        if grad is not None:
            tensor.grad = _host_grad(grad, transfer)

    def follow(self, transfer: ParameterTransfer) -> bool:
        """Take data the user put in the tensor as the value; return whether there was any.

        See NOTE [The value of a slot, and changes made under it].
        """
        if not self.replaced():
            return False
        value = self.tensor.data
        self.generation += 1
        self.unstage()
        if self.device is not None and not self.parked:
            self.device, self.dirty = value, True
            self.signature = signature(self.tensor)
        else:
            self.accumulator = None  # let autograd make one matching the new data
            self.make_host(transfer.host_copy(value))
        return True

    def install(self, copy: torch.Tensor) -> None:
        """Make the device copy ``copy`` the value (the first block holding the slot)."""
        self.device, self.dirty, self.parked = copy, False, False
        self.device_version = self.tensor._version
        self.assign(copy)
        note_moved(self.tensor)  # the same values: a checkpoint's storage check lets it pass

    def write_back(self, transfer: ParameterTransfer) -> None:
        """Copy the installed value to ``host`` where it may differ, and make ``host`` the data."""
        device = self.device
        assert device is not None  # only called on a held slot: see `_Streamer`
        if not self.parked:
            if self.dirty or not self.is_param or self.tensor._version != self.device_version:
                if _fits(self.host, device):
                    self.host.copy_(device)
                else:
                    self.make_host(transfer.host_copy(device))
            self.to_host()

    def evict(self, transfer: ParameterTransfer) -> None:
        """The last holder let go: the value goes back to ``host``; the device copy is dropped."""
        self.follow(transfer)
        self.write_back(transfer)
        self.device, self.dirty, self.parked = None, False, False

    def park(self, transfer: ParameterTransfer) -> None:
        """Make ``host`` the data while the device copy stays held for saved weights.

        For hooks run after the gradient is accumulated (an optimizer step in backward): they
        see the host value, so what they write is the value; a weight saved for backward and
        unpacked after such a write raises, as it would on a resident model.
        """
        self.follow(transfer)
        if self.device is not None:
            self.write_back(transfer)
            self.parked = True

    def restore(self, transfer: ParameterTransfer) -> None:
        """Put the value (and ``.grad``) back on the device it was on before `offload`."""
        self.unstage()
        self.follow(transfer)
        tensor = self.tensor
        grad = tensor.grad if self.is_param else None
        if grad is not None:
            tensor.grad = None
        self.assign(copy_to(self.host, self.original))
        if grad is not None:
            tensor.grad = copy_to(grad, self.original)


def _host_grad(grad: torch.Tensor, transfer: ParameterTransfer) -> torch.Tensor:
    if grad.layout != torch.strided:  # sparse: no strided buffer to pin; a plain host copy
        return grad.detach().to("cpu", copy=True)
    return transfer.host_copy(grad)


class Block:
    """A module whose slots move together, and who holds it on the device now."""

    __slots__ = ("index", "module", "name", "owners", "slot_ids", "slots")

    def __init__(self, index: int, module: nn.Module, slots: list[Slot], name: str = "") -> None:
        self.index = index
        self.module = module
        self.name = name  # its qualified name in the model
        self.slots = slots
        self.slot_ids = frozenset(id(s) for s in slots)
        self.owners: dict[object, int] = {}
