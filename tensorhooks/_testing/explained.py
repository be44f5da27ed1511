"""A checkpoint region run as plain autograd, noting what would explain a checkpoint's error.

See NOTE [What explains a checkpoint's error].
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tensorhooks._core.torch_compat import TorchDispatchMode, op_schema, storage_key

__all__ = ["CHECKPOINT_KEYWORDS", "Inline", "tensors_in"]

# NOTE [What explains a checkpoint's error]
#
# A checkpoint recomputes a region in backward from what the region reads then. Where the
# program changed what a region read after its forward pass and before backward, recomputation
# cannot give plain autograd's result on its own, and an error naming the change is a right
# answer (as plain autograd's in-place error is for a saved tensor). Anywhere else an error is
# a false alarm: state the region itself writes, rebinds or rebuilds (a running statistic, a
# counter, a mask kept on ``self``, a cache entry, a ``.data`` swap to the same values) must be
# replayed, and state the region can reach but never read (a later layer of its parent module)
# does not concern it. `Inline` runs each region as a plain call and notes, per call:
#   - the tensors it read that existed before the call (a dispatch mode sees every op's tensor
#     arguments; a storage an op of the call made is the region's own), each with its version
#     and values at the end of the call: written after it (its version moved, or a kernel wrote
#     it without moving it), it explains an error;
#   - what the function reaches (its closure, the globals its code names, a module region's
#     module; in those, lists, tuples, dicts, plain objects, modules' parameters, buffers and
#     public attributes, a few levels deep), by path, before and after the call. A path whose
#     tensor the call read (before or after the call) and that holds, at backward, a tensor
#     with other values or a moved version (rebound, its data swapped, written), or a number
#     (an int counter) other than at the end of the call, explains an error. One holding equal
#     values (a gather of the same weights, a renormalisation done again) does not;
#   - its tensor arguments, with their versions before the call: an argument written in place
#     (by the region or later) explains autograd's in-place error, which a saved input raises;
#   - under a selective policy, whether an op of the region wrote in place (a policy refuses a
#     saved output written later).

# Keywords of torch's checkpoint (and tensorhooks'), which a region's function never sees.
CHECKPOINT_KEYWORDS = (
    "context_fn",
    "debug",
    "determinism_check",
    "early_stop",
    "preserve_rng_state",
    "respect_saved_tensors_hooks",
    "use_reentrant",
)
_DEPTH = 3  # levels of containers and objects the walk enters
_Path = tuple[Any, ...]


class Inline:
    """Runs each checkpoint region as plain autograd: its function called on its arguments.

    See NOTE [What explains a checkpoint's error] for what it notes on the way.
    """

    def __init__(self) -> None:
        self.arguments: list[tuple[torch.Tensor, int, int | None]] = []
        self.calls: list[_Call] = []
        self.policy_writes = False

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        policy = kwargs.get("context_fn") is not None
        for keyword in CHECKPOINT_KEYWORDS:
            kwargs.pop(keyword, None)
        self.arguments.extend(map(_as_argument, tensors_in([args, kwargs])))
        call = _Call(function, None)
        self.calls.append(call)
        with call.reads, _Writes() if policy else contextlib.nullcontext() as writes:
            result = function(*args, **kwargs)
        call.end()
        self.policy_writes |= writes is not None and writes.seen
        return result

    def module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Leave ``module`` plain, noting what its forward reads, as for a function's region."""
        open_calls: list[_Call] = []

        def before(_: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.arguments.extend(map(_as_argument, tensors_in([args, kwargs])))
            call = _Call(type(module).forward, module)
            self.calls.append(call)
            open_calls.append(call)
            call.reads.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch

        def after(_: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if open_calls:
                call = open_calls.pop()
                call.reads.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped
                call.end()

        module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
        module.register_forward_hook(after, with_kwargs=True, prepend=True, always_call=True)
        return module

    @property
    def explains_inplace_error(self) -> bool:
        """Whether the program changed what a region read after its call, or a policy wrote."""
        return (
            self.policy_writes
            or any(_moved(*argument) for argument in self.arguments)
            or any(call.changed() for call in self.calls)
        )


def _as_argument(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int | None]:
    return tensor, tensor._version, storage_key(tensor)


def _moved(tensor: torch.Tensor, version: int, storage: int | None) -> bool:
    return tensor._version != version or storage_key(tensor) != storage


class _Call:
    """One region's call: what its function reached before and after, and what it read."""

    def __init__(self, function: Callable[..., Any], module: torch.nn.Module | None) -> None:
        self.function = function
        self.module = module
        # The storage each reached tensor had when the call began (a ``.data`` swap changes it).
        self.before = {
            path: _key(item) if isinstance(item, torch.Tensor) else None
            for path, item in _reached(function, module)
        }
        self.reads = _Reads()
        self.after: dict[_Path, _Value] = {}
        self.read: list[_Value] = []

    def end(self) -> None:
        """At the end of the call: what it reached now, and its reads' values."""
        self.after = {path: _Value(item) for path, item in _reached(self.function, self.module)}
        self.read = [_Value(tensor) for tensor in self.reads.read.values()]

    def changed(self) -> bool:
        """Whether something the call read changed since the call ended."""
        if any(value.changed(value.item) for value in self.read):
            return True
        read = self.reads.read
        now = dict(_reached(self.function, self.module))
        for path, value in self.after.items():
            unread = not {value.storage, self.before.get(path)} & read.keys()
            if isinstance(value.item, torch.Tensor) and unread:
                continue  # reachable, never read by this region
            if path not in now or value.changed(now[path]):
                return True
        return False


class _Value:
    """A tensor (its version, storage and values) or a number, as it was at one moment."""

    __slots__ = ("item", "storage", "values", "version")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.storage: int | None = None
        if isinstance(item, torch.Tensor):
            self.version = item._version
            self.storage = _key(item)
            self.values = item.detach().clone()

    def changed(self, now: Any) -> bool:
        """Whether ``now`` (at this value's place) differs from it: another number or values.

        A tensor written since (its version moved) has changed even with equal values, as for
        autograd's own check; one rebound or with its data swapped has changed if its values
        differ.
        """
        if not isinstance(self.item, torch.Tensor):
            return bool(now != self.item)
        if not isinstance(now, torch.Tensor):
            return True
        if now is self.item and now._version != self.version:
            return True
        return not _same_values(now.detach(), self.values)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _key(tensor: torch.Tensor) -> int | None:
    return storage_key(tensor) if tensor.layout == torch.strided else None


def _reached(
    function: Callable[..., Any], module: torch.nn.Module | None
) -> list[tuple[_Path, Any]]:
    """What ``function`` (and a module region's ``module``) reaches, by path: tensors, numbers.

    Its closure and the globals its code names, walked by `_held`.
    """
    roots: list[tuple[_Path, Any]] = [] if module is None else [(("self",), module)]
    for index, cell in enumerate(getattr(function, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            roots.append((("cell", index), cell.cell_contents))
    code, names = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    roots.extend(
        (("global", name), names[name]) for name in (code.co_names if code else ()) if name in names
    )
    return [item for path, value in roots for item in _held(value, path, 0)]


def _held(value: Any, path: _Path, depth: int) -> Iterator[tuple[_Path, Any]]:
    """The tensors and numbers ``value`` is or holds, by path, a few levels deep."""
    if isinstance(value, torch.Tensor):
        if not torch.nn.parameter.is_lazy(value):  # a lazy module's, before its first call
            yield path, value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path, value
    elif isinstance(value, torch.nn.Module):
        yield from _module_held(value, path, depth)
    elif depth < _DEPTH and isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _held(item, (*path, index), depth + 1)
    elif depth < _DEPTH and isinstance(value, dict):
        for key, item in list(value.items()):
            yield from _held(item, (*path, key), depth + 1)
    elif depth < _DEPTH and isinstance(value, types.SimpleNamespace):
        yield from _held(vars(value), path, depth + 1)


def _module_held(module: torch.nn.Module, path: _Path, depth: int) -> Iterator[tuple[_Path, Any]]:
    """A module's parameters and buffers, and what its public attributes hold, by name."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        yield from _held(tensor, (*path, name), depth)
    if depth >= _DEPTH:
        return
    for prefix, inner in module.named_modules():
        for name, item in list(vars(inner).items()):
            if not name.startswith("_") and not isinstance(item, torch.nn.Module):
                yield from _held(item, (*path, prefix, name), depth + 1)


class _Reads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """The tensors the ops read whose storage existed before (an op here made none of it)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.made: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}  # by storage; held, so that no key is reused

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        keys = {_key(t) for t in inputs}
        for tensor in inputs:
            key = _key(tensor)
            if key is not None and key not in self.made and key not in self.read:
                self.read[key] = tensor
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            key = _key(tensor) if isinstance(tensor, torch.Tensor) else None
            if key is not None and key not in keys:
                self.made.add(key)
        return out


class _Writes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """Notes whether an op wrote one of its arguments in place."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.seen = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        arguments = op_schema(func).arguments
        self.seen |= any(a.alias_info is not None and a.alias_info.is_write for a in arguments)
        return func(*args, **(kwargs or {}))


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors ``value`` is or holds in lists, tuples and dicts, nested."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
