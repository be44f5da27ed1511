"""The step as the user runs it, traced for `explain`: every save, who holds it, for how long.

See NOTE [Tracing a step as the user runs it] below.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tensorhooks._core.guards import (
    is_output_of_saving_node,
    is_protected_pack_hook,
    register_protected_pack_hook,
)
from tensorhooks._core.torch_compat import (
    OpOverload,
    UnwrappedDispatchMode,
    current_dispatch_mode,
    current_graph_task_id,
    fsdp2_modules,
    get_disabled_hooks_message,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    storage_key,
    top_saved_tensors_hooks,
)
from tensorhooks._hooks import saved_tensors_hooks

from .accounting import DEVICE, HOST, module_keys, storage_bytes
from .apply import tensors_in
from .layers import CACHE_ARGUMENTS

__all__ = [
    "OFFLOADED",
    "RECOMPUTED",
    "SAVED",
    "Call",
    "Interval",
    "OpRecord",
    "Pair",
    "Site",
    "Trace",
    "display_name",
    "traced",
]

# NOTE [Tracing a step as the user runs it]
#
# `explain` measures the step as it is, with whatever checkpointing, offloading and hooks the
# user's code pushes, so it cannot run the blocks itself as profiling does. It watches three
# ways:
# - a pair of saved-tensor hooks around the step holds every tensor saved under no other pair
#   (a save made in backward belongs to a recomputation);
# - a dispatch mode names each storage after the op that made it and the module running then;
#   before each op of the forward pass it takes over any other pair it finds innermost (pushed
#   by checkpoint, save_on_cpu or the user), as allow_mutation_on_saved_tensors does: it pops the
#   pair and pushes it wrapped, so that each save is seen along with what the pair's pack
#   returned. A module's forward pre-hook does the same, so a region entered at a module is
#   wrapped before anything in it is saved. ``saved_tensors_hooks.__exit__`` only pops, so the
#   swap is invisible to the code that pushed the pair;
# - forward hooks on every module of the model keep the stack of modules running.
#
# What the wrapped pack returned says what becomes of the tensor:
# - a tensor sharing its storage: the pair keeps it where it is (saved), or, for save_on_cpu's
#   pairs, in host memory (offloaded; on a CPU save_on_cpu leaves tensors in place, and they
#   count as host bytes, as the planner counts them);
# - a tensor of another storage: a copy is held instead, offloaded where it is in host memory;
# - no tensor: the pair gets the tensor back another way, as checkpoint's forward pair does by
#   recomputing. Nothing is held in the forward pass; the pair's first unpack in a backward runs
#   the recomputation, after which every tensor the pair saved is held again, as recomputed
#   bytes, until its own unpack (what torch's checkpoint keeps in its frame).
# A selective policy keeps the outputs it caches outside any hooks. Which ops it cached shows in
# the recomputation, which does not run them again (`cached_ops`); their outputs are held from
# the op until the recomputation starts.
#
# Every hold and release takes the next tick of one counter (``next`` of an itertools.count is
# atomic), with no lock: a release runs from ``__del__`` on whatever thread drops the last
# reference. The holds are replayed in tick order after the step (`timeline`).

SAVED = "saved"
RECOMPUTED = "recomputed"
OFFLOADED = "offloaded"

_WRAPPER_PARTS = ("._checkpoint_wrapped_module", "._fsdp_wrapped_module", "._orig_mod")
_OFFLOADERS = ("tensorhooks._activation_offload", "save_on_cpu")
_POLICY_MODES = ("_CachingTorchDispatchMode", "SelectiveForward")
"""Dispatch modes that ask a selective checkpoint policy about each op: torch's, tensorhooks'."""


def display_name(name: str) -> str:
    """A module's qualified name without the wrappers' own attributes.

    Example:
        >>> display_name("model.layers.0.mlp._checkpoint_wrapped_module")
        'model.layers.0.mlp'
    """
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name or "(model)"


@dataclass(eq=False)
class OpRecord:
    """One op of the step, as the dispatch mode saw it."""

    index: int
    tick: int
    name: str
    call: int
    """The module call running it, -1 outside the model's forward."""
    pair: int
    """The taken-over pair in force in the forward pass, -1 for none."""
    backward: bool
    recomputing: int
    """The pair whose recomputation runs it, -1 for none."""
    outputs: list[tuple[int, int]]
    """(storage key, bytes) of each output that is not an input's storage."""


@dataclass(eq=False)
class Call:
    """One call of a module of the model."""

    index: int
    name: str
    module: nn.Module
    parent: int
    pair: int
    """The taken-over pair innermost when the call started, -1 for none."""
    backward: bool
    tick: int
    tensors: list[tuple[int, int]]
    """(storage key, bytes) of its tensor arguments."""
    cache: str | None
    """The KV cache it was handed (``"use_cache=True"``, ``"past_key_values"``), or None."""


@dataclass(frozen=True)
class Site:
    """Where a held storage comes from."""

    call: int
    """The module call that saved it, -1 outside the model."""
    maker: int
    """The op that made its storage, -1 if it was made before the step."""
    status: str
    how: str = ""


@dataclass(eq=False)
class Interval:
    """One hold of a storage: from ``start`` to ``end`` (None: held past the step)."""

    key: Hashable
    nbytes: int
    where: int
    site: Site
    start: float
    end: float | None = None


@dataclass(eq=False)
class Pair:
    """A pair of saved-tensor hooks that the step pushed, taken over and wrapped."""

    index: int
    name: str
    internal: bool
    """Pushed by torch or tensorhooks code, not the user's."""
    offloader: bool
    enclosing: int
    """The module call running when the pair was first seen innermost."""
    tick: int
    saves: int = 0
    identity: int = 0
    copies: int = 0
    holders: int = 0
    selective: bool = False
    positions: dict[tuple[int, int], int] = field(default_factory=dict)
    """(Maker op, storage key) -> bytes of what it saved without keeping (a region's saves)."""
    last_save: int = -1
    recomputed: dict[int, int] = field(default_factory=dict)
    """Graph task -> tick its recomputation started."""
    notes: list[weakref.ref[_RegionSave]] = field(default_factory=list)
    hooks: tuple[Any, ...] = ()
    """The wrapped pack and unpack, kept alive while the trace is."""

    @property
    def region(self) -> bool:
        """Whether it recomputes what it saves (a checkpoint region)."""
        return self.holders > 0


class _Hold:
    """A hold's share of the trace: dropping it ends its interval."""

    __slots__ = ("interval", "trace")

    def __init__(self, trace: Trace, interval: Interval) -> None:
        self.trace = trace
        self.interval = interval

    def __del__(self) -> None:
        self.interval.end = next(self.trace.ticks)


class _RegionSave:
    """A save a region's pair kept no tensor for; held again once the region recomputes."""

    __slots__ = ("__weakref__", "done", "hold", "key", "nbytes", "site")

    def __init__(self, key: int, nbytes: int, site: Site) -> None:
        self.key = key
        self.nbytes = nbytes
        self.site = site
        self.hold: _Hold | None = None
        self.done = False


def _innermost(function: Any) -> Any:
    """The function a guard wrapped (its ``pack_hook``), followed down to the user's own."""
    for _ in range(4):
        code = getattr(function, "__code__", None)
        cells = getattr(function, "__closure__", None) or ()
        names = getattr(code, "co_freevars", ())
        inner = dict(zip(names, cells, strict=False)).get("pack_hook")
        if inner is None:
            return function
        function = inner.cell_contents
    return function


def _pair_facts(pack: Any) -> tuple[str, bool, bool]:
    """A pair's name, whether torch or tensorhooks pushed it, whether it offloads."""
    inner = _innermost(pack)
    module = getattr(inner, "__module__", "") or ""
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    internal = module.startswith(("torch.", "tensorhooks."))
    offloader = any(part in f"{module}.{name}" for part in _OFFLOADERS)
    return f"{module}.{name}" if module else name, internal, offloader


def _tensors_inside(value: Any, found: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors pack returned: itself, or in its tuples, lists and dicts, 3 levels deep.

    Other objects are not looked into: checkpoint's holders reach the whole region state.
    """
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _tensors_inside(item, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _tensors_inside(item, found, depth + 1)
    return found


def _cache_argument(kwargs: dict[str, Any]) -> str | None:
    """The KV cache a call is handed: ``use_cache=True``, or the name of a cache argument."""
    for name in CACHE_ARGUMENTS:
        value = kwargs.get(name)
        if value is not None:
            return f"{name}={type(value).__name__}"
    return "use_cache=True" if kwargs.get("use_cache") is True else None


class Trace:
    """Everything the traced step showed (see NOTE [Tracing a step as the user runs it])."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(module): name for name, module in model.named_modules()}
        self.excluded = set(module_keys(model))
        self.fsdp = {id(module) for module in fsdp2_modules(model)}
        self.ticks = itertools.count()
        self.ops: list[OpRecord] = []
        self.calls: list[Call] = []
        self.pairs: list[Pair] = []
        self.intervals: list[Interval] = []
        self.makers: dict[int, int] = {}  # storage key -> the op that made it last
        self.end = 0
        self._wrapped: dict[int, Pair] = {}  # id of a wrapped pack -> its pair
        self._known: Any = None  # the innermost pack last looked at
        self._own: Any = None
        self._local = threading.local()

    # --- per thread: the module stack and the recomputations running ------------------------

    def stack(self) -> list[int]:
        stack: list[int] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def recomputing(self) -> list[int]:
        found: list[int] | None = getattr(self._local, "recomputing", None)
        if found is None:
            found = self._local.recomputing = []
        return found

    # --- holds --------------------------------------------------------------------------------

    def hold(self, key: Hashable, nbytes: int, where: int, site: Site) -> _Hold:
        interval = Interval(key, nbytes, where, site, next(self.ticks))
        self.intervals.append(interval)
        return _Hold(self, interval)

    def site(self, key: int, status: str, how: str = "") -> Site:
        stack = self.stack()
        return Site(stack[-1] if stack else -1, self.makers.get(key, -1), status, how)

    def held_as_is(self, tensor: torch.Tensor) -> _Hold | None:
        """A save kept by no hook (or one that keeps the tensor): held on the device."""
        key = storage_key(tensor)
        if key is None or key in self.excluded:
            return None
        status = SAVED if current_graph_task_id() == -1 else RECOMPUTED
        return self.hold(key, storage_bytes(tensor), DEVICE, self.site(key, status))

    # --- taking pairs over --------------------------------------------------------------------

    def top_pair(self) -> int:
        top = top_saved_tensors_hooks()
        pair = None if top is None else self._wrapped.get(id(top[0]))
        return -1 if pair is None else pair.index

    def adopt_top(self) -> None:
        """Take over the innermost pair if it is new (forward pass only)."""
        top = top_saved_tensors_hooks()
        if top is None or top[0] is self._known:
            return
        pack, unpack = top
        if pack is self._own or id(pack) in self._wrapped or get_disabled_hooks_message():
            self._known = pack
            return
        name, internal, offloader = _pair_facts(pack)
        stack = self.stack()
        pair = Pair(
            len(self.pairs), name, internal, offloader, stack[-1] if stack else -1, self.now()
        )
        self.pairs.append(pair)
        wrapped_pack, wrapped_unpack = self._wrap(pair, pack, unpack)
        if is_protected_pack_hook(pack):
            register_protected_pack_hook(wrapped_pack)
        pair.hooks = (wrapped_pack, wrapped_unpack, pack, unpack)
        pop_saved_tensors_hooks()
        push_saved_tensors_hooks(wrapped_pack, wrapped_unpack)
        self._wrapped[id(wrapped_pack)] = pair
        self._known = wrapped_pack

    def _wrap(
        self, pair: Pair, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]
    ) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
        trace = self

        def wrapped_pack(tensor: torch.Tensor) -> tuple[Any, Any]:
            key = storage_key(tensor)
            packed = pack(tensor)
            return packed, trace.packed(pair, tensor, key, packed)

        def wrapped_unpack(stored: tuple[Any, Any]) -> Any:
            packed, note = stored
            if type(note) is _RegionSave:
                return trace.unpack_region(pair, note, unpack, packed)
            return unpack(packed)

        return wrapped_pack, wrapped_unpack

    def packed(self, pair: Pair, tensor: torch.Tensor, key: int | None, packed: Any) -> Any:
        """What to keep beside ``packed``: a hold, a region's note, or None (a parameter)."""
        if key is None or key in self.excluded:
            return None
        pair.saves += 1
        pair.last_save = self.now()
        found = _tensors_inside(packed, [])
        nbytes = storage_bytes(tensor)
        backward = current_graph_task_id() != -1
        if any(storage_key(item) == key for item in found):
            pair.identity += 0 if pair.offloader else 1
            # save_on_cpu keeps a tensor already in host memory as it is (and a tiny one on the
            # device, where it stays): the first is offloaded, as the planner counts it.
            host = pair.offloader and tensor.device.type == "cpu"
            where = HOST if host else DEVICE
            status = OFFLOADED if host else (RECOMPUTED if backward else SAVED)
            return self.hold(key, nbytes, where, self.site(key, status, pair.name))
        if pair.offloader and not found:  # save_on_cpu's own record of a host copy
            found = [tensor.new_empty(0, device="cpu")]
        if found:
            pair.copies += 1
            copy = max(found, key=lambda item: item.numel() * item.element_size())
            host = pair.offloader or copy.device != tensor.device
            site = self.site(key, OFFLOADED if host else SAVED, pair.name)
            return self.hold(storage_key(copy), storage_bytes(copy), HOST if host else DEVICE, site)
        pair.holders += 1
        pair.positions[self.makers.get(key, -1), key] = nbytes
        note = _RegionSave(key, nbytes, self.site(key, RECOMPUTED))
        pair.notes.append(weakref.ref(note))
        return note

    def unpack_region(
        self, pair: Pair, note: _RegionSave, unpack: Callable[[Any], Any], packed: Any
    ) -> Any:
        """Unpack a region's save; the first unpack of a backward recomputes the region."""
        task = current_graph_task_id()
        if task in pair.recomputed:
            tensor = unpack(packed)
        else:
            pair.recomputed[task] = self.now()
            running = self.recomputing()
            running.append(pair.index)
            try:
                tensor = unpack(packed)
            finally:
                running.pop()
            self._hold_recomputed(pair)
        note.done = True
        note.hold = None  # released: backward has it now
        return tensor

    def _hold_recomputed(self, pair: Pair) -> None:
        """Hold every save of ``pair`` not yet unpacked: the recomputation keeps them all."""
        for ref in pair.notes:
            note = ref()
            if note is None or note.done or note.hold is not None:
                continue
            # What the region made is made again, named after the op that made it (the forward
            # pass's storage is gone, and its address may have been reused); its inputs come
            # back as they were.
            maker = note.site.maker
            made_here = maker >= 0 and self.ops[maker].pair == pair.index
            key: Hashable = ("recomputed", maker, note.key) if made_here else note.key
            note.hold = self.hold(key, note.nbytes, DEVICE, note.site)

    # --- ops and module calls -------------------------------------------------------------------

    def now(self) -> int:
        return next(self.ticks)

    def op(self, func: OpOverload, args: Any, kwargs: Any, out: Any, backward: bool) -> None:
        inputs = {storage_key(t) for t in tensors_in((args, kwargs), [])}
        outputs = []
        index = len(self.ops)
        for tensor in tensors_in(out, []):
            key = storage_key(tensor)
            if key is None or key in inputs:
                continue
            outputs.append((key, storage_bytes(tensor)))
            self.makers[key] = index
        stack, running = self.stack(), self.recomputing()
        self.ops.append(
            OpRecord(
                index=index,
                tick=self.now(),
                name=str(func.overloadpacket),
                call=stack[-1] if stack else -1,
                pair=-1 if backward else self.top_pair(),
                backward=backward,
                recomputing=running[-1] if running else -1,
                outputs=outputs,
            )
        )

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        backward = current_graph_task_id() != -1
        if not backward:
            self.adopt_top()
        if id(module) in self.fsdp:  # its gathered parameters are not activations
            self.excluded |= module_keys(module)
        pair = -1 if backward else self.top_pair()
        if pair >= 0 and type(current_dispatch_mode()).__name__ in _POLICY_MODES:
            self.pairs[pair].selective = True
        stack = self.stack()
        tensors = [
            (key, storage_bytes(t))
            for t in tensors_in((args, kwargs), [])
            if (key := storage_key(t)) is not None and key not in self.excluded
        ]
        call = Call(
            index=len(self.calls),
            name=display_name(self.names.get(id(module), "")),
            module=module,
            parent=stack[-1] if stack else -1,
            pair=pair,
            backward=backward,
            tick=self.now(),
            tensors=tensors,
            cache=_cache_argument(kwargs),
        )
        self.calls.append(call)
        stack.append(call.index)

    def leave(self, module: nn.Module) -> None:
        stack = self.stack()
        while stack:  # a forward that raised left its callees on the stack
            call = self.calls[stack.pop()]
            if call.module is module:
                return


class _TraceMode(UnwrappedDispatchMode):
    """Takes new pairs over before each op of the forward pass, and notes the op."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.trace = trace

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        backward = current_graph_task_id() != -1
        if not backward:
            self.trace.adopt_top()
        out = func(*args, **kwargs)
        self.trace.op(func, args, kwargs, out, backward)
        return out


def _unpack_kept(packed: tuple[torch.Tensor, _Hold | None]) -> torch.Tensor:
    return packed[0]


@contextlib.contextmanager
def _module_hooks(trace: Trace) -> Iterator[None]:
    handles = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        trace.enter(module, args, kwargs)

    def after(module: nn.Module, args: object, output: object) -> None:
        trace.leave(module)

    try:
        for module in trace.model.modules():
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


_SELECTIVE_UNDER_A_PAIR = r"A saved_tensors_hooks context .* selective activation checkpoint"


@contextlib.contextmanager
def _bottom_pair(trace: Trace) -> Iterator[None]:
    """Hold what is saved under no other pair; a pair already in force is taken over instead."""
    before = top_saved_tensors_hooks()
    if before is not None:
        trace.adopt_top()
        try:
            yield
        finally:
            pop_saved_tensors_hooks()
            push_saved_tensors_hooks(*before)
        return

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, _Hold | None]:
        # A detached alias of an output of the saving node: no cycle through its grad_fn.
        kept = tensor.detach() if is_output_of_saving_node(tensor) else tensor
        return kept, trace.held_as_is(tensor)

    with warnings.catch_warnings(), saved_tensors_hooks(pack, _unpack_kept):
        # torch 2.15 warns that a pair is in force around its selective checkpoint and asks the
        # caller to choose whether what it saves goes through the pair. This pair is the tracer's
        # own, not one the step put there: the step runs with torch's default, as without it.
        warnings.filterwarnings("ignore", _SELECTIVE_UNDER_A_PAIR, FutureWarning)
        top = top_saved_tensors_hooks()
        trace._own = trace._known = None if top is None else top[0]
        yield


def traced(model: nn.Module, step: Callable[[], object]) -> Trace:
    """Run ``step`` once under the tracer; return what it saw."""
    trace = Trace(model)
    with _module_hooks(trace), _bottom_pair(trace), _TraceMode(trace):
        step()
    trace.end = trace.now()
    return trace
