"""checkpoint_module: a module's forward checkpointed from its hooks, as torch's composable API.

See NOTE [A region between a module's hooks].
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch import nn

from tensorhooks._core.errors import CheckpointArgumentTypeError, CheckpointArgumentValueError

from .policies import adopt_contexts
from .region import end_region, noop_context_fn, region_steps

__all__ = ["checkpoint_module"]

# NOTE [A region between a module's hooks]
#
# torch.distributed._composable.checkpoint(module) checkpoints a module without wrapping it: a
# forward pre-hook starts a non-reentrant region, a forward hook ends it, and recomputation calls
# the module again, ``module(*args, **kwargs)`` with the arguments the pre-hook saw, so every hook
# of the module runs again (FSDP2's unshard and reshard among them) while the checkpoint's own two
# hooks stand aside. `checkpoint_module` keeps that shape on tensorhooks' region: the pre-hook
# starts `region_steps`, the forward hook sends the forward's output to end it (or closes it when
# the forward raised), and the recomputation context turns this module's two hooks off.
#
# What the region holds. torch appends its pre-hook and prepends its forward hook, so the hooks
# registered before it run outside the region in the forward pass, yet inside recomputation: a
# pre-hook that changes the arguments (``x * 2``) is applied twice, and one that saves tensors
# shifts every saved tensor by its own; both give a silently wrong gradient. Here the pre-hook is
# prepended and the forward hook appended, so the region holds the whole call as it stood when
# `checkpoint_module` was applied, which is what recomputation runs again. A pre-hook that runs
# before this one all the same (registered later with ``prepend=True``, or a global one) and
# changes the arguments is caught in recomputation: it would change them a second time, so
# backward raises `CheckpointError` naming the fix instead. FSDP2's pre-forward hook returns the
# arguments as they are when it runs again, so ``fully_shard`` after `checkpoint_module` works.
#
# One region is open per module and thread at a time, as in torch; a module cannot call itself.

_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


class _State:
    """One checkpointed module's options, its open region and recomputation's call per thread."""

    __slots__ = ("__weakref__", "open", "options")

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        # Per thread: .region, the forward's open region; .off, True while recomputation runs
        # the module again on this thread; .called, the arguments recomputation passed.
        self.open = threading.local()

    @property
    def enabled(self) -> bool:
        return not getattr(self.open, "off", False)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.open.off = not value


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _call_again(state: _State, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Recomputation's call of the module, noting the arguments its pre-hook must see.

    With their versions: a pre-hook running before this module's own may write them in place
    (``a[0].mul_(2)``) as well as replace them.
    """
    state.open.called = (args, kwargs, [t._version for t in _tensors((args, kwargs))])
    try:
        return module(*args, **kwargs)
    finally:
        state.open.called = None


_CHANGED_AGAIN = (
    "tensorhooks.checkpointing.checkpoint_module: a forward pre-hook of {name} that runs before "
    "checkpoint_module's (a global one, or one registered after it with prepend=True) changed "
    "the arguments in recomputation (replaced them, or wrote them in place), as it did in the "
    "forward pass, so the region would be run again on arguments changed twice and give a "
    "wrong gradient. Register that hook before "
    "calling checkpoint_module (it then runs inside the region), or make it return the "
    "arguments unchanged when they are already what it returns."
)


_applied: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()


class _HooksOff:
    """Recomputation's context: this module's checkpoint hooks off, the user's context inside."""

    __slots__ = ("_inner", "_previous", "_state")

    def __init__(self, state: _State, inner: Any) -> None:
        self._state = state
        self._inner = inner
        self._previous = True

    def __enter__(self) -> None:
        self._previous = self._state.enabled
        self._state.enabled = False
        try:
            self._inner.__enter__()
        except BaseException:
            self._state.enabled = self._previous
            raise

    def __exit__(self, *exc: object) -> bool:
        try:
            return bool(self._inner.__exit__(*exc))
        finally:
            self._state.enabled = self._previous


def _contexts(state: _State, user_context_fn: Callable[[], tuple[Any, Any]] | None) -> Any:
    def context_fn() -> tuple[Any, Any]:
        forward, recompute = adopt_contexts(*(user_context_fn or noop_context_fn)())
        return forward, _HooksOff(state, recompute)

    return context_fn


def checkpoint_module(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Checkpoint ``module``'s forward from its hooks, without wrapping it; return ``module``.

    The counterpart of ``torch.distributed._composable.checkpoint(module)`` (FSDP2 code applies
    it per layer), on tensorhooks' checkpoint: the module's structure, names and state dict stay
    as they are; each call's activations are dropped and recomputed in backward by calling the
    module again, so its forward pre-hooks and forward hooks run again during recomputation, as
    in torch. ``torch.autograd.grad`` works, and a tensor changed in place before backward raises
    instead of being read changed. See NOTE [A region between a module's hooks].

    Example:
        >>> import torch
        >>> from tensorhooks.checkpointing import checkpoint_module
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> _ = checkpoint_module(model[0])   # only the first layer
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> (gx,) = torch.autograd.grad(model(x).sum(), [x])
        >>> gx.shape
        torch.Size([2, 4])

    Args:
        module: the module to checkpoint, once.
        **kwargs: torch's: ``use_reentrant`` (``False`` only), ``preserve_rng_state``,
            ``context_fn`` (e.g. a selective policy; its recomputation context is entered
            inside this module's own), ``determinism_check``, ``debug``, ``early_stop``, with
            `tensorhooks.checkpoint`'s meaning.

    Returns:
        ``module`` itself, its hooks registered.

    Raises:
        CheckpointArgumentValueError: if ``use_reentrant=True``, another keyword is given,
            or ``module`` was checkpointed already (a ``ValueError``).
        CheckpointArgumentTypeError: if ``module`` is not an ``nn.Module`` (a ``TypeError``).
        CheckpointError: in forward under ``torch.compile`` (use `tensorhooks.checkpoint`
            inside the compiled function, or torch's composable checkpoint there).

    Nesting and threads: checkpointed modules nest (an inner one's region opens inside the
    outer's, and again inside its recomputation). Threads may run the module at once, each with
    its own region; one thread may not call the module from inside its own forward.
    """
    if not isinstance(module, nn.Module):
        raise CheckpointArgumentTypeError(
            "tensorhooks.checkpointing.checkpoint_module: module must be a torch.nn.Module, got "
            f"{type(module).__name__}"
        )
    if kwargs.pop("use_reentrant", False):
        raise CheckpointArgumentValueError(
            "tensorhooks.checkpointing.checkpoint_module: use_reentrant=True is not supported "
            "(nor by torch's composable checkpoint); leave it out, or wrap the forward in "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True)"
        )
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise CheckpointArgumentValueError(
            f"tensorhooks.checkpointing.checkpoint_module: unexpected keyword arguments {unknown}; "
            f"it takes {list(_OPTIONS)} and use_reentrant=False"
        )
    if module in _applied:
        raise CheckpointArgumentValueError(
            f"tensorhooks.checkpointing.checkpoint_module: {type(module).__name__} is "
            "checkpointed already; apply it once per module"
        )
    state = _State({})
    state.options = {
        "preserve_rng_state": kwargs.get("preserve_rng_state", True),
        "context_fn": _contexts(state, kwargs.get("context_fn")),
        "determinism_check": kwargs.get("determinism_check", "default"),
        "debug": kwargs.get("debug", False),
        "early_stop": kwargs.get("early_stop", True),
        "respect_saved_tensors_hooks": None,
    }
    _applied[module] = state
    module.register_forward_pre_hook(_pre_hook(state), prepend=True, with_kwargs=True)
    module.register_forward_hook(_forward_hook(state), always_call=True)
    return module


def _pre_hook(state: _State) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not state.enabled:
            _check_called_with(state, module, args, kwargs)
            return
        if torch.compiler.is_compiling():
            raise torch.utils.checkpoint.CheckpointError(
                "tensorhooks.checkpointing.checkpoint_module does not run under torch.compile; "
                "call tensorhooks.checkpoint inside the compiled function, or use torch's "
                "composable checkpoint there"
            )
        function = functools.partial(_call_again, state, module)
        steps = region_steps(function, args, kwargs, state.options)
        if steps is not None:
            next(steps)
        # The error being handled now, if any: the forward hook tells a new one by it.
        state.open.region = (steps, sys.exc_info()[1])

    return pre_hook


def _check_called_with(
    state: _State, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """In recomputation: the arguments reach this pre-hook as recomputation passed them."""
    called = getattr(state.open, "called", None)
    if called is None:
        return
    passed = list(_tensors(called[:2]))
    seen = list(_tensors((args, kwargs)))
    if (
        len(passed) != len(seen)
        or any(a is not b for a, b in zip(passed, seen, strict=True))
        or [t._version for t in seen] != called[2]
    ):
        raise torch.utils.checkpoint.CheckpointError(
            _CHANGED_AGAIN.format(name=type(module).__name__)
        )


def _forward_hook(state: _State) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    def forward_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        opened: tuple[Generator[None, Any, Any] | None, BaseException | None] | None
        if not state.enabled:  # recomputation's call: no region of its own
            return
        opened = getattr(state.open, "region", None)
        state.open.region = None
        if opened is None:  # a pre-hook before this one raised
            return
        steps, handled = opened
        if steps is None:
            return
        error = sys.exc_info()[1]
        if error is not None and error is not handled:  # the forward raised: pop the hooks
            steps.close()
            return
        end_region(steps, output)

    return forward_hook
