"""The cases of the primitives: saved_tensors_hooks, disable_saved_tensors_hooks, multi-grad hooks.

Their peer is ``torch.autograd.graph``: an identity pack hook and an in-place change of the saved
tensor; an error message that is not a string; a backward that fails part-way, and threads that
run backward at once, under ``register_multi_grad_hook``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.autograd import graph as torch_graph

import tensorhooks
from tensorhooks.cli._console import format_bytes
from tensorhooks.cli._harness import Spread
from tensorhooks.cli._models import backward

from .case import Case, Demo, Outcome, Result, gradient_or_error, what_went_wrong

__all__ = [
    "DISABLE_SAVED_TENSORS_HOOKS",
    "MULTI_GRAD_HOOK_FAILED_BACKWARD",
    "MULTI_GRAD_HOOK_THREADS",
    "SAVED_TENSORS_HOOKS",
]

PEER = "torch.autograd.graph"

# ---------------------------------------------------------------------------------------------
# saved_tensors_hooks


def _identity_pack_then_write(hooks: Callable[..., Any]) -> torch.Tensor:
    """An identity pack hook, then an in-place change of the saved tensor; returns the grad."""
    a = torch.ones(3, requires_grad=True)
    with hooks(lambda t: t, lambda t: t):
        b = a * 1
        y = (b * b).sum()  # saves b
    b.mul_(10)
    backward(y)
    assert a.grad is not None
    return a.grad


def _saved_tensors_hooks(demo: Demo) -> Result:
    """An identity pack hook, then the saved tensor changed in place before backward."""
    expected = torch.full((3,), 2.0)

    def identity() -> contextlib.AbstractContextManager[Any]:
        return tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)

    def torch_identity() -> contextlib.AbstractContextManager[Any]:
        return torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    return Result(
        gradient_or_error(
            partial(_identity_pack_then_write, torch_graph.saved_tensors_hooks), expected
        ),
        gradient_or_error(
            partial(_identity_pack_then_write, tensorhooks.saved_tensors_hooks), expected
        ),
        demo.ratio(demo.step(torch_identity), demo.step(identity)),
        "tensorhooks / torch, identity hooks",
    )


SAVED_TENSORS_HOOKS = Case(
    "saved_tensors_hooks",
    PEER,
    "pack returns the tensor itself (lambda t: t); the saved tensor is then changed in place "
    "before backward",
    _saved_tensors_hooks,
)

# ---------------------------------------------------------------------------------------------
# disable_saved_tensors_hooks


def _enter_with_bad_message(
    disable: Callable[[Any], contextlib.AbstractContextManager[Any]],
) -> Outcome:
    try:
        with disable(123):
            pass
    except TypeError as error:
        named = "got 123" in str(error)
        detail = what_went_wrong(error)
        return Outcome("names the argument" if named else "pybind error", detail, good=named)
    return Outcome("accepted", "a message that is not a string was accepted", good=False)


def _disable_saved_tensors_hooks(demo: Demo) -> Result:
    """A message that is not a string."""
    message = "no saved-tensor hooks here"
    return Result(
        _enter_with_bad_message(torch_graph.disable_saved_tensors_hooks),
        _enter_with_bad_message(tensorhooks.disable_saved_tensors_hooks),
        demo.ratio(
            demo.step(partial(torch_graph.disable_saved_tensors_hooks, message)),
            demo.step(partial(tensorhooks.disable_saved_tensors_hooks, message)),
        ),
        "tensorhooks / torch, a step inside the region",
    )


DISABLE_SAVED_TENSORS_HOOKS = Case(
    "disable_saved_tensors_hooks",
    PEER,
    "called with an error message that is not a string (123)",
    _disable_saved_tensors_hooks,
)

# ---------------------------------------------------------------------------------------------
# register_multi_grad_hook


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed part-way")


def _kept_after_failed_backward(register: Callable[..., Any]) -> Outcome:
    x = torch.ones(1 << 16, requires_grad=True)
    failing = _FailsInBackward.apply(x)  # type: ignore[no-untyped-call]  # untyped in torch
    a = x * 2  # a's gradient is computed (and buffered) before the failing node raises
    seen: list[weakref.ref[torch.Tensor]] = []
    a.register_hook(lambda grad: seen.append(weakref.ref(grad)))  # type: ignore[no-untyped-call]
    handle = register([a, x], lambda grads: None)
    with contextlib.suppress(RuntimeError):
        backward(a.sum() + failing.sum())
    gc.collect()
    alive = seen[0]() is not None
    handle.remove()
    if alive:
        size = format_bytes(x.nbytes)
        return Outcome(f"keeps {size}", f"a buffered {size} gradient, until remove()", good=False)
    return Outcome("keeps nothing", "the buffer is released when backward fails", good=True)


def _calls_under_threads(
    register: Callable[..., Any], threads: int = 4, each: int = 200
) -> Outcome:
    w1 = torch.ones(8, requires_grad=True)
    w2 = torch.ones(8, requires_grad=True)
    lock = threading.Lock()
    calls: list[bool] = []

    def fn(grads: Any) -> None:
        with lock:
            calls.append(all(grad is not None for grad in grads))

    handle = register([w1, w2], fn)

    def work(index: int) -> None:  # even threads use both weights, odd threads the first only
        for _ in range(each):
            backward((w1 * w2).sum() if index % 2 == 0 else (w1 * 2).sum())

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    handle.remove()
    total, full = threads * each, threads * each // 2
    detail = f"{len(calls)} of {total} calls, {calls.count(True)} of {full} with every gradient"
    if len(calls) == total and calls.count(True) == full:
        return Outcome("every call", detail, good=True)
    lost = total - len(calls)
    return Outcome(f"lost {lost} call{'' if lost == 1 else 's'}", detail, good=False)


def _hooked_step_ratio(demo: Demo) -> Spread:
    """Step time with one multi-grad hook per block (as a data-parallel reducer registers)."""
    models = {name: copy.deepcopy(demo.model) for name in ("torch", "tensorhooks")}
    registers = {
        "torch": torch_graph.register_multi_grad_hook,
        "tensorhooks": tensorhooks.register_multi_grad_hook,
    }
    handles = [
        registers[name](bucket, lambda grads: None)
        for name, model in models.items()
        for bucket in model.buckets()
    ]
    try:
        return demo.ratio(
            demo.step(contextlib.nullcontext, models["torch"]),
            demo.step(contextlib.nullcontext, models["tensorhooks"]),
        )
    finally:
        for handle in handles:
            handle.remove()


def _failed_backward(demo: Demo) -> Result:
    """State after a failed backward; the step with hooks per block is timed here."""
    return Result(
        _kept_after_failed_backward(torch_graph.register_multi_grad_hook),
        _kept_after_failed_backward(tensorhooks.register_multi_grad_hook),
        _hooked_step_ratio(demo),
        "tensorhooks / torch, a step with one hook per block",
    )


def _threads(demo: Demo) -> Result:
    """Calls when threads run backward at once."""
    return Result(
        _calls_under_threads(torch_graph.register_multi_grad_hook),
        _calls_under_threads(tensorhooks.register_multi_grad_hook),
    )


MULTI_GRAD_HOOK_FAILED_BACKWARD = Case(
    "register_multi_grad_hook",
    PEER,
    'mode "all"; backward raises after one tensor of the group got its gradient',
    _failed_backward,
)
MULTI_GRAD_HOOK_THREADS = Case(
    "register_multi_grad_hook",
    PEER,
    'mode "all"; four threads run backward at once over parts of one group',
    _threads,
)
