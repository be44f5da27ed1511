"""A region's arguments: the tensors taken out, saved as a node saves its inputs, put back.

See NOTE [Checkpointing on saved-tensor hooks] in recomputation.py, "Inputs".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from tensorhooks._core.errors import SavedTensorModifiedError
from tensorhooks._core.guards import modified_error
from tensorhooks._core.moves import moves
from tensorhooks._core.torch_compat import (
    UnwrappedDispatchMode,
    below_python_modes,
    make_saved_tensor,
    storage_key,
    top_saved_tensors_hooks,
)

__all__ = ["Arguments", "Windows", "save_inputs"]


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


_TENSORS = object()  # the arguments are the input tensors themselves, in order


def _distinct_tensors(args: tuple[Any, ...]) -> bool:
    """Whether every argument is a tensor, each passed once."""
    if len(args) == 1:
        return isinstance(args[0], torch.Tensor)
    return all(isinstance(arg, torch.Tensor) for arg in args) and len(set(map(id, args))) == len(
        args
    )


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

    __slots__ = ("args", "kwargs", "storages")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> None:
        if not kwargs and _distinct_tensors(args):  # checkpoint(block, h): the common call
            tensors.extend(args)
            self.args: Any = _TENSORS
            self.kwargs: Any = kwargs
        else:
            seen: dict[int, int] = {}
            self.args = _take_tensors(args, tensors, seen)
            self.kwargs = _take_tensors(kwargs, tensors, seen)
        self.storages = _storages(tensors)

    def as_called(
        self, tensors: list[torch.Tensor], *, writable: bool
    ) -> tuple[list[torch.Tensor], Windows | None]:
        """The unpacked inputs ``tensors``, laid out in storage as they were in the call.

        Inputs that shared a storage in the call (a tensor and a view of it, overlapping
        slices) share one again, each at its storage offset and strides, so a write through one
        reaches the others and an ``as_strided`` window reads the elements it read in the
        forward pass. An unpacked input that is a copy (offloaded, or kept by
        ``allow_mutation_on_saved_tensors``) starts its own storage at offset 0: it is laid
        out again. With ``writable`` (the function writes its inputs) every input is a
        non-leaf copy, so the recomputation's writes stay in it. The copies are connected to
        nothing that matters for the gradient: recomputation only reads their values.

        Returns:
            The inputs, and the `Windows` recomputation must stay within: where the storage
            the inputs shared was changed since the call, only the inputs' own elements hold
            what the forward pass read (None when every element does).
        """
        result = list(tensors)
        windows = Windows()
        with torch.enable_grad():
            for group in self.storages:
                if writable or not _laid_out(tensors, group):
                    _share(result, tensors, group)
                    owner = group.owner()
                    if owner is None or owner._version != group.version:
                        windows.allow(result[group.members[0][0]], group)
        return result, (windows if windows.spans else None)

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments again, with ``tensors`` in the places the inputs were."""
        if self.args is _TENSORS:
            return tuple(tensors), {}
        return _put_tensors(self.args, tensors), _put_tensors(self.kwargs, tensors)


class _Layout(NamedTuple):
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Storage(NamedTuple):
    """Inputs that shared one storage in the call, and (weakly) a tensor owning that storage."""

    members: list[tuple[int, _Layout]]
    owner: weakref.ref[torch.Tensor]
    version: int  # the owner's, at the call


def _storages(tensors: list[torch.Tensor]) -> list[_Storage]:
    """The strided inputs grouped by the storage (and dtype) they share, with their layouts."""
    groups: dict[tuple[int | None, torch.dtype], _Storage] = {}
    strided = [(index, t) for index, t in enumerate(tensors) if t.layout == torch.strided]
    for index, tensor in strided:
        # One input shares with nothing: its storage's address need not be read (a call each).
        key = storage_key(tensor) if len(strided) > 1 else None
        if key is None and len(strided) > 1:
            continue
        layout = _Layout(int(tensor.storage_offset()), tuple(tensor.shape), tensor.stride())
        group = groups.get((key, tensor.dtype))
        if group is None:
            owner = tensor if tensor._base is None else tensor._base
            group = groups[key, tensor.dtype] = _Storage([], weakref.ref(owner), owner._version)
        group.members.append((index, layout))
    return list(groups.values())


def _laid_out(tensors: list[torch.Tensor], group: _Storage) -> bool:
    """Whether the unpacked ``group`` still shares one storage with the layouts of the call."""
    if len(group.members) == 1 and tensors[group.members[0][0]] is group.owner():
        return True  # the input itself, unpacked as it was passed
    if len(group.members) > 1 and len({storage_key(tensors[i]) for i, _ in group.members}) > 1:
        return False
    return all(
        int(tensors[index].storage_offset()) == layout.offset
        and tensors[index].stride() == layout.stride
        for index, layout in group.members
    )


def _end(layout: _Layout) -> int:
    """One past the last element ``layout`` reaches (strides of tensors are never negative)."""
    if 0 in layout.size:
        return layout.offset
    last = sum((n - 1) * s for n, s in zip(layout.size, layout.stride, strict=True))
    return layout.offset + last + 1


def _share(copies: list[torch.Tensor], values: list[torch.Tensor], group: _Storage) -> None:
    """Make the copies of ``group`` views of one base holding each one's value, in place.

    The base is a copy of the storage the inputs shared in the call, as it is now where its
    owner is still alive (a window reaching past the inputs reads what is there), with each
    input's unpacked value written at its place.
    """
    first = values[group.members[0][0]]
    extent = max(_end(layout) for _, layout in group.members)
    requires_grad = any(values[index].requires_grad for index, _ in group.members)
    with torch.no_grad():
        flat = _storage_copy(group.owner(), first, extent)
        for index, layout in group.members:
            flat.as_strided(layout.size, layout.stride, layout.offset).copy_(values[index])
    base = flat.requires_grad_(requires_grad).clone()
    for index, layout in group.members:
        copies[index] = base.as_strided(layout.size, layout.stride, layout.offset)


def _storage_copy(owner: torch.Tensor | None, like: torch.Tensor, extent: int) -> torch.Tensor:
    """A flat copy of ``owner``'s storage in ``like``'s dtype, or zeros; at least ``extent``."""
    if owner is not None and owner.dtype == like.dtype and owner.layout == torch.strided:
        storage = owner.untyped_storage()
        count = storage.nbytes() // like.element_size()
        if count >= extent:
            flat = torch.empty(0, dtype=like.dtype, device=storage.device)
            return flat.set_(storage, 0, (count,), (1,)).clone()
    return torch.zeros(extent, dtype=like.dtype, device=like.device)


def save_inputs(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Save ``tensors`` through the hooks in force; return a function that unpacks them.

    The unpacking raises if an input's data was swapped since the call (``x.data = ...``): that
    moves no version, and recomputation would read values the forward pass did not.
    """
    unpack = _save_inputs(tensors)
    storages = [
        (weakref.ref(tensor), storage_key(tensor), moves(tensor))
        for tensor in tensors
        if tensor.layout == torch.strided
    ]

    def unpack_unswapped() -> list[torch.Tensor]:
        for index, (ref, key, swaps) in enumerate(storages):
            tensor = ref()
            if tensor is not None and storage_key(tensor) != key and moves(tensor) == swaps:
                raise SavedTensorModifiedError(_swapped_message(index))
        return unpack()

    return unpack_unswapped


def _swapped_message(index: int) -> str:
    return (
        f"tensorhooks.checkpoint: the data of the checkpointed function's tensor argument "
        f"{index} was replaced between the forward pass and backward (tensor.data = ..., or "
        "set_ under no_grad), so recomputation would read other values than the forward pass "
        "did. Replace it after backward."
    )


def _save_inputs(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
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


class Windows:
    """The elements of rebuilt storages that hold what the forward pass read.

    See `Arguments.as_called`: past the inputs' own elements such a storage holds today's
    values, so a window reaching there (``as_strided``) must raise rather than read them.
    """

    __slots__ = ("spans",)

    def __init__(self) -> None:
        # storage key -> a mask over its elements, True where an input's element lies
        self.spans: dict[int | None, torch.Tensor] = {}

    def allow(self, tensor: torch.Tensor, group: _Storage) -> None:
        """Allow the elements of ``group``'s inputs, on the storage ``tensor`` now lives on."""
        extent = max(_end(layout) for _, layout in group.members)
        with below_python_modes():
            mask = torch.zeros(extent, dtype=torch.bool)
            for _, layout in group.members:
                mask.as_strided(layout.size, layout.stride, layout.offset).fill_(True)
        self.spans[storage_key(tensor)] = mask

    def check(self, tensor: torch.Tensor, layout: _Layout) -> None:
        """Raise if a window ``layout`` of ``tensor``'s storage reaches past the inputs."""
        mask = self.spans.get(storage_key(tensor))
        if mask is None:
            return
        with below_python_modes():
            inside = _end(layout) <= mask.numel() and bool(
                mask.as_strided(layout.size, layout.stride, layout.offset).all()
            )
        if inside:
            return
        raise SavedTensorModifiedError(
            "one of the variables needed for gradient computation has been modified by an "
            "inplace operation: the checkpointed function takes an as_strided window of an "
            f"argument's storage (offset {layout.offset}, size {list(layout.size)}, stride "
            f"{list(layout.stride)}) that reaches past its arguments, and that storage was "
            "changed in place since the call, so recomputation cannot read what the forward "
            "pass read. Pass the tensor the window reads as an argument, or change it after "
            "backward."
        )

    def mode(self) -> _WindowGuard:
        """The dispatch mode that checks recomputation's ``as_strided`` windows."""
        return _WindowGuard(self)


_WINDOWS = frozenset({"aten::as_strided", "aten::as_strided_"})


class _WindowGuard(UnwrappedDispatchMode):
    def __init__(self, windows: Windows) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.windows = windows

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func._schema.name in _WINDOWS:
            source, size, stride, *rest = args
            offset = rest[0] if rest else kwargs.get("storage_offset")
            start = source.storage_offset() if offset is None else int(offset)
            self.windows.check(source, _Layout(start, tuple(size), tuple(stride)))
        return func(*args, **kwargs)
