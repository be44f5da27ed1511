"""How a profile's bytes grow with the sizes of the step's inputs.

See NOTE [Sizes that vary between steps] below.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorhooks._core.torch_compat import storage_key

__all__ = [
    "Exps",
    "Growth",
    "SizeModel",
    "SizeTracker",
    "grown",
    "ratios_for",
    "signature_of",
]

# NOTE [Sizes that vary between steps]
#
# A training run's batches differ in shape: a collator pads each batch to its own longest row,
# packed and RL batches vary in rows and lengths. The profile is of one step; the other steps'
# bytes are found from it without running them, from the shapes.
#
# While the profiled step runs, every tensor the forward pass makes gets, per dimension, an
# exponent vector over the *size classes*: the distinct sizes of the dimensions of the tensors the
# model is called with (``input_ids`` of 2 x 48 gives the classes 2 and 48). A dimension of an
# input is its class; an op's output dimension takes the exponents of an input dimension of that
# op with the same size (the largest, where several match), or of a run of adjacent dimensions
# of one input whose sizes multiply to it (a reshape that merges batch and length: 96 = 2 x 48);
# else of the size classes it equals or whose product it is (a class is also made for a length
# less or more a token or two, the labels a causal LM shifts by one: it grows by as many tokens as
# that length); else, when the op's inputs grow, as
# its largest input grows (a size that depends on the data, such as the tokens routed to one
# expert); else it is constant (a parameter's width, a head count). A storage's bytes then grow
# as the product of its tensor's dimensions: each byte figure of the profile is a sum of terms,
# bytes at the profile times the product of the classes' ratios to their exponents (`Growth`).
#
# A step is known by its *signature*: the path and shape of every tensor the model is called with
# (arguments and keyword arguments, in lists, tuples and dicts). A step whose signature differs
# from the profile's scales each class by the largest ratio of its dimensions at the paths both
# signatures have (a tensor passed in one only, ``labels`` in training, is not looked at), never
# below 1: a
# dimension that shrank keeps the profile's size. So a plan made for the profiled step stands for
# every smaller one, and the sizes of a larger one are never below what it holds, also where a
# constant happened to equal a class size at the profile (a width of 48 beside a length of 48
# grows with it: an overestimate, never an underestimate).

Exps = tuple[int, ...]
"""Exponents, one per size class."""

_NEAR = 8
"""Input dimensions at least this long get classes for their size less or more 1 and 2."""

Growth = tuple[tuple[Exps, int], ...]
"""A byte figure as terms: (exponents, bytes at the profile); it grows as the sum of them."""

Signature = tuple[tuple[str, tuple[int, ...]], ...]
"""The path and shape of each tensor the model is called with."""


def signature_of(args: Any, kwargs: Any) -> Signature:
    """The path and shape of every tensor in ``args`` and ``kwargs`` (lists, tuples, dicts too)."""
    found: list[tuple[str, tuple[int, ...]]] = []
    _walk(args, "args", found)
    _walk(kwargs, "kwargs", found)
    return tuple(found)


def _walk(value: Any, path: str, found: list[tuple[str, tuple[int, ...]]]) -> None:
    if isinstance(value, torch.Tensor):
        found.append((path, tuple(value.shape)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", found)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}.{key}", found)


def _tensors_of(args: Any, kwargs: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = [args, kwargs]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    found.reverse()
    return found


@dataclass(frozen=True)
class SizeModel:
    """How a profile's byte figures grow with the sizes of the step's inputs.

    Attributes:
        signature: the path and shape of each tensor the profiled step called the model with
            (or its first block, when it never called the model itself).
        source: ``"model"`` or ``"block"``: which call the signature is of.
        classes: the profiled size of each size class.
        bases: per class, the size of the input dimension it follows: itself, or for a class a
            little off a length (the length less the one token a causal LM shifts off), that
            length's, which it grows with by as many tokens.
        fixed: growth of the profile's ``fixed_bytes``.
        after: growth of ``after_bytes``.
        blocks: per block, the growth of its figures (see `BlockSizes`).
    """

    signature: Signature
    source: str
    classes: tuple[int, ...]
    bases: tuple[int, ...]
    fixed: Growth
    after: Growth
    blocks: tuple[BlockSizes, ...]


@dataclass(frozen=True)
class BlockSizes:
    """The growth of one block's byte figures, field by field of its `BlockProfile`."""

    saved: Growth
    input: Growth
    saved_and_input: Growth
    following: Growth
    inputs: tuple[tuple[Growth, Growth], ...]
    """Per input: its storage's bytes, and its tensor's."""
    ops: tuple[tuple[Growth, Growth, Growth], ...]
    """Per op: saved bytes, other bytes, smallest output."""


def grown(growth: Growth, ratios: Sequence[float]) -> int:
    """The bytes of ``growth`` with each size class grown by its ratio (rounded up)."""
    total = 0.0
    for exps, nbytes in growth:
        factor = 1.0
        for ratio, power in zip(ratios, exps, strict=True):
            if power:
                factor *= ratio**power
        total += nbytes * factor
    nearest = round(total)
    return nearest if abs(total - nearest) <= 1e-9 * max(total, 1.0) else math.ceil(total)


def ratios_for(model: SizeModel, signature: Signature) -> tuple[float, ...] | None:
    """Each size class's growth from the profile to ``signature``, at least 1; None if unlike.

    Read from the tensors at the paths both have (a tensor only one of them has, such as
    ``labels`` passed in training and not in evaluation, is not looked at). None where they
    have none in common, or one of another rank: the sizes cannot be told then.
    """
    now = dict(signature)
    grown_to = {size: size for size in model.classes}
    common = 0
    for path, shape in model.signature:
        now_shape = now.get(path)
        if now_shape is None:
            continue
        if len(shape) != len(now_shape):
            return None
        common += 1
        for size, now_size in zip(shape, now_shape, strict=True):
            if size in grown_to:
                grown_to[size] = max(grown_to[size], now_size)
    if not common:
        return None
    return tuple(
        max(1.0, (grown_to[base] + size - base) / size) if size > 0 else 1.0
        for size, base in zip(model.classes, model.bases, strict=True)
    )


def _added(first: Exps, second: Exps) -> Exps:
    return tuple(a + b for a, b in zip(first, second, strict=True))


class SizeTracker:
    """The exponents of every tensor's dimensions while the profiled step's forward runs.

    See NOTE [Sizes that vary between steps]. `start` names the size classes from the tensors
    the model is called with; `op` gives each output of an op its exponents, and returns, per
    output, those of its number of elements.
    """

    def __init__(self, excluded: Iterable[int]) -> None:
        self.excluded = set(excluded)
        self.signature: Signature | None = None
        self.source = ""
        self.classes: dict[int, int] = {}
        self.bases: tuple[int, ...] = ()
        self.zero: Exps = ()
        self._dims: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Exps, ...]]] = {}

    @property
    def started(self) -> bool:
        return self.signature is not None

    def start(self, args: Any, kwargs: Any, source: str) -> None:
        """The model (or its first block) is called with ``args`` and ``kwargs``: the classes."""
        self.signature = signature_of(args, kwargs)
        self.source = source
        roots = sorted({size for _, shape in self.signature for size in shape if size > 0})
        bases = {size: size for size in roots}
        for root in roots:  # a length less or more a token or two: see `SizeModel.bases`
            for offset in (-2, -1, 1, 2) if root >= _NEAR else ():
                bases.setdefault(root + offset, root)
        sizes = sorted(bases)
        self.classes = {size: index for index, size in enumerate(sizes)}
        self.bases = tuple(bases[size] for size in sizes)
        self.zero = (0,) * len(sizes)
        for tensor in _tensors_of(args, kwargs):
            self._remember(tensor, tuple(self._unit(size) for size in tensor.shape))

    def class_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.classes, key=self.classes.__getitem__))

    def _unit(self, size: int) -> Exps:
        index = self.classes.get(size)
        if index is None:
            return self.zero
        return tuple(int(position == index) for position in range(len(self.zero)))

    def _remember(self, tensor: torch.Tensor, dims: tuple[Exps, ...]) -> None:
        self._dims[id(tensor)] = (weakref.ref(tensor), dims)

    def dims(self, tensor: torch.Tensor) -> tuple[Exps, ...]:
        """The exponents of ``tensor``'s dimensions: a parameter's 0, an unseen one's by size."""
        entry = self._dims.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        if storage_key(tensor) in self.excluded:
            return (self.zero,) * tensor.dim()
        return tuple(self._global(size) for size in tensor.shape)

    def numel(self, tensor: torch.Tensor) -> Exps:
        """The exponents of ``tensor``'s number of elements."""
        total = self.zero
        for exps in self.dims(tensor):
            total = _added(total, exps)
        return total

    def _global(self, size: int) -> Exps:
        """A size seen nowhere among an op's inputs: a class, or a product of two, or constant."""
        if size in self.classes:
            return self._unit(size)
        for first in self.classes:
            if first > 1 and size % first == 0 and (size // first) in self.classes:
                return _added(self._unit(first), self._unit(size // first))
        return self.zero

    def _multiple(self, size: int) -> Exps:
        """The exponents of the largest product of classes (each once) that divides ``size``."""
        best, product = self.zero, 1
        sizes = [
            value
            for value, base in zip(self.classes, self.bases, strict=True)
            if value > 1 and value == base
        ]
        for count in range(1, len(sizes) + 1):
            for chosen in itertools.combinations(sizes, count):
                value = math.prod(chosen)
                if size % value == 0 and value > product:
                    best, product = self.zero, value
                    for item in chosen:
                        best = _added(best, self._unit(item))
        return best

    def op(
        self, func: Any, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> list[Exps]:
        """Give each of ``outputs`` of ``func`` its dimensions' exponents; return their numels'."""
        if not self.started or not self.zero:
            return [self.zero for _ in outputs]
        known = [_Known(tensor, self.dims(tensor), self.zero) for tensor in inputs]
        joins = getattr(func, "overloadpacket", None) is _CAT
        result = []
        for tensor in outputs:
            dims = self._output(tensor, known, joins=joins)
            self._remember(tensor, dims)
            total = self.zero
            for exps in dims:
                total = _added(total, exps)
            result.append(total)
        return result

    def _output(
        self, tensor: torch.Tensor, known: list[_Known], *, joins: bool
    ) -> tuple[Exps, ...]:
        """An output's dimensions: as an input's, a view's, or matched (see NOTE above)."""
        shape = tuple(tensor.shape)
        for item in known:
            if item.shape == shape:
                return item.dims
        key = storage_key(tensor)
        for item in known:
            if key is not None and item.key == key and tensor.layout == torch.strided:
                viewed = self._viewed(tensor, item)
                if viewed is not None:
                    return viewed
        return tuple(
            self._aligned(size, len(shape) - position, len(shape), known, joins=joins)
            for position, size in enumerate(shape)
        )

    def _viewed(self, tensor: torch.Tensor, base: _Known) -> tuple[Exps, ...] | None:
        """A view's dimensions: a reshape's factors, else the input dimension of each stride."""
        if tensor.numel() == base.numel and tensor.is_contiguous() and base.contiguous:
            return self._reshaped(base.shape, base.dims, tuple(tensor.shape))
        strides: dict[int, tuple[int, Exps]] = {}
        for size, stride, exps in zip(base.shape, base.strides, base.dims, strict=True):
            if size > 1:
                strides.setdefault(stride, (size, exps))
        result = []
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
            found = strides.get(stride) if size > 1 else None
            if found is not None and found[0] == size:
                result.append(found[1])  # the same dimension (a slice of it is matched anew)
            else:
                result.append(self._aligned(size, 0, 0, [base], joins=False))
        return tuple(result)

    def _reshaped(
        self, shape: tuple[int, ...], dims: tuple[Exps, ...], out: tuple[int, ...]
    ) -> tuple[Exps, ...]:
        """A reshape's dimensions: each group of input dimensions to the output ones it makes."""
        result: list[Exps] = []
        i = j = 0
        while j < len(out):
            if out[j] == 1:
                result.append(self.zero)
                j += 1
                continue
            while i < len(shape) and shape[i] == 1:
                i += 1
            if i >= len(shape):
                result.append(self._global(out[j]))
                j += 1
                continue
            group_in, group_out = [i], [j]
            have, want = shape[i], out[j]
            while have != want:
                if have < want and group_in[-1] + 1 < len(shape):
                    group_in.append(group_in[-1] + 1)
                    have *= shape[group_in[-1]]
                elif want < have and group_out[-1] + 1 < len(out):
                    group_out.append(group_out[-1] + 1)
                    want *= out[group_out[-1]]
                else:
                    break
            total = self.zero
            for k in group_in:
                total = _added(total, dims[k])
            result.extend(
                self._split(
                    total,
                    [out[k] for k in group_out],
                    [shape[k] for k in group_in],
                    [dims[k] for k in group_in],
                )
            )
            i, j = group_in[-1] + 1, group_out[-1] + 1
        return tuple(result)

    def _split(
        self, total: Exps, pieces: list[int], sizes: list[int], dims: list[Exps]
    ) -> list[Exps]:
        """The exponents of ``pieces`` that together make input dimensions growing as ``total``."""
        if len(pieces) == 1:
            return [total]
        if not any(total):
            return [self.zero] * len(pieces)
        result = []
        left = total
        for piece in pieces:
            exps = next((d for s, d in zip(sizes, dims, strict=True) if s == piece), None)
            if exps is None:
                exps = self._unit(piece)
            if any(e > t for e, t in zip(exps, left, strict=True)):
                exps = self.zero
            left = tuple(t - e for t, e in zip(left, exps, strict=True))
            result.append(exps)
        if any(left):  # what no piece took goes to the largest
            largest = max(range(len(pieces)), key=pieces.__getitem__)
            result[largest] = _added(result[largest], left)
        return result

    def _aligned(
        self, size: int, from_right: int, rank: int, known: list[_Known], *, joins: bool
    ) -> Exps:
        """An output dimension ``from_right`` from the last (0: its position tells nothing).

        The inputs of the output's rank (an elementwise op's, a matmul's) align with it from
        the right: a dimension of theirs there of the same size is the same dimension.
        """
        best: Exps | None = None
        same = [item for item in known if len(item.shape) == rank]
        if from_right:
            for item in same:
                if item.shape[-from_right] == size:
                    exps = item.dims[-from_right]
                    if best is None or sum(exps) > sum(best):
                        best = exps
            if best is not None:
                return best
            if joins and same and sum(item.shape[-from_right] for item in same) == size:
                # a concatenation along this dimension: the sum of the inputs' sizes
                return max((item.dims[-from_right] for item in same), key=sum)
        return self._matched(size, known)

    def _matched(self, size: int, known: list[_Known]) -> Exps:
        """A dimension matched by its size alone (see NOTE [Sizes that vary between steps])."""
        best: Exps | None = None
        for item in known:
            for other, exps in zip(item.shape, item.dims, strict=True):
                if other == size and (best is None or sum(exps) > sum(best)):
                    best = exps
        if best is not None:
            return best
        if size in self.classes or size <= 1:
            return self._unit(size)
        if not known:  # made from sizes alone (arange, zeros): as the sizes it is a multiple of
            return self._multiple(size)
        constants = [
            other
            for item in known
            for other, exps in zip(item.shape, item.dims, strict=True)
            if not any(exps) and other
        ]
        if any(constant % size == 0 for constant in constants):
            return self.zero  # a piece of a constant (heads of a width)
        exps = self._global(size)
        if any(exps) or not any(any(map(any, item.dims)) for item in known):
            return exps
        # A size that depends on the data (the tokens routed to one expert): as the op's
        # largest input grows, at most.
        return max((item.numel_exps for item in known), key=sum)


_CAT = torch.ops.aten.cat


class _Known:
    """An op's input: its shape, strides and storage, and its dimensions' exponents."""

    __slots__ = ("contiguous", "dims", "key", "numel", "numel_exps", "shape", "strides")

    def __init__(self, tensor: torch.Tensor, dims: tuple[Exps, ...], zero: Exps) -> None:
        self.shape = tuple(tensor.shape)
        self.dims = dims
        self.numel = tensor.numel()
        strided = tensor.layout == torch.strided
        self.strides = tensor.stride() if strided else (0,) * len(self.shape)
        self.contiguous = strided and tensor.is_contiguous()
        self.key = storage_key(tensor)
        total = zero
        for exps in dims:
            total = _added(total, exps)
        self.numel_exps = total
