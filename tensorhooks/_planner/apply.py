"""Running blocks as a plan says: kept, or through `checkpoint` with a per-op policy.

An `Application` replaces each block's ``forward`` by a `_BlockForward` (an instance attribute,
removed again by `Application.remove`), which runs the block's own forward as its `Action`
says. With a `HeldBytes` it also measures what autograd holds, see
NOTE [Measuring what autograd holds] in `accounting`. A `Watcher` sees the block boundaries,
the region inputs and what a recomputation keeps (the profiler is one).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tensorhooks._activation_offload import save_on_cpu
from tensorhooks._checkpoint import (
    checkpoint,
    create_selective_checkpoint_contexts,
    is_recomputing,
)
from tensorhooks._core.errors import PlanBudgetWarning, PlanStateError
from tensorhooks._core.torch_compat import CheckpointPolicy, OpOverload

from .accounting import DEVICE, HOST, HeldBytes, Hold, delegating_hooks
from .layers import cache_arguments, hf_checkpointing_message, hf_checkpointing_on, positional_names

__all__ = [
    "OFFLOAD",
    "SAVE",
    "Action",
    "Application",
    "Warned",
    "Watcher",
    "tensors_in",
]

SAVE = "save"
OFFLOAD = "offload"

OpKey = tuple[OpOverload, int]
"""An op of a block's forward: the operator and how many times it ran before in the block."""


@dataclass(frozen=True)
class Action:
    """What one block does in a step: kept, or checkpointed with some outputs cached.

    ``cached`` maps an op of the block to `SAVE` (kept on the device) or `OFFLOAD` (kept in
    host memory); every other op is recomputed. ``offload_input`` sends the region's inputs to
    host memory too.
    """

    checkpoint: bool
    cached: Mapping[OpKey, str] = field(default_factory=dict)
    offload_input: bool = False
    selective: bool = False
    """Run a selective policy even with nothing cached (what a policy costs, measured)."""


KEEP = Action(checkpoint=False)
FULL = Action(checkpoint=True)


class Watcher:
    """What the profiler hears from an application; this base hears nothing."""

    wants_saves = False
    """Whether `kept` is to be called for every tensor a recomputation keeps."""

    def forward(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Around block ``index``'s forward (its checkpoint call included)."""
        return contextlib.nullcontext()

    def function(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Around block ``index``'s own forward inside its checkpoint call."""
        return contextlib.nullcontext()

    def recompute(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Around block ``index``'s recomputation, in backward."""
        return contextlib.nullcontext()

    def called(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Block ``index`` is called with ``args`` and ``kwargs`` (before it runs)."""

    def kept(self, index: int, tensor: torch.Tensor) -> None:
        """A tensor block ``index``'s recomputation keeps for backward, in save order."""


def tensors_in(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append to ``found`` the tensors in ``value`` (in lists, tuples and dicts too); return it."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found


class _RegionHolds:
    """The holds of one checkpoint call: its cached outputs, and what a recomputation keeps.

    Lives as long as the region's state in `checkpoint` (its function keeps it); the cached
    outputs stop counting when a recomputation consumes them, as `checkpoint` frees them then.
    """

    __slots__ = ("cached", "held", "kept", "next_kept", "next_saved")

    def __init__(self, held: HeldBytes) -> None:
        self.held = held
        self.cached: list[Hold | None] = []
        self.kept: dict[int, Hold | None] = {}
        self.next_saved = 0
        self.next_kept = 0

    def cache(self, output: Any, where: int) -> None:
        for tensor in tensors_in(output, []):
            self.cached.append(self.held.hold(tensor, where))

    def saved(self, tensor: torch.Tensor) -> int:
        """A save of the forward pass: its position, which the recomputation keeps it at."""
        position = self.next_saved
        self.next_saved = position + 1
        return position

    def start_recompute(self) -> None:
        # Recomputation consumes the cached outputs: from here on, what it keeps of them counts.
        self.cached = []
        self.kept = {}
        self.next_kept = 0

    def keep(self, tensor: torch.Tensor) -> None:
        position = self.next_kept
        self.next_kept = position + 1
        self.kept[position] = self.held.hold(tensor, DEVICE)

    def unpacked(self, position: int) -> None:
        self.kept.pop(position, None)


class Warned:
    """What a plan warned of already: each kind of `PlanBudgetWarning` is given once."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()

    def once(self, kind: str, message: str) -> None:
        """Warn ``message`` unless a warning of ``kind`` was given before."""
        if kind in self.kinds:
            return
        self.kinds.add(kind)
        warnings.warn(message, PlanBudgetWarning, stacklevel=4)


class _RootForward:
    """The model's ``forward`` while an application that watches its calls is installed.

    Like `_BlockForward` an instance attribute, not a hook: a copy or a pickle of the model is a
    plain model.
    """

    __slots__ = ("on_call", "original")

    def __init__(
        self,
        original: Callable[..., Any],
        on_call: Callable[[tuple[Any, ...], dict[str, Any]], None],
    ) -> None:
        self.original = original
        self.on_call = on_call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.on_call(args, kwargs)
        return self.original(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.original, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.original.__reduce_ex__(protocol)


class _BlockForward:
    """What a planned block's ``forward`` attribute is while the application is installed."""

    __slots__ = ("action", "application", "index", "module", "original", "positions")

    def __init__(self, application: Application, index: int, action: Action) -> None:
        self.application = application
        self.index = index
        self.module = application.blocks[index]
        self.original: Callable[..., Any] = self.module.forward
        self.action = action
        self.positions = positional_names(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        application = self.application
        watcher = application.watcher
        if self.module.__dict__.get("gradient_checkpointing") is True:
            raise PlanStateError(hf_checkpointing_message(self.application.caller))
        if application.on_call is not None:
            application.on_call(self.index, args, kwargs)
        action = self.action
        with watcher.forward(self.index):
            watcher.called(self.index, args, kwargs)
            if not action.checkpoint or not torch.is_grad_enabled():
                if watcher is _SILENT:
                    return self.original(*args, **kwargs)
                # Recorded as it would run checkpointed (a layer's cache off in training), so
                # that the ops a policy names are the ones a checkpointed block runs.
                arguments = cache_arguments(self.module, self.positions, args, kwargs)
                if arguments is not None:
                    args, kwargs = arguments
                with watcher.function(self.index):
                    return self.original(*args, **kwargs)
            arguments = cache_arguments(self.module, self.positions, args, kwargs)
            if arguments is None:  # eval mode, with a KV cache: see NOTE [Caches of ...]
                application.kept_for_cache(self.index)
                return self.original(*args, **kwargs)
            args, kwargs = arguments
            holds = None if application.held is None else _RegionHolds(application.held)
            function = self._function(holds)
            context_fn = self._contexts(action, holds)
            with self._input_offload(action):
                if context_fn is None:
                    return checkpoint(function, *args, use_reentrant=False, **kwargs)
                return checkpoint(
                    function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
                )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A copy of a planned model (an EMA copy, taken inside ``with plan:``) is a plain model:
        # its block gets its own forward, not this plan's.
        return copy.deepcopy(self.original, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # ``torch.save(model)`` while planned saves the block's own forward (a bound method
        # pickles by name), not the plan, which holds locks and streams.
        return self.original.__reduce_ex__(protocol)

    def _function(self, holds: _RegionHolds | None) -> Callable[..., Any]:
        """The region's function: the block's forward, with the measuring hooks if any."""
        watcher = self.application.watcher
        if holds is None and watcher is _SILENT:
            return self.original
        original, index, module = self.original, self.index, self.module
        noting = holds is not None or watcher.wants_saves

        def forward(*args: Any, **kwargs: Any) -> Any:
            if holds is not None:
                holds.held.for_block(module)
            if is_recomputing():
                if holds is not None:
                    holds.start_recompute()
                with watcher.recompute(index):
                    if not noting:
                        return original(*args, **kwargs)
                    with delegating_hooks(_keeper(holds, watcher, index)):
                        return original(*args, **kwargs)
            with watcher.function(index):
                if holds is None:
                    return original(*args, **kwargs)
                with delegating_hooks(holds.saved, holds.unpacked):
                    return original(*args, **kwargs)

        return forward

    def _contexts(
        self, action: Action, holds: _RegionHolds | None
    ) -> Callable[[], tuple[Any, Any]] | None:
        """The ``context_fn`` of a selective policy, or None when every op is recomputed."""
        cached = action.cached
        if not cached and not action.selective:
            return None
        offload = self.application.policy_offload

        def context_fn() -> tuple[Any, Any]:
            counts: dict[OpOverload, int] = {}

            def policy(ctx: Any, op: OpOverload, *args: Any, **kwargs: Any) -> Any:
                index = counts.get(op, 0)
                counts[op] = index + 1
                what = cached.get((op, index))
                if what is None:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                if holds is not None:
                    holds.cache(
                        getattr(ctx, "op_output", None), HOST if what == OFFLOAD else DEVICE
                    )
                if what == OFFLOAD:
                    return CheckpointPolicy.MUST_CPU_OFFLOAD
                return CheckpointPolicy.MUST_SAVE

            return create_selective_checkpoint_contexts(policy, offload=offload)

        return context_fn

    @contextlib.contextmanager
    def _input_offload(self, action: Action) -> Iterator[None]:
        """Around the checkpoint call: the region's inputs go to host memory if the plan says."""
        application = self.application
        if not action.offload_input:
            yield
            return
        with application.input_offload:
            held = application.held
            if held is None:
                yield
                return
            threshold = application.min_offload_bytes

            def hold(tensor: torch.Tensor) -> Hold | None:
                size = tensor.numel() * tensor.element_size()
                return held.hold(tensor, HOST if size >= threshold else DEVICE)

            with delegating_hooks(hold):
                yield


def _keeper(
    holds: _RegionHolds | None, watcher: Watcher, index: int
) -> Callable[[torch.Tensor], None]:
    def keep(tensor: torch.Tensor) -> None:
        if holds is not None:
            holds.keep(tensor)
        if watcher.wants_saves:
            watcher.kept(index, tensor)

    return keep


_SILENT = Watcher()


class Application:
    """Blocks running as their actions say, from `install` until `remove`.

    Args:
        blocks: the block modules, in the order of ``actions``.
        actions: what each block does.
        held: where to count the bytes autograd holds, or None not to measure.
        watcher: who hears the block boundaries and saves (the profiler), or None.
        min_offload_bytes: region inputs smaller than this stay on the device when a block
            offloads its input.
        caller: the function named in errors.
        warnings: what was warned of already (a plan's, so that it warns once across its
            applications); default: a new one.
        on_call: called with each block's index and arguments before the block runs, on a
            forward call (a plan changes its actions there when the step's sizes change).
        root: a module whose calls ``on_root_call`` hears (the model), or None.
        on_root_call: called with the arguments of each call of ``root``, before it runs.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        actions: Sequence[Action],
        *,
        held: HeldBytes | None = None,
        watcher: Watcher | None = None,
        min_offload_bytes: int = 1 << 20,
        caller: str = "plan_activations",
        warnings: Warned | None = None,
        on_call: Callable[[int, tuple[Any, ...], dict[str, Any]], None] | None = None,
        root: nn.Module | None = None,
        on_root_call: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.caller = caller
        self.warned = Warned() if warnings is None else warnings
        self.on_call = on_call
        self.root = root
        self.on_root_call = on_root_call
        self._forwards: list[_BlockForward] = []
        self.actions = list(actions)
        self.held = held
        self.watcher = _SILENT if watcher is None else watcher
        self.min_offload_bytes = min_offload_bytes
        # Outputs a policy offloads: every size (the plan chose them); region inputs: the rule
        # of save_on_cpu, tiny ones stay.
        self.policy_offload = save_on_cpu(pin_memory=True, min_offload_bytes=0)
        self.input_offload = save_on_cpu(pin_memory=True, min_offload_bytes=min_offload_bytes)
        self._previous: list[tuple[nn.Module, Any]] = []

    def kept_for_cache(self, index: int) -> None:
        """Block ``index`` runs as it is, its plan aside, to keep a KV cache: warn once."""
        name = type(self.blocks[index]).__name__
        self.warned.once(
            "cache",
            f"{self.caller}: block {index} ({name}) runs in eval mode with a KV cache it writes; "
            "as under Hugging Face's gradient checkpointing it keeps the cache and is not "
            "recomputed, so it holds all its activations and the step may exceed the plan's "
            "budget. Call the model with use_cache=False (or in train mode) for the plan to "
            "hold",
        )

    def install(self) -> None:
        """Replace each block's ``forward``.

        Raises:
            PlanStateError: if a block is already planned (by this application or another), or
                Hugging Face's gradient checkpointing is on in a block.
        """
        if hf_checkpointing_on(self.blocks):
            raise PlanStateError(hf_checkpointing_message(self.caller))
        for index, block in enumerate(self.blocks):
            if isinstance(block.__dict__.get("forward"), _BlockForward):
                raise PlanStateError(
                    f"plan_activations: block {index} ({type(block).__name__}) already runs "
                    "under a plan; remove that plan (exit its context or call its handle's "
                    "remove()) before applying another"
                )
        for index, (block, action) in enumerate(zip(self.blocks, self.actions, strict=True)):
            self._previous.append((block, block.__dict__.get("forward", _UNSET)))
            forward = _BlockForward(self, index, action)
            self._forwards.append(forward)
            block.forward = forward
        root = self.root
        if root is not None and self.on_root_call is not None:
            self._previous.append((root, root.__dict__.get("forward", _UNSET)))
            root.forward = _RootForward(root.forward, self.on_root_call)

    def set_actions(self, actions: Sequence[Action]) -> None:
        """What each block does from its next call on (the installed blocks included)."""
        self.actions = list(actions)
        for forward, action in zip(self._forwards, self.actions, strict=False):
            forward.action = action

    def remove(self) -> None:
        """Give each block its own ``forward`` back."""
        previous, self._previous = self._previous, []
        self._forwards = []
        for block, before in previous:
            if block is self.root and not isinstance(block.__dict__.get("forward"), _RootForward):
                continue  # its forward was wrapped again since (a trainer's): left as it is
            if before is _UNSET:
                block.__dict__.pop("forward", None)
            else:
                block.forward = before


_UNSET = object()
