"""checkpoint: run a function without keeping its activations, recompute them in backward.

How a region saves and recomputes: NOTE [Checkpointing on saved-tensor hooks] in recomputation.py.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Generator
from typing import Any, TypeVar, overload

import torch
from torch.utils import checkpoint as torch_checkpoint

from tensorhooks._core.errors import CheckpointArgumentTypeError, CheckpointArgumentValueError
from tensorhooks._core.guards import current_save_guard, register_protected_pack_hook
from tensorhooks._core.torch_compat import (
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    top_saved_tensors_hooks,
    torch_checkpoint_debug_override,
    torch_checkpoint_debug_tools,
    torch_checkpoint_early_stop_override,
    torch_checkpoint_takes,
)

from .arguments import Arguments, save_inputs
from .policies import SelectiveForward, adopt_contexts
from .reads import watch_optimizer_steps
from .recomputation import DETERMINISM_CHECKS, Frame, raise_changed_input, unpack_holder
from .replay import RegionState, device_initialized

__all__ = ["checkpoint", "end_region", "noop_context_fn", "region_steps"]

_R = TypeVar("_R")

_REENTRANT_REFUSED = (
    "tensorhooks.checkpoint: use_reentrant=True is not supported. This checkpoint is built on "
    "saved-tensor hooks (torch's use_reentrant=False semantics): backward recomputes the region "
    "inside the outer backward call instead of running a nested one, so it works with "
    "torch.autograd.grad(), backward(inputs=...), keyword arguments, nesting and every "
    "tensorhooks context. Pass use_reentrant=False, or call "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) for the reentrant variant."
)
# torch's checkpoint warns so too (a UserWarning), and runs its reentrant variant then.
REENTRANT_UNSET = (
    "tensorhooks.checkpoint: the use_reentrant parameter should be passed explicitly, as "
    "torch.utils.checkpoint asks. tensorhooks runs the non-reentrant variant either way, where "
    "torch runs the reentrant one when use_reentrant is left out; pass use_reentrant=False."
)


# torch's words, and its type (a RuntimeError), for a forward context that swallowed an exception.
_SUPPRESSED = (
    "tensorhooks.checkpoint: the forward context provided by context_fn suppressed an exception "
    "raised during the checkpointed forward. This is not supported because checkpoint cannot "
    "return a value for a failed forward: let the exception through the context."
)


def _identity(value: Any) -> Any:
    return value


def noop_context_fn() -> tuple[contextlib.AbstractContextManager[None], ...]:
    """The default ``context_fn``: no context around the forward pass or the recomputation."""
    return contextlib.nullcontext(), contextlib.nullcontext()


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
) -> Callable[[Callable[..., _R]], Callable[..., _R]]: ...


@overload
def checkpoint(
    function: Callable[..., _R],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> _R: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, ...]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them later.

    A drop-in for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the tensors
    the function saves for backward are not kept; the first backward call that needs one runs
    the function again (same RNG, autocast and default device) and stops as soon as every needed
    tensor is back. Works with ``torch.autograd.grad``, ``backward(inputs=...)``,
    ``retain_graph=True``, double backward, nesting, keyword and non-tensor arguments, and every
    tensorhooks context; state lives in the graph-task store, so nothing outlives a backward
    call, successful or not. With ``function=None`` it returns a decorator (torch 2.14's
    curried form): the decorated function takes its own arguments, keywords included, and
    ``use_reentrant`` left out warns at each of its calls, as in torch.

    Example:
        >>> import torch, tensorhooks
        >>> w = torch.ones(3, 3, requires_grad=True)
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> y = tensorhooks.checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=False)
        >>> (gx,) = torch.autograd.grad(y.sum(), [x])
        >>> gx.shape
        torch.Size([2, 3])
        >>> @tensorhooks.checkpoint(use_reentrant=False, early_stop=False)
        ... def block(a, *, scale=1.0):
        ...     return (a * scale).exp()
        >>> block(x, scale=2.0).sum().backward()

    Args:
        function: what to run; ``None`` to get a decorator taking the same options.
        *args: its positional arguments. Tensors among them, also inside list, tuple and dict
            arguments, are saved as a node saves its inputs.
        use_reentrant: ``False``; ``None`` warns as torch does (a ``UserWarning``; torch then
            runs its reentrant variant, tensorhooks this one); ``True`` is refused (see Raises).
        preserve_rng_state: replay the CPU and device RNG state in recomputation.
        context_fn: returns ``(forward_context, recompute_context)``, e.g.
            `create_selective_checkpoint_contexts` (tensorhooks' or torch's).
        determinism_check: ``"default"`` (compare shape, dtype and device) or ``"none"``.
        debug: on a `CheckpointError`, add torch's trace of the ops of both runs.
        early_stop: stop recomputing once every saved tensor is back (torch's
            ``set_checkpoint_early_stop`` overrides it).
        respect_saved_tensors_hooks: with a selective policy, whether the outputs it saves
            (``*_SAVE``) go through the saved-tensor hooks in force around the call (an outer
            `save_on_cpu` then offloads them too), as torch 2.14's keyword of that name.
            ``None`` (the default) and ``False``: they stay where they are, silently (torch
            2.14 warns when hooks are in force). No effect without a selective policy.
        **kwargs: keyword arguments of ``function``; tensors among them are saved as in
            ``args``.

    Returns:
        What ``function`` returns (or the decorator, with ``function=None``).

    Raises:
        CheckpointArgumentValueError: if ``use_reentrant=True``, ``determinism_check`` is not a
            known value, or ``debug=True`` comes with a ``context_fn`` (a ``ValueError``).
        CheckpointArgumentTypeError: if ``respect_saved_tensors_hooks`` is not None or a bool
            (a ``TypeError``).
        CheckpointError: in backward, if recomputation saved a different number of tensors or
            tensors of another shape, dtype or device (a ``RuntimeError``).
        RuntimeError: in backward, autograd's in-place error if a tensor argument was changed
            in place, inside the function or after the call (outside
            ``allow_mutation_on_saved_tensors``).
        SavedTensorModifiedError: in backward, if a tensor the function reads from elsewhere (a
            closure, a module attribute, a dict, a global) was changed in place, had its data
            swapped, or was replaced by another tensor before recomputation read it again (a
            ``RuntimeError``).

    Nesting and threads: regions nest (the innermost manages its tensors, its inputs are saved
    by the enclosing one). Backward calls may run on several threads at once over the same or
    different graphs; each graph task recomputes on its own.
    """
    if use_reentrant:
        raise CheckpointArgumentValueError(_REENTRANT_REFUSED)
    if function is None:
        if args or kwargs:
            raise CheckpointArgumentValueError(
                "tensorhooks.checkpoint: arguments were given without a function "
                f"({len(args)} positional, keywords {sorted(kwargs)}); pass the function "
                "first, or use @checkpoint(...) as a decorator and pass them to its result"
            )
        options = {
            "preserve_rng_state": preserve_rng_state,
            "context_fn": context_fn,
            "determinism_check": determinism_check,
            "debug": debug,
            "early_stop": early_stop,
            "respect_saved_tensors_hooks": respect_saved_tensors_hooks,
        }

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def checkpointed(*a: Any, **k: Any) -> Any:
                if use_reentrant is None and not torch.compiler.is_compiling():
                    warnings.warn(REENTRANT_UNSET, UserWarning, stacklevel=2)
                return _checkpoint_with(fn, a, k, options)

            return checkpointed

        return decorate
    if use_reentrant is None and not torch.compiler.is_compiling():  # a graph break there
        warnings.warn(REENTRANT_UNSET, UserWarning, stacklevel=2)
    return _checkpoint_with(
        function,
        args,
        kwargs,
        {
            "preserve_rng_state": preserve_rng_state,
            "context_fn": context_fn,
            "determinism_check": determinism_check,
            "debug": debug,
            "early_stop": early_stop,
            "respect_saved_tensors_hooks": respect_saved_tensors_hooks,
        },
    )


# NOTE [Checkpointing under torch.compile]
#
# Traced by Dynamo, this checkpoint would break the graph around its hooks and RNG reads and have
# the region's frame compiled: the forward pass would then save AOTAutograd's tensors while the
# recomputation in backward runs the region eagerly and saves others, and early stop hides the
# mismatch (a wrong gradient, nothing raised). torch's non-reentrant checkpoint is traced as one
# higher-order op instead, and AOTAutograd recomputes inside the compiled graph. So while Dynamo
# traces, the call goes to torch's checkpoint with the same options; a tensorhooks selective
# context becomes torch's with the same policy (torch's enum, so its offload policies too).
# Eager calls, and compiled functions called inside a checkpoint, are unaffected.


def _torch_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """Run torch's non-reentrant checkpoint with ``options`` (see the NOTE above)."""
    context_fn: Callable[[], tuple[Any, ...]] = options["context_fn"]
    # Dynamo takes a context_fn only as a plain or partial function; the default goes unsaid.
    contexts: dict[str, Any] = (
        {}
        if context_fn is noop_context_fn
        else {"context_fn": functools.partial(_torch_contexts, context_fn)}
    )
    respect = options["respect_saved_tensors_hooks"]
    if respect is not None and torch_checkpoint_takes("respect_saved_tensors_hooks"):
        contexts["respect_saved_tensors_hooks"] = respect
    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=options["preserve_rng_state"],
        determinism_check=options["determinism_check"],
        debug=options["debug"],
        early_stop=options["early_stop"],
        **contexts,
        **kwargs,
    )


def _torch_contexts(context_fn: Callable[[], tuple[Any, ...]]) -> tuple[Any, ...]:
    """``context_fn()``, with a tensorhooks selective context made torch's (same policy)."""
    forward, recompute = context_fn()
    if isinstance(forward, SelectiveForward):
        plan = forward.plan
        make = torch_checkpoint.create_selective_checkpoint_contexts
        contexts: tuple[Any, ...] = make(  # type: ignore[no-untyped-call]  # untyped in torch
            plan.policy_fn, plan.allow_cache_entry_mutation
        )
        return contexts
    return forward, recompute


def _checkpoint_with(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    if torch.compiler.is_compiling():  # See NOTE [Checkpointing under torch.compile]
        return _torch_checkpoint(function, args, kwargs, options)
    steps = region_steps(function, args, kwargs, options)
    if steps is None:
        return function(*args, **kwargs)
    next(steps)
    try:
        output = function(*args, **kwargs)
    except BaseException as error:
        steps.throw(error)  # the forward context sees it, the hooks are popped
        raise
    return end_region(steps, output)


def end_region(steps: Generator[None, Any, Any], output: Any) -> Any:
    """End a region `region_steps` started, ``output`` being what its function returned."""
    try:
        steps.send(output)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("a region's steps end once the output is sent")  # pragma: no cover


def region_steps(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Generator[None, Any, Any] | None:
    """A region's checks, then its steps: started, it runs until the function is to run.

    Send the function's output to end it (`end_region`), throw the function's error into it,
    or close it. None where grad is disabled: the function just runs. For a caller that does not
    call the function itself (`checkpoint_module`'s hooks around a module's forward).
    """
    preserve_rng_state: bool = options["preserve_rng_state"]
    context_fn: Callable[[], tuple[Any, ...]] = options["context_fn"]
    determinism_check: str = options["determinism_check"]
    debug: bool = options["debug"]
    early_stop: bool = options["early_stop"]
    respect = options["respect_saved_tensors_hooks"]
    if respect is not None and not isinstance(respect, bool):
        raise CheckpointArgumentTypeError(
            "tensorhooks.checkpoint: respect_saved_tensors_hooks must be None, True or False, "
            f"got {respect!r} of type {type(respect).__name__}"
        )
    metadata_fn = DETERMINISM_CHECKS.get(determinism_check)
    if metadata_fn is None:
        raise CheckpointArgumentValueError(
            f"tensorhooks.checkpoint: determinism_check must be one of "
            f"{sorted(DETERMINISM_CHECKS)}, got {determinism_check!r}"
        )
    debug_override = torch_checkpoint_debug_override()
    error_cb = None
    if debug if debug_override is None else debug_override:
        if context_fn is not noop_context_fn:
            raise CheckpointArgumentValueError(
                "tensorhooks.checkpoint: debug=True records the ops through its own "
                "context_fn and cannot be combined with another one; drop one of them"
            )
        tools = torch_checkpoint_debug_tools()
        if tools is not None:
            context_fn, error_cb = tools
    if not torch.is_grad_enabled():
        return None
    watch_optimizer_steps()
    return _run_region(
        function,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        metadata_fn=metadata_fn,
        early_stop=early_stop,
        error_cb=error_cb,
        respect_hooks=bool(respect),
    )


def _run_region(  # See region_steps
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, ...]],
    metadata_fn: Callable[[torch.Tensor], Any],
    early_stop: bool,
    error_cb: Callable[[Exception], Any] | None,
    respect_hooks: bool,
) -> Generator[None, Any, Any]:
    forward_context, recompute_context = adopt_contexts(*context_fn())
    tensors: list[torch.Tensor] = []
    arguments = Arguments(args, kwargs, tensors)
    region = RegionState(tensors, preserve_rng_state)
    had_device = device_initialized(region.device_type)
    override = torch_checkpoint_early_stop_override()
    frame = Frame(
        function,
        region,
        recompute_context=recompute_context,
        early_stop=early_stop if override is None else override,
        metadata_fn=metadata_fn,
        error_cb=error_cb,
    )
    # The arguments keep what is not a tensor; tensors come back through the saved form.
    unhooked = top_saved_tensors_hooks() is None
    frame.inputs = save_inputs(tensors)
    frame.arguments = arguments
    versions = [tensor._version for tensor in tensors]
    offload: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if isinstance(forward_context, SelectiveForward):
        offload = forward_context.offload_context()
        if respect_hooks:
            forward_context.save_through(top_saved_tensors_hooks())
    guard = current_save_guard()
    pack, unpack = guard.wrap(frame.pack, unpack_holder)
    register_protected_pack_hook(pack)
    # Inside allow_mutation_on_saved_tensors, what the region reads is kept by the context.
    pair = guard.wrap(_identity, _identity) if guard.lets_saved_tensors_change else None
    returned = False
    with offload:
        push_saved_tensors_hooks(pack, unpack)
        try:
            frame.begin(function, tensors, pair)
            with forward_context:
                output = yield
                returned = True
        finally:
            pop_saved_tensors_hooks()
    if not returned:  # the forward context swallowed the function's exception
        raise RuntimeError(_SUPPRESSED)
    frame.seal(output, tensors)
    changed = [
        (tensor, version)
        for tensor, version in zip(tensors, versions, strict=True)
        if tensor._version != version
    ]
    frame.clone_inputs = bool(changed)
    if changed and frame.graph is not None:
        frame.graph.inputs_written(changed)
    if changed and unhooked:  # See NOTE [Checkpointing on saved-tensor hooks], "A cycle"
        frame.inputs = raise_changed_input(*changed[0])
    if preserve_rng_state and not had_device and device_initialized(region.device_type):
        raise RuntimeError(
            "tensorhooks.checkpoint: the device was initialised inside the checkpointed "
            "function, so its RNG state could not be recorded before it ran; initialise the "
            "device before the call, or pass preserve_rng_state=False"
        )
    return output
