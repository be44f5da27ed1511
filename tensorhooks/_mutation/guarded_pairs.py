"""Saved-tensor hooks pushed inside the context: the user's pair, wrapped to keep the protection.

A context installs a `MutationGuard` as the save guard in force: tensorhooks'
``saved_tensors_hooks`` (and ``save_on_cpu``) have it wrap the pair they push, and the takeover
of torch's own hooks (`foreign_hooks`) does the same. What a wrapped pack returns is tracked
through the context's ``track`` function unless it is provably a copy.
"""

from __future__ import annotations

import torch

from tensorhooks._core.guards import (
    PackHook,
    SavedCopy,
    UnpackHook,
    is_output_of_saving_node,
    may_share_storage,
    register_protected_pack_hook,
)
from tensorhooks._core.torch_compat import is_alias_of

from .saved_tensor import PENDING, PLAIN_TENSOR_TYPES, SavedTensor, Track, check_version, settle

__all__ = ["MutationGuard"]

# Values a pack hook may return next to tensors without hiding a reference to the saved tensor.
_IMMUTABLE_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


class _GuardedSave:
    """What a guarded user pair stores when its packed value may share the saved storage."""

    __slots__ = ("original_id", "packed", "saved")

    def __init__(self, saved: SavedTensor, packed: object) -> None:
        self.saved = saved
        self.original_id = id(saved.tensor)
        self.packed = packed


def _is_copy(packed: object, tensor: torch.Tensor) -> bool:
    """Whether ``packed`` provably holds nothing that shares ``tensor``'s storage.

    Containers and objects are walked as the version guard walks them (`may_share_storage`):
    a record or dict holding a copy is a copy; one past the walk's budget is not.
    """
    # save_on_cpu's host copies (fenced at once under this guard), or a key or a path: the data
    # went elsewhere (to disk, say) and there is nothing to hold.
    if isinstance(packed, (SavedCopy, *_IMMUTABLE_TYPES)):
        return True
    if isinstance(packed, torch.Tensor):
        if packed is tensor or type(packed) not in PLAIN_TENSOR_TYPES:
            return False  # a tensor subclass may wrap the saved tensor without sharing storage
        try:
            return not is_alias_of(packed, tensor)
        except (RuntimeError, NotImplementedError):
            return False
    if isinstance(packed, (tuple, list)):
        return all(_is_copy(item, tensor) for item in packed)
    return _walk_finds_no_alias(packed, tensor)


def _walk_finds_no_alias(packed: object, tensor: torch.Tensor) -> bool:
    try:
        return not may_share_storage(packed, tensor)
    except (RuntimeError, NotImplementedError):
        return False


class _GuardedPair:
    """A user's pack/unpack pair pushed inside the context, with the context's protection."""

    __slots__ = ("_pack_hook", "_track", "_unpack_hook")

    def __init__(self, track: Track, pack_hook: PackHook, unpack_hook: UnpackHook):
        self._track = track
        self._pack_hook = pack_hook
        self._unpack_hook = unpack_hook

    def pack(self, tensor: torch.Tensor) -> object:
        """Call the user's pack; track the tensor unless what pack returned is a real copy."""
        # Tested first: the user's pack may create autograd nodes, which would hide that
        # ``tensor`` is an output of the node saving it.
        is_output = is_output_of_saving_node(tensor)
        packed = self._pack_hook(tensor)
        if _is_copy(packed, tensor):
            return packed
        return _GuardedSave(self._track(tensor, is_output), packed)

    def unpack(self, stored: object) -> torch.Tensor:
        """Hand back the save-time clone if the tensor was written; else call the user's unpack."""
        if type(stored) is not _GuardedSave:
            return self._unpack_hook(stored)
        saved = stored.saved
        current = saved.tensor  # raises once the context has exited
        if saved.version == PENDING:
            current = settle(saved)
        if id(current) != stored.original_id:
            return current
        if current._version != saved.version:
            check_version(saved, current)
        return self._unpack_hook(stored.packed)


class MutationGuard:
    """The save guard a context installs: user pairs pushed inside keep its protection.

    ``track`` is the context's tracker (see `make_pack` in `saved_tensor.py`): what a wrapped
    pack returns that may share the saved tensor's storage is tracked through it.
    """

    __slots__ = ("_track",)

    lets_saved_tensors_change = True
    version_check_may_be_inlined = False

    def __init__(self, track: Track) -> None:
        self._track = track

    def wrap(self, pack_hook: PackHook, unpack_hook: UnpackHook) -> tuple[PackHook, UnpackHook]:
        """Return ``(pack_hook, unpack_hook)`` wrapped so that writes clone what they save."""
        pair = _GuardedPair(self._track, pack_hook, unpack_hook)
        pack = pair.pack  # the bound method pushed, kept in the registry while it is alive
        register_protected_pack_hook(pack)
        return pack, pair.unpack
