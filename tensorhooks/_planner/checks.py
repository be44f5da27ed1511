"""What planning checks before it trusts a step, and what it puts back after running it.

- `untouched`: the model's buffers, the parameters' ``.grad`` and the RNG states are as they
  were after the steps planning runs (the recorded one, the confirming one).
- `StepWatch`: the recorded step, watched: the order the blocks run in, whether a backward ran,
  whether that backward records a graph (``create_graph=True``), which the cost model does not
  price (see NOTE [What the cost model cannot price]), and what a plan could not run (a block
  that writes its input, or is handed a cache it writes).
- `budget_in_bytes`: a budget in bytes, from an int, a fraction or a string with units.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tensorhooks._checkpoint import is_recomputing
from tensorhooks._core.errors import PlanArgumentTypeError, PlanArgumentValueError, PlanStateError
from tensorhooks._core.guards import current_save_guard
from tensorhooks._core.torch_compat import (
    OpOverload,
    current_graph_task_id,
    op_schema,
    storage_key,
)

from .apply import tensors_in
from .layers import (
    CACHE_ARGUMENTS,
    hf_checkpointing_message,
    hf_checkpointing_on,
    is_hf_layer,
    writes_cache,
)

__all__ = ["StepWatch", "budget_in_bytes", "check_model_state", "untouched"]

# NOTE [What the cost model cannot price]
#
# The cost model counts what the forward pass saves for backward and what a recomputation keeps
# while its block's backward runs. A backward that records a graph itself (``create_graph=True``,
# a gradient penalty's ``torch.autograd.grad``) saves again for the second backward: tensors the
# profile never sees, held past the blocks' backward (3.3x the budget on a small MLP). There is
# no exact price for them in a per-block model, so profiling refuses such a step rather than
# plan it silently. Seen by a pair of saved-tensor hooks around the step: a save while a
# backward runs. Checkpoint's recomputations and the blocks' own saves go to the hooks they
# push themselves, so what reaches the outer pair in backward is saved for a second backward.


@contextlib.contextmanager
def untouched(model: nn.Module, caller: str) -> Iterator[None]:
    """Run the body and put ``model``'s buffers, ``.grad`` and the RNG states back as they were.

    The parameters' ``.grad`` are set aside (None during the body, so that backward does not
    add into them) and given back, the same tensors; buffers (BatchNorm's running statistics
    and ``num_batches_tracked``) get their values back, bitwise; the CPU generator's state, and
    every CUDA device's if CUDA is initialized, are restored.

    Raises:
        PlanStateError: if the body changed a parameter in place (an optimizer step inside
            ``step``): planning cannot undo that.
    """
    grads = [(parameter, parameter.grad) for parameter in model.parameters()]
    versions = [(name, parameter._version) for name, parameter in model.named_parameters()]
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    cpu_state = torch.get_rng_state()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    cuda_states = torch.cuda.get_rng_state_all() if initialized else None
    for parameter, _ in grads:
        parameter.grad = None
    try:
        yield
    finally:
        for parameter, grad in grads:
            parameter.grad = grad
        with torch.no_grad():
            for module, name, buffer, value in buffers:
                module._buffers[name] = buffer
                buffer.copy_(value)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
    parameters = dict(model.named_parameters())
    changed = [name for name, version in versions if parameters[name]._version != version]
    if changed:
        raise PlanStateError(
            f"{caller}: step changed the parameters {changed[:3]} in place (an optimizer step, "
            "or a weight update in the step); step must run one forward and backward only, "
            "since it is called several times: move optimizer.step() out of it"
        )


def check_model_state(model: nn.Module, caller: str) -> None:
    """Refuse a model whose own gradient checkpointing (Hugging Face's) is on.

    Raises:
        PlanStateError: if it is.
    """
    if hf_checkpointing_on([model]):
        raise PlanStateError(hf_checkpointing_message(caller))


def _written(func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes in place."""
    schema = op_schema(func)
    if not schema.is_mutable:
        return []
    found: list[torch.Tensor] = []
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        tensors_in(value, found)
    return found


def _with_cache(module: nn.Module, args: object, kwargs: object) -> bool:
    """Whether ``module`` gets a cache that a plan cannot turn off, which it would write again.

    A Hugging Face layer's cache is turned off in training mode; in eval mode the layer keeps a
    cache it writes and is not recomputed (see NOTE [Caches of Hugging Face layers] in
    `layers`), so no plan holds there.
    """
    if not isinstance(kwargs, dict) or not isinstance(args, tuple):
        return False
    if is_hf_layer(module):
        return not module.training and writes_cache(module, args, kwargs)
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS):
        return True
    return getattr(getattr(module, "config", None), "use_cache", False) is True


class _Refused(Exception):  # noqa: N818  # not an error of the user's: a stop signal
    """Raised from a block's pre-hook to stop a watched step that no plan could hold."""


def _handed_cache(module: nn.Module, kwargs: object) -> bool:
    """Whether the call itself hands ``module`` a cache (not only its config's ``use_cache``)."""
    if is_hf_layer(module):
        return True
    if not isinstance(kwargs, dict):
        return False
    return bool(kwargs.get("use_cache")) or any(
        kwargs.get(name) is not None for name in CACHE_ARGUMENTS
    )


class StepWatch:
    """One step, watched: the blocks' order, a backward, a backward that records a graph.

    The recorder of the profiled step tells it what it sees (`note_write`, `note_backward`,
    `note_save_in_backward`); `watching` adds hooks on the blocks. After the step, `check`
    refuses what the cost model cannot price or a plan could not run; `failed` says why a step
    that raised did.

    Args:
        blocks: the blocks, in the order they are listed.
        caller: the function named in errors.
    """

    def __init__(self, blocks: Sequence[nn.Module], caller: str) -> None:
        self.blocks = list(blocks)
        self.caller = caller
        self.order: list[int] = []  # block indices as their forward starts
        self.backward = False
        self.graph = False
        self.inputs: list[tuple[int, set[int | None]]] = []  # blocks running: their inputs
        self.written: tuple[int, OpOverload] | None = None  # a block that wrote its input
        self.cached: int | None = None  # a block called with a KV cache it may write
        self.handed: bool = False  # ... which it was handed (not only its config's use_cache)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Hooks on the blocks while the body runs the step."""
        handles = [
            hook
            for index, block in enumerate(self.blocks)
            for hook in (
                block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True),
                block.register_forward_hook(self._post_hook, always_call=True),
            )
        ]
        try:
            yield
        except _Refused:
            raise PlanStateError(self._cached_message()) from None
        finally:
            for handle in handles:
                handle.remove()

    def note_write(self, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """A forward op that writes in place: does it write the running block's input?"""
        if not self.inputs or self.written is not None or is_recomputing():
            return
        if current_save_guard().lets_saved_tensors_change:
            return  # saved tensors are copied before a write (allow_mutation_on_saved_tensors)
        written = {storage_key(tensor) for tensor in _written(func, args, kwargs)} - {None}
        if written & self.inputs[-1][1]:
            self.written = (self.inputs[-1][0], func)

    def note_backward(self) -> None:
        """An op ran in backward."""
        self.backward = True

    def note_save_in_backward(self) -> None:
        """A tensor was saved in backward, outside recomputations: a second backward's."""
        self.graph = True  # see NOTE [What the cost model cannot price]

    def failed(self, error: Exception) -> None:
        """The step raised ``error``: raise what caused it, if the watch saw it.

        Raises:
            PlanStateError: the cause the step's own error may hide (a block that wrote its
                input, or was handed a cache its recomputation wrote again).
        """
        if isinstance(error, PlanStateError):
            return
        if self.written is not None:
            raise PlanStateError(self._written_message()) from error
        if self.cached is not None:
            raise PlanStateError(self._cached_message()) from error

    def check(self) -> None:
        """Refuse a step the cost model cannot price, or that a plan could not run.

        Raises:
            PlanStateError: if the step ran no backward, its backward records a graph, a block
                wrote its input, or a block was handed a cache it writes.
        """
        if self.graph:
            raise PlanStateError(
                f"{self.caller}: the step's backward records a graph (create_graph=True, as a "
                "gradient penalty's torch.autograd.grad does, or a reentrant checkpoint running "
                "its function again); what it saves in backward is not priced by the cost "
                "model, so no budget could be kept. Plan a step without create_graph (and "
                "use_reentrant=False), or checkpoint by hand (tensorhooks.checkpoint)"
            )
        if not self.backward:
            raise PlanStateError(
                f"{self.caller}: the step ran no backward; step must run one forward and "
                "backward the way training does (call loss.backward() in it)"
            )
        if self.written is not None:
            raise PlanStateError(self._written_message())
        if self.cached is not None and self.handed:
            raise PlanStateError(self._cached_message())

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def note(module: nn.Module, args: object, kwargs: object) -> None:
            if current_graph_task_id() == -1 and not is_recomputing():
                self.order.append(index)
                keys = {storage_key(tensor) for tensor in tensors_in((args, kwargs), [])}
                self.inputs.append((index, keys))
                if self.cached is None and _with_cache(module, args, kwargs):
                    self.cached = index
                    self.handed = _handed_cache(module, kwargs)
                    if is_hf_layer(module):  # it would run as it is: stop the step here
                        raise _Refused

        return note

    def _post_hook(self, module: nn.Module, args: object, output: object) -> None:
        if current_graph_task_id() == -1 and not is_recomputing() and self.inputs:
            self.inputs.pop()

    def _cached_message(self) -> str:
        assert self.cached is not None
        block = self.blocks[self.cached]
        name = type(block).__name__
        if is_hf_layer(block):
            return (
                f"{self.caller}: block {self.cached} ({name}) runs in eval mode with a KV cache "
                "it writes; as under Hugging Face's gradient checkpointing, a layer in eval mode "
                "keeps its cache and is not recomputed, so no plan could hold. Call the model "
                "with use_cache=False in the step (or set model.config.use_cache = False), or "
                "profile it in train mode (model.train())"
            )
        return (
            f"{self.caller}: block {self.cached} ({name}) runs with a KV cache (use_cache=True, "
            "or a cache argument), which its recomputation in backward writes again; call the "
            "model with "
            "use_cache=False in the step (or set model.config.use_cache = False), or plan the "
            "model's layers (the default blocks), whose cache a plan turns off"
        )

    def _written_message(self) -> str:
        assert self.written is not None
        index, func = self.written
        name = type(self.blocks[index]).__name__
        return (
            f"{self.caller}: block {index} ({name}) writes its input in place ({func}); a "
            "checkpointed block keeps its input to run again in backward, so it must not change "
            "it. Make that op out of place (x = x * 2 rather than x.mul_(2)), or pass "
            "blocks=[...] that leave this one out"
        )

    def run_order(self) -> list[int]:
        """The blocks in the order their forward first started (those that ran)."""
        return list(dict.fromkeys(self.order))


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def budget_in_bytes(budget: object, unplanned: int, caller: str) -> int:
    """``budget`` in bytes: an int, a fraction of ``unplanned`` (a float), or "8GB", "512MiB".

    Raises:
        PlanArgumentTypeError: if it is of another type.
        PlanArgumentValueError: if it is not positive, a fraction is above 1, or a string is
            not a number with a unit.
    """
    if isinstance(budget, str):
        return _parsed(budget, caller)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise PlanArgumentTypeError(
            f"{caller}: budget must be an int (bytes), a float (a fraction of the unplanned "
            f'peak) or a string with units ("8GB", "512MiB"), got {budget!r} of type '
            f"{type(budget).__name__}"
        )
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise PlanArgumentValueError(
                f"{caller}: a float budget is a fraction of the unplanned peak ({unplanned} "
                f'bytes) and must be in (0, 1], got {budget!r}; pass an int for bytes, or "8GB"'
            )
        return int(budget * unplanned)
    if budget <= 0:
        raise PlanArgumentValueError(f"{caller}: budget must be positive, got {budget!r} bytes")
    return budget


def _parsed(budget: str, caller: str) -> int:
    match = _SIZE.fullmatch(budget)
    unit = None if match is None else _UNITS.get(match[2].lower())
    if match is None or unit is None or not match[2]:
        raise PlanArgumentValueError(
            f"{caller}: budget {budget!r} is not a size; write a number and a unit, such as "
            f'"8GB", "512MiB" or "1.5GiB" (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, '
            "TiB of 1024; B is bytes)"
        )
    value = float(match[1]) * unit
    if not math.isfinite(value) or value < 1:
        raise PlanArgumentValueError(
            f"{caller}: budget must be positive, got {budget!r} ({value:g} bytes)"
        )
    return int(value)
