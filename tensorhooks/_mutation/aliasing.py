"""Which saved tensors a write can reach: byte spans of a storage, and keys of shared clones.

A write reaches a saved tensor when both share a storage and their byte spans overlap; saved
aliases with equal clone keys share one clone. See NOTE [Clone before write] in `context.py`.
"""

from __future__ import annotations

import torch

__all__ = ["byte_span", "clone_key", "reaches"]

_EVERYTHING = (0, float("inf"))


def byte_span(tensor: torch.Tensor, resizes: bool) -> tuple[float, float] | None:
    """Bytes ``[lo, hi)`` of its storage that ``tensor`` can reach; None if it reaches none.

    ``resizes``: the op may resize ``tensor`` first, so anything past its storage offset counts.
    Symbolic or unavailable geometry gives the whole storage.
    """
    try:
        offset = tensor.storage_offset()
        sizes = tensor.size()
        strides = tensor.stride()
        itemsize = tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return _EVERYTHING
    if type(offset) is not int:
        return _EVERYTHING
    lo = hi = offset
    for size, stride in zip(sizes, strides, strict=True):
        if type(size) is not int or type(stride) is not int:
            return _EVERYTHING
        if size == 0:
            return (offset * itemsize, float("inf")) if resizes else None
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    if resizes:
        return (min(lo, offset) * itemsize, float("inf"))
    return (lo * itemsize, (hi + 1) * itemsize)


def reaches(span: tuple[float, float], saved: torch.Tensor) -> bool:
    """Whether a write reaching bytes ``span`` of the storage overlaps what ``saved`` reads."""
    saved_span = byte_span(saved, False)
    return saved_span is not None and saved_span[0] < span[1] and span[0] < saved_span[1]


def clone_key(tensor: torch.Tensor) -> object:
    """A key equal for two aliases whose clones are interchangeable.

    They must read the same elements (storage offset, sizes, strides) as the same values: same
    dtype, same conjugate and negative bits (a clone resolves them, so ``b`` and ``b.conj()``
    need two clones) and the same tensor type. Falls back to the tensor's identity (no sharing)
    without concrete integer geometry: symbolic sizes of fake tensors are unhashable.
    """
    try:
        geometry = (tensor.storage_offset(), *tensor.size(), *tensor.stride())
    except (RuntimeError, NotImplementedError):
        return id(tensor)
    if all(type(value) is int for value in geometry):
        return (
            type(tensor),
            tensor.dtype,
            tensor.is_conj(),
            tensor.is_neg(),
            tensor.dim(),
            geometry,
        )
    return id(tensor)
