"""A region's arguments: the tensors taken out, saved as a node saves its inputs, put back.

See NOTE [Checkpointing on saved-tensor hooks] in recomputation.py, "Inputs".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tensorhooks._core.guards import modified_error
from tensorhooks._core.torch_compat import make_saved_tensor, storage_key, top_saved_tensors_hooks

__all__ = ["Arguments", "save_inputs"]


def _requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.requires_grad else tensor.detach().requires_grad_()


class _Slot:
    """Where a tensor argument was: its index among the region's input tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Container:
    """A list, tuple or dict argument holding tensors, with a `_Slot` in place of each."""

    __slots__ = ("items", "keys", "kind")

    def __init__(self, kind: type, items: list[Any], keys: list[Any] | None) -> None:
        self.kind = kind
        self.items = items
        self.keys = keys

    def build(self, tensors: list[torch.Tensor]) -> Any:
        values = [_put_tensors(item, tensors) for item in self.items]
        if self.keys is not None:
            return dict(zip(self.keys, values, strict=True))
        if self.kind is list:
            return values
        if self.kind is tuple:
            return tuple(values)
        return self.kind(*values)  # a named tuple


def _is_container(value: object) -> bool:
    kind = type(value)
    return kind in (list, tuple, dict) or (
        isinstance(value, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make")
    )


def _take_tensors(value: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """``value`` with its tensors (also in lists, tuples, dicts) moved to ``tensors``, once each."""
    if isinstance(value, torch.Tensor):
        index = seen.get(id(value))
        if index is None:
            index = seen[id(value)] = len(tensors)
            tensors.append(value)
        return _Slot(index)
    if not _is_container(value):
        return value
    keys = list(value) if type(value) is dict else None
    originals = list(value) if keys is None else list(value.values())
    items = [_take_tensors(item, tensors, seen) for item in originals]
    if all(item is original for item, original in zip(items, originals, strict=True)):
        return value  # no tensor inside: passed as itself
    return _Container(type(value), items, keys)


def _put_tensors(template: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, _Container):
        return template.build(tensors)
    return template


class Arguments:
    """A call's arguments with the tensors taken out.

    See NOTE [Checkpointing on saved-tensor hooks], "Inputs".
    """

    __slots__ = ("args", "kwargs", "shared")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> None:
        seen: dict[int, int] = {}
        self.args = _take_tensors(args, tensors, seen)
        self.kwargs = _take_tensors(kwargs, tensors, seen)
        self.shared = _shared_storages(tensors)

    def writable_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Non-leaf copies of ``tensors`` for a function that writes them, aliasing kept.

        Inputs that shared a storage in the call (a tensor and a view of it, overlapping
        slices) share one in the copies too, with the same geometry, so a write through one
        reaches the others as it did in the forward pass. The copies are connected to nothing
        that matters for the gradient: recomputation only reads their values.
        """
        with torch.enable_grad():
            copies = [t.detach().requires_grad_(t.requires_grad).clone() for t in tensors]
            for group in self.shared:
                _share(copies, tensors, group)
        return copies

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments again, with ``tensors`` in the places the inputs were."""
        return _put_tensors(self.args, tensors), _put_tensors(self.kwargs, tensors)


class _Layout(NamedTuple):
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _shared_storages(tensors: list[torch.Tensor]) -> list[list[tuple[int, _Layout]]]:
    """Groups of strided inputs of one dtype that share a storage, with their layouts."""
    groups: dict[tuple[int, torch.dtype], list[tuple[int, _Layout]]] = {}
    for index, tensor in enumerate(tensors):
        key = storage_key(tensor) if tensor.layout == torch.strided else None
        if key is not None:
            layout = _Layout(int(tensor.storage_offset()), tuple(tensor.shape), tensor.stride())
            groups.setdefault((key, tensor.dtype), []).append((index, layout))
    return [group for group in groups.values() if len(group) > 1]


def _end(layout: _Layout) -> int:
    """One past the last element ``layout`` reaches (strides of tensors are never negative)."""
    if 0 in layout.size:
        return layout.offset
    last = sum((n - 1) * s for n, s in zip(layout.size, layout.stride, strict=True))
    return layout.offset + last + 1


def _share(
    copies: list[torch.Tensor], values: list[torch.Tensor], group: list[tuple[int, _Layout]]
) -> None:
    """Make the copies of ``group`` views of one base holding each one's value, in place."""
    first = copies[group[0][0]]
    extent = max(
        layout.offset
        + sum((n - 1) * s for n, s in zip(layout.size, layout.stride, strict=True))
        + 1
        for _, layout in group
    )
    requires_grad = any(values[index].requires_grad for index, _ in group)
    with torch.no_grad():
        flat = torch.zeros(extent, dtype=first.dtype, device=first.device)
        for index, layout in group:
            flat.as_strided(layout.size, layout.stride, layout.offset).copy_(values[index])
    base = flat.requires_grad_(requires_grad).clone()
    for index, layout in group:
        copies[index] = base.as_strided(layout.size, layout.stride, layout.offset)


def save_inputs(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Save ``tensors`` through the hooks in force; return a function that unpacks them."""
    if make_saved_tensor is not None:
        saved = [make_saved_tensor(tensor, is_output=False) for tensor in tensors]
        return lambda: [item.unpack() for item in saved]
    # Releases before 2.12: do what a node's SavedVariable does, by hand.
    top = top_saved_tensors_hooks()
    if top is not None:
        pack, unpack = top
        packed = [(pack(tensor), tensor.requires_grad) for tensor in tensors]
        # Hooks may hand back a detached tensor; a SavedVariable restores requires_grad, so the
        # recomputed ops save what the forward's saved.
        return lambda: [
            _requiring_grad(unpack(item)) if requires_grad else unpack(item)
            for item, requires_grad in packed
        ]
    versions = [tensor._version for tensor in tensors]

    def unpack_checked() -> list[torch.Tensor]:
        for tensor, version in zip(tensors, versions, strict=True):
            if tensor._version != version:
                raise modified_error(tensor, version)
        return list(tensors)

    return unpack_checked
