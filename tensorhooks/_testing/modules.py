"""Check a real model: one forward and backward of a module, with and without a context."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .checkers import ContextFactory, Verdict, copying_hooks, outcome, tensors_in, within
from .errors import CheckArgumentValueError

__all__ = ["check_module"]


def check_module(
    module: torch.nn.Module,
    inputs: torch.Tensor | Sequence[Any],
    context_factory: ContextFactory,
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    precision: torch.dtype | None = None,
) -> None:
    """Run ``module(*inputs)`` and one backward with and without ``context_factory()``; compare.

    Both runs start from the same random-number state and the same parameters and buffers, and
    take the gradients of the parameters that require grad and of the inputs that do with
    ``torch.autograd.grad`` (one backward: ``.grad`` is left alone, and a pack/unpack pair that
    frees what it stored on unpack can be checked). The gradients, and the buffers after the
    run, must be plain autograd's, compared as `check_program` compares them: bitwise, or within
    the rounding the model itself shows (``precision`` for a pair that rounds saved tensors).
    The module is left with the parameter and buffer values it had.

    Example:
        >>> import torch
        >>> import tensorhooks
        >>> from tensorhooks.testing import check_module
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
        ...     torch.nn.Linear(16, 4))
        >>> batch = torch.randn(32, 8)
        >>> check_module(model, batch, tensorhooks.allow_mutation_on_saved_tensors)
        >>> def bf16_pair():  # keeps saved tensors in bfloat16
        ...     return tensorhooks.saved_tensors_hooks(
        ...         lambda t: (t.dtype, t.to(torch.bfloat16)), lambda p: p[1].to(p[0]))
        >>> check_module(model, batch, bf16_pair, precision=torch.bfloat16)

    Args:
        module: the model; it runs in the mode it is in (``train()`` or ``eval()``).
        inputs: its argument, or a sequence of its positional arguments.
        context_factory: returns a new context manager each call; the forward pass and
            backward run inside it.
        loss: turns the module's output into the scalar that backward starts from; default: a
            fixed random projection of every floating-point tensor in the output (found in
            tuples, lists and dicts), so that no gradient cancels by symmetry.
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: None when the context keeps saved values exactly; the dtype it rounds them
            to otherwise (``torch.bfloat16``): the tolerance is then what rounding to it can
            change, which scales with the values.

    Raises:
        GradientMismatchError: when the context changed a gradient or a buffer, or raised where
            plain autograd does not.
        CheckArgumentValueError: when the output holds no floating-point tensor that requires
            grad, or nothing requires grad.
        Exception: whatever plain autograd raises on the module (other than its in-place
            error), re-raised: the model fails without the context too.
    """
    arguments = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    wanted: list[tuple[str, torch.Tensor]] = [
        (f"parameter {name}", p) for name, p in module.named_parameters() if p.requires_grad
    ]
    wanted += [
        (f"input {index}", tensor)
        for index, tensor in enumerate(tensors_in(arguments))
        if tensor.requires_grad
    ]
    if not wanted:
        raise CheckArgumentValueError(
            "check_module: no parameter of the module and no input requires grad, so there is "
            "no gradient to compare; pass a module with trainable parameters or an input with "
            "requires_grad=True"
        )
    buffers = list(module.named_buffers())
    names = [name for name, _ in wanted] + [f"buffer {name}" for name, _ in buffers]
    state = _State(module)

    def step() -> list[torch.Tensor | None]:
        state.restore()
        with _same_random_numbers(arguments):
            output = module(*arguments)
            scalar = (loss or _projection)(output)
            grads = torch.autograd.grad(scalar, [t for _, t in wanted], allow_unused=True)
        return [*grads, *(buffer.detach().clone() for _, buffer in buffers)]

    verdict = Verdict(
        lambda context: outcome(step, context),
        lambda context: outcome(step, within(copying_hooks, context)),
        f"The module: {type(module).__name__}, called on {_describe(arguments)}.",
        lambda index: names[index],
        rtol=rtol,
        atol=atol,
        precision=precision,
    )
    try:
        plain = outcome(step, None)
        if plain.error is not None and not plain.inplace_error:
            raise plain.error
        verdict.judge(plain, outcome(step, context_factory))
    finally:
        state.restore()


class _State:
    """The module's parameters and buffers as they were, put back before and after each run.

    Buffers are always put back: torch's batch-norm kernels update running statistics without
    moving their version counter. Parameters are put back when their version moved.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.parameters = [(p, p._version, p.detach().clone()) for p in module.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for parameter, version, value in self.parameters:
                if parameter._version != version:
                    parameter.copy_(value)
            for buffer, value in self.buffers:
                buffer.copy_(value)


@contextlib.contextmanager
def _same_random_numbers(arguments: Sequence[Any]) -> Iterator[None]:
    """Each run draws the same random numbers (dropout), and leaves the generators as found."""
    devices = sorted(
        {t.device.index or 0 for t in tensors_in(arguments) if t.device.type == "cuda"}
    )
    with torch.random.fork_rng(devices=devices):
        yield


def _projection(output: Any) -> torch.Tensor:
    """A fixed random projection of every floating-point output that requires grad."""
    generator = torch.Generator().manual_seed(0)
    terms = []
    for tensor in tensors_in(output):
        if tensor.is_floating_point() and tensor.requires_grad:
            weights = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            terms.append((tensor * weights.to(tensor.device, tensor.dtype)).sum())
    if not terms:
        raise CheckArgumentValueError(
            "check_module: the module's output holds no floating-point tensor that requires "
            "grad; pass loss= to say what backward starts from"
        )
    return sum(terms[1:], terms[0])


def _describe(arguments: Sequence[Any]) -> str:
    shapes = [f"{tuple(t.shape)} {t.dtype}" for t in tensors_in(arguments)]
    return f"tensors of shapes {', '.join(shapes)}" if shapes else "no tensors"
