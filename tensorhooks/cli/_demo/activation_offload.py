"""The save_on_cpu case: a forward pass whose graph is dropped without backward.

Outputs saved by their own operator (softmax's, say) point back at their graph; torch's context
keeps them, and so the graph's tensors, until the garbage collector runs.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from functools import partial
from typing import Any

import torch
from torch.autograd import graph as torch_graph

import tensorhooks
from tensorhooks._core.torch_compat import TorchDispatchMode
from tensorhooks.cli._console import format_bytes
from tensorhooks.cli._models import backward

from .case import Case, Context, Demo, Outcome, Result

__all__ = ["SAVE_ON_CPU"]


class _Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Weak references to every tensor an operator returns, to see what outlives a graph."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append(weakref.ref(tensor))
        return out


def _kept_after_drop(demo: Demo, context: Context) -> int:
    """Bytes of forward's tensors still alive once its graph is dropped, before a gc pass."""
    gc.collect()
    gc.disable()
    try:
        outputs = _Outputs()
        with torch.no_grad():
            demo.model.zero_grad(set_to_none=True)
        with context(), outputs:
            loss = demo.model(*demo.batch)
        del loss  # dropped without backward: an evaluation pass with grad enabled, say
        storages = {}
        for ref in outputs.made:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
    finally:
        gc.enable()
        gc.collect()


def _held_on_device(demo: Demo, context: Context) -> int:
    """Device bytes a forward pass leaves allocated for backward (CUDA only)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with context():
        loss = demo.model(*demo.batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    backward(loss)
    return held


def _dropped_graph(demo: Demo) -> Result:
    """A forward pass whose graph is dropped without backward."""
    pin = demo.cuda
    theirs = partial(torch_graph.save_on_cpu, pin_memory=pin)
    ours = partial(tensorhooks.save_on_cpu, pin_memory=pin)
    outcomes = []
    for context in (theirs, ours):
        kept = _kept_after_drop(demo, context)
        detail = (
            f"{format_bytes(kept)} of its tensors stay until the garbage collector runs"
            if kept
            else "nothing outlives the graph"
        )
        if demo.cuda:
            held = _held_on_device(demo, context)
            plain = _held_on_device(demo, contextlib.nullcontext)
            detail += f"; device memory held for backward {format_bytes(held)} (no offload: "
            detail += f"{format_bytes(plain)})"
        result = f"keeps {format_bytes(kept)}" if kept else "frees it at once"
        outcomes.append(Outcome(result, detail, good=kept == 0))
    return Result(
        outcomes[0],
        outcomes[1],
        demo.ratio(demo.step(theirs), demo.step(ours)),
        f"tensorhooks / torch, a step under save_on_cpu(pin_memory={pin})",
    )


SAVE_ON_CPU = Case(
    "save_on_cpu",
    "torch.autograd.graph",
    "a forward pass whose graph is dropped without backward (outputs saved by their own op, "
    "such as softmax, point back at their graph)",
    _dropped_graph,
)
