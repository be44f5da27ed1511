"""checkpoint_sequential: a sequence of modules or functions cut into checkpointed segments."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorhooks._core.errors import CheckpointArgumentTypeError, CheckpointArgumentValueError

from .region import checkpoint

__all__ = ["checkpoint_sequential"]

# torch's checkpoint_sequential warns so too (a UserWarning), and runs its reentrant variant then.
_REENTRANT_UNSET = (
    "tensorhooks.checkpointing.checkpoint_sequential: the use_reentrant parameter should be "
    "passed explicitly, as torch.utils.checkpoint asks. tensorhooks runs the non-reentrant "
    "variant either way, where torch runs the reentrant one when use_reentrant is left out; "
    "pass use_reentrant=False."
)


def _run_segment(segment: Sequence[Callable[[Any], Any]], value: Any) -> Any:
    for function in segment:
        value = function(value)
    return value


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` one after another on ``input``, checkpointing all segments but the last.

    A drop-in for ``torch.utils.checkpoint.checkpoint_sequential(..., use_reentrant=False)``:
    the sequence is cut into ``segments`` runs of ``len(functions) // segments`` functions (the
    last takes the rest); each run but the last goes through `tensorhooks.checkpoint`, so only
    the segments' inputs are kept and backward recomputes one segment at a time. Works with
    ``torch.autograd.grad`` and ``backward(inputs=...)``, which torch's reentrant default
    refuses.

    Example:
        >>> import torch
        >>> from tensorhooks.checkpointing import checkpoint_sequential
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> y = checkpoint_sequential(model, 2, x, use_reentrant=False)
        >>> (gx,) = torch.autograd.grad(y.sum(), [x])
        >>> gx.shape
        torch.Size([2, 4])

    Args:
        functions: a ``torch.nn.Sequential`` (its children are run, not its own hooks, as in
            torch) or a sequence of modules or one-argument functions.
        segments: how many segments to cut the sequence into, from 1 to ``len(functions)``.
        input: what the first function takes; each one's output is the next one's input.
        use_reentrant: ``False``; ``None`` warns as torch does (a ``UserWarning``; torch then
            runs its reentrant variant, tensorhooks this one); ``True`` is refused.
        **kwargs: ``preserve_rng_state`` (default ``True``), as in torch; no other.

    Returns:
        What the last function returns.

    Raises:
        CheckpointArgumentValueError: if ``use_reentrant=True``, ``segments`` is outside 1 to
            ``len(functions)``, or another keyword than ``preserve_rng_state`` is given (a
            ``ValueError``).
        CheckpointArgumentTypeError: if ``segments`` is not an int, or ``use_reentrant`` is
            not a flag (a second input passed positionally) (a ``TypeError``).

    Nesting and threads: as `tensorhooks.checkpoint`, which runs each segment.
    """
    _check_use_reentrant(use_reentrant)
    if use_reentrant:
        raise CheckpointArgumentValueError(
            "tensorhooks.checkpointing.checkpoint_sequential: use_reentrant=True is not "
            "supported; its segments run through tensorhooks.checkpoint, which has the "
            "non-reentrant variant only (it works with torch.autograd.grad()). Pass "
            "use_reentrant=False, or call torch.utils.checkpoint.checkpoint_sequential for the "
            "reentrant variant."
        )
    if use_reentrant is None:
        warnings.warn(_REENTRANT_UNSET, UserWarning, stacklevel=2)
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise CheckpointArgumentValueError(
            "tensorhooks.checkpointing.checkpoint_sequential: unexpected keyword arguments "
            f"{sorted(kwargs)}; it takes preserve_rng_state and use_reentrant only"
        )
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    size = _segment_size(len(functions), segments)
    end = -1
    for start in range(0, size * (segments - 1), size or 1):
        end = start + size - 1
        input = checkpoint(
            functools.partial(_run_segment, tuple(functions[start : end + 1])),
            input,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
        )
    return _run_segment(functions[end + 1 :], input)


def _check_use_reentrant(use_reentrant: object) -> None:
    """Refuse a ``use_reentrant`` that is not a flag: a second input passed positionally.

    torch's ``checkpoint_sequential(functions, segments, a, b)`` reads ``b`` as use_reentrant and
    fails later, a ``TypeError`` where the first function is called without ``b``; tensorhooks
    says so at once, with the same builtin.
    """
    if use_reentrant is None or isinstance(use_reentrant, int):  # bool, or torch's 0 and 1
        return
    raise CheckpointArgumentTypeError(
        "tensorhooks.checkpointing.checkpoint_sequential: use_reentrant must be None, True or "
        f"False, got a {type(use_reentrant).__name__} as its fourth positional argument: a "
        "second input? It passes one input along the sequence, as torch's does; pack the "
        "inputs into one, or checkpoint the functions with tensorhooks.checkpoint, which takes "
        "any arguments"
    )


def _segment_size(count: int, segments: object) -> int:
    """How many functions a segment runs; refuses a ``segments`` torch would misread."""
    if not isinstance(segments, int) or isinstance(segments, bool):
        raise CheckpointArgumentTypeError(
            "tensorhooks.checkpointing.checkpoint_sequential: segments must be an int, got "
            f"{segments!r} of type {type(segments).__name__}"
        )
    if not 1 <= segments <= max(count, 1):
        raise CheckpointArgumentValueError(
            "tensorhooks.checkpointing.checkpoint_sequential: segments must be from 1 to the "
            f"number of functions ({count}), got {segments}"
        )
    return count // segments
