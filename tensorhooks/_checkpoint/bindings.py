"""Bindings a region finds by name, and recomputation run with them as they were at the call.

The places: a module's ``__dict__`` and ``_buffers``, a closure cell, a global, an item of a list
or dict (or an attribute of a plain object) held there, a class's attribute. See
NOTE [State a region reaches] in state.py.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "MAX_ITEMS",
    "RESTORABLE",
    "Bindings",
    "Called",
    "Mode",
    "Rebinding",
    "Slot",
    "class_slots",
    "code_of",
    "function_slots",
    "is_torchs",
    "owning_module",
    "slot_items",
    "submodules",
]

# The bindings recomputation restores: tensors and the values state is kept in (numbers, None,
# strings, tuples). Other objects (lists, dicts, modules, functions) are not rebound: what they
# hold is reached through them.
RESTORABLE = (torch.Tensor, int, float, bool, complex, str, tuple, type(None))


def _restorable(key: object, value: object, now: object) -> bool:
    return isinstance(value, RESTORABLE) or isinstance(now, torch.Tensor)


_MISSING = object()


def code_of(function: Callable[..., Any]) -> object:
    """What calls of ``function`` share: its code object, or its module's class.

    A ``functools.partial`` counts the classes of the modules it carries too
    (`checkpoint_module` runs every module through one function).
    """
    if isinstance(function, torch.nn.Module):
        return type(function)  # (asked first: a module's getattr of a missing name is slow)
    carried: tuple[type, ...] = ()
    while isinstance(function, functools.partial):
        carried += tuple(type(a) for a in function.args if isinstance(a, torch.nn.Module))
        function = function.func
    code = getattr(function, "__code__", None)
    if code is None:
        code = getattr(getattr(function, "__func__", None), "__code__", None) or type(function)
    return (code, *carried) if carried else code


class Bindings:
    """A dict of bindings (a module's ``__dict__`` or ``_buffers``) as it was at the call."""

    __slots__ = ("added", "at_call", "live")

    def __init__(self, live: dict[str, Any]) -> None:
        self.live = live
        self.at_call = live.copy()
        self.added: tuple[str, ...] = ()  # keys the forward pass bound for the first time

    def seal(self) -> None:
        """Note the keys the forward pass added, which recomputation must not find yet."""
        if len(self.live) != len(self.at_call):
            self.added = tuple(self.live.keys() - self.at_call.keys())

    def unchanged(self) -> bool:
        """Whether every key is bound as at the call (in C: equality tests identity first)."""
        try:
            return not self.added and self.live == self.at_call
        except Exception:  # a value whose == is elementwise, or refuses: look one by one
            return False

    def changes(self) -> list[Rebinding]:
        """What to bind in recomputation: keys rebound since the call, and keys added by it."""
        changes = []
        live, at_call = self.live, self.at_call
        for key, value in at_call.items():
            now = live.get(key, _MISSING)
            if now is not value and _restorable(key, value, now):
                changes.append(Rebinding(live, key, value, now))
        changes.extend(
            Rebinding(live, key, _MISSING, live[key])
            for key in self.added
            if key in live and isinstance(live[key], RESTORABLE)
        )
        return changes


class Rebinding:
    """One binding to set as it was at the call while recomputation runs, then put back."""

    __slots__ = ("at_call", "how", "key", "live", "now")

    def __init__(
        self, live: Any, key: Any, at_call: object, now: object, *, how: str = "item"
    ) -> None:
        self.live = live  # a dict, a list, a closure cell, or a class
        self.key = key
        self.at_call = at_call
        self.now = now
        self.how = how

    def apply(self) -> None:
        self._bind(self.at_call)

    def undo(self) -> None:
        self._bind(self.now)

    def _bind(self, value: object) -> None:
        live, key = self.live, self.key
        if self.how == "cell":
            live.cell_contents = value
        elif self.how == "attribute":
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(live, key)
            else:
                setattr(live, key, value)
        elif value is _MISSING:
            if isinstance(live, dict):
                live.pop(key, None)
        else:
            live[key] = value


class Called:
    """A module the region reaches, as it was when the region started."""

    __slots__ = ("attributes", "buffers", "module")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.attributes = Bindings(module.__dict__)
        self.buffers = Bindings(module._buffers) if module._buffers else None

    def seal(self) -> None:
        self.attributes.seal()
        if self.buffers is not None:
            self.buffers.seal()

    def changes(self) -> list[Rebinding]:
        found = [] if self.attributes.unchanged() else self.attributes.changes()
        if self.buffers is not None and not self.buffers.unchanged():
            found.extend(self.buffers.changes())
        return found


class Mode:
    """One of torch's own modules holding no state, with its mode (``training``) at the call."""

    __slots__ = ("module", "training")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.training = module.training

    def seal(self) -> None:
        pass

    def changes(self) -> list[Rebinding]:
        now = self.module.training
        if now is self.training:
            return []
        return [Rebinding(self.module.__dict__, "training", self.training, now)]


_TORCHS: dict[type, bool] = {}


def is_torchs(kind: type) -> bool:
    """Whether ``kind`` is one of torch.nn's own layers (asked once per class).

    A layer defines its forward and keeps its state in parameters and buffers only. A bare
    ``torch.nn.Module``, a ``ModuleList`` or a ``ModuleDict`` is not one: code uses them as
    holders, setting attributes of its own on them.
    """
    found = _TORCHS.get(kind)
    if found is None:
        found = _TORCHS[kind] = (
            kind.__module__.startswith(_TORCH_MODULES)
            and getattr(kind, "forward", None) is not torch.nn.Module.forward
        )
    return found


def owning_module(function: Callable[..., Any]) -> torch.nn.Module | None:
    """The module a function is, or is a method of (also through ``functools.partial``)."""
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and every module under it, each once (their own dicts: this runs per call)."""
    found = [module]
    seen = {id(module)}
    for owner in found:  # grows while it is walked: breadth first
        for child in owner._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


_TORCH_MODULES = "torch.nn.modules."


_CLASS_SLOTS: weakref.WeakKeyDictionary[type, list[tuple[str, str, Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def class_slots(kind: type) -> list[Slot]:
    """Where a module's class keeps state of its own: class attributes, its forward's names.

    Found once per class (torch's own classes keep none); read at every call.
    """
    if is_torchs(kind):
        return []
    places = _CLASS_SLOTS.get(kind)
    if places is None:
        places = _CLASS_SLOTS[kind] = _find_class_places(kind)
    return [Slot(*place) for place in places]


def _find_class_places(kind: type) -> list[tuple[str, str, Any, Any]]:
    places: list[tuple[str, str, Any, Any]] = []
    if kind.__module__.startswith("torch."):
        return places
    for klass in kind.__mro__:
        if klass.__module__.startswith("torch."):
            continue
        for key, value in vars(klass).items():
            if isinstance(value, torch.Tensor):
                places.append((f"{klass.__name__}.{key}", "attribute", klass, key))
    forward = getattr(kind, "forward", None)
    if isinstance(forward, types.FunctionType):
        prefix = f"{kind.__name__}.forward's "
        places.extend(
            (prefix + slot.label, slot.kind, slot.holder, slot.key)
            for slot in function_slots(forward)
            if slot.kind != "value"
        )
    return places


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # not bound yet
        return None


class Slot:
    """A place a function reads by name, or a value it carries.

    A closure cell, a global, an item of a container there or an attribute of an object there;
    or a default or a partial's argument, which cannot be rebound.
    """

    __slots__ = ("at_call", "holder", "key", "kind", "label")

    def __init__(self, label: str, kind: str, holder: Any, key: Any = None) -> None:
        self.label = label
        # "cell", "item" (of a dict, a list, an object's __dict__), "attribute" (of a class), or
        # "value" (carried, not rebindable)
        self.kind = kind
        self.holder = holder
        self.key = key
        self.at_call = self.read()

    def read(self) -> object:
        kind, holder, key = self.kind, self.holder, self.key
        if kind == "cell":
            return _cell_value(holder)
        if kind == "item":
            if isinstance(holder, list):
                return holder[key] if key < len(holder) else _MISSING
            return holder.get(key, _MISSING)
        if kind == "attribute":
            return getattr(holder, key, _MISSING)
        return holder

    def rebinding(self) -> Rebinding | None:
        """How to bind the slot as at the call, if it was rebound since."""
        if self.kind == "value":
            return None
        now = self.read()
        if now is self.at_call or (isinstance(self.holder, list) and now is _MISSING):
            return None
        return Rebinding(self.holder, self.key, self.at_call, now, how=self.kind)


MAX_ITEMS = 64  # items of one container the walk looks at: it runs on every call


def function_slots(function: Callable[..., Any]) -> Iterator[Slot]:
    """The places a function reads by name, and the values it carries; see NOTE [State...]."""
    if isinstance(function, functools.partial):
        for index, item in enumerate(function.args):
            yield Slot(f"partial argument {index}", "value", item)
        for key, item in function.keywords.items():
            yield Slot(f"partial argument {key!r}", "value", item)
        yield from function_slots(function.func)
        return
    if isinstance(function, types.MethodType):
        yield Slot("self", "value", function.__self__)
        function = function.__func__
    if not isinstance(function, types.FunctionType):
        return
    code = function.__code__
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=True):
        yield Slot(name, "cell", cell)
    names = function.__globals__
    for name in code.co_names:
        if name in names:
            yield Slot(name, "item", names, name)
    for index, item in enumerate(function.__defaults__ or ()):
        yield Slot(f"default {index}", "value", item)


def slot_items(slot: Slot, value: object) -> Iterator[Slot]:
    """The slots one level inside a container or a plain object the function holds."""
    label = slot.label
    if isinstance(value, list):
        for index in range(min(len(value), MAX_ITEMS)):
            yield Slot(f"{label}[{index}]", "item", value, index)
    elif isinstance(value, tuple):
        for index, item in enumerate(value[:MAX_ITEMS]):
            yield Slot(f"{label}[{index}]", "value", item)
    elif isinstance(value, dict):
        for key in list(value)[:MAX_ITEMS]:
            yield Slot(f"{label}[{key!r}]", "item", value, key)
    elif _is_plain_object(value):
        attributes = vars(value)
        for key in list(attributes)[:MAX_ITEMS]:
            yield Slot(f"{label}.{key}", "item", attributes, key)


_NOT_PLAIN = frozenset({"builtins", "typing", "abc", "functools"})


def _is_plain_object(value: object) -> bool:
    """Whether ``value`` is an instance of a user's class, whose attributes a function may read."""
    kind = type(value)
    return (
        hasattr(value, "__dict__")
        and kind.__module__ not in _NOT_PLAIN
        and not kind.__module__.startswith("torch")
        and not isinstance(value, (type, types.ModuleType, types.FunctionType, torch.nn.Module))
    )
