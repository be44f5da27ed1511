"""The checkers of `tensorhooks.testing`: run programs with and without hooks, compare.

See the module docstring of `tensorhooks.testing` for what a check asserts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings

from tensorhooks._core.errors import TensorHooksError
from tensorhooks._hooks import saved_tensors_hooks

from .programs import Program, SavedOutputExp, Square, programs

__all__ = [
    "GradientMismatchError",
    "Program",
    "SavedOutputExp",
    "Square",
    "assert_context_preserves_gradients",
    "assert_hooks_preserve_gradients",
    "check_program",
    "programs",
]

ContextFactory = Callable[[], AbstractContextManager[Any]]
_INPLACE_ERROR = "modified by an inplace operation"


class GradientMismatchError(TensorHooksError, AssertionError):
    """Hooks or a context changed what backward computes; the message holds the program.

    An ``AssertionError``, as a test's failed check is, and a `tensorhooks.TensorHooksError`.
    """


class _Outcome:
    """What one run gave: gradients, or the exception it raised (and where)."""

    __slots__ = ("error", "grads", "stage")

    def __init__(
        self, grads: list[torch.Tensor | None] | None, error: BaseException | None, stage: str
    ) -> None:
        self.grads = grads
        self.error = error
        self.stage = stage

    @property
    def inplace_error(self) -> bool:
        return isinstance(self.error, RuntimeError) and _INPLACE_ERROR in str(self.error)

    def __str__(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {self.error}"
        return f"gradients {self.grads}"


def _run(program: Program, context: ContextFactory | None) -> _Outcome:
    leaves = program.make_leaves()
    try:
        if context is None:
            grads = program.run(leaves)
        else:
            with context():
                grads = program.run(leaves)
    except Exception as error:
        return _Outcome(None, error, "run")
    return _Outcome(grads, None, "run")


def _copying_hooks() -> AbstractContextManager[None]:
    # torch's own pair copying every saved tensor at save time: the save-time reference.
    return torch.autograd.graph.saved_tensors_hooks(
        lambda tensor: tensor.detach().clone(), lambda tensor: tensor
    )


def _same(
    want: Sequence[torch.Tensor | None],
    have: Sequence[torch.Tensor | None],
    rtol: float,
    atol: float,
) -> str | None:
    """None when the gradients agree, else what differs."""
    if len(want) != len(have):
        return f"{len(have)} gradients instead of {len(want)}"
    for index, (expected, got) in enumerate(zip(want, have, strict=True)):
        if (expected is None) != (got is None):
            return f"gradient {index}: {got} instead of {expected}"
        if expected is None or got is None:
            continue
        try:
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as error:
            return f"gradient {index}: {error}"
    return None


def check_program(
    program: Program,
    context_factory: ContextFactory,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> bool:
    """Run ``program`` with and without ``context_factory()``; raise if gradients differ.

    Returns False when plain autograd rejects the program in a way unrelated to saved tensors
    (an op it refuses), which the caller should skip; True when the program was checked.

    Example:
        >>> import tensorhooks
        >>> from hypothesis import assume, given, settings
        >>> from tensorhooks.testing import check_program, programs
        >>> @settings(max_examples=5, database=None)
        ... @given(programs())
        ... def test_save_on_cpu(program):
        ...     assume(check_program(program, tensorhooks.save_on_cpu))
        >>> test_save_on_cpu()

    Raises:
        GradientMismatchError: when the context changed a gradient, raised where plain autograd
            does not, or gave a gradient that is neither plain autograd's in-place error nor
            the save-time gradient (an ``AssertionError``; the message holds the program).
    """
    plain = _run(program, None)
    if plain.error is not None and not plain.inplace_error and _run(program, _copying_hooks).error:
        # Plain autograd refuses this program for a reason of its own; so does the save-time
        # reference, so there is nothing to compare.
        return False
    got = _run(program, context_factory)
    if plain.error is None:
        if got.error is not None:
            _fail(program, "raised where plain autograd does not", plain, got)
        difference = _same(plain.grads or [], got.grads or [], rtol, atol)
        if difference is not None:
            _fail(program, f"changed a gradient ({difference})", plain, got)
        return True
    if got.inplace_error:
        return True
    save_time = _run(program, _copying_hooks)
    if got.error is not None:
        if save_time.error is None:
            _fail(program, "raised neither the in-place error nor a gradient", plain, got)
        return True
    difference = _same(save_time.grads or [], got.grads or [], rtol, atol)
    if difference is not None:
        _fail(
            program,
            "gave a gradient that is neither the save-time one nor autograd's in-place error "
            f"({difference})",
            plain,
            got,
        )
    return True


def _fail(program: Program, what: str, plain: _Outcome, got: _Outcome) -> None:
    raise GradientMismatchError(
        f"the context {what}.\nplain autograd: {plain}\nunder the context: {got}\n"
        "The program, as Python (run program(make_leaves()) with and without the context):\n\n"
        f"{program.source}"
    ) from got.error


def assert_context_preserves_gradients(
    context_factory: ContextFactory,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    max_examples: int | None = None,
    writes: bool = True,
) -> None:
    """Check on random programs that ``context_factory()`` never changes a gradient.

    Each program runs forward and backward inside a fresh ``context_factory()``. See the module
    docstring for what counts as a failure. Hypothesis shrinks a failing program before it is
    shown.

    Example:
        >>> import tensorhooks
        >>> from tensorhooks.testing import assert_context_preserves_gradients
        >>> assert_context_preserves_gradients(tensorhooks.save_on_cpu, max_examples=5)

    Args:
        context_factory: returns a new context manager each call (a class such as
            ``tensorhooks.save_on_cpu`` works).
        rtol: relative tolerance of the comparison (0: bitwise equal, NaN equal to NaN).
        atol: absolute tolerance of the comparison.
        max_examples: how many programs to try; default: the active hypothesis profile's.
        writes: whether programs change tensors in place (turn off for hooks that are not
            meant to survive in-place writes, and that autograd's check cannot see).

    Raises:
        GradientMismatchError: on the first (shrunk) program whose gradients differ.
    """
    profile = settings()  # the active profile
    config = settings(
        profile,
        max_examples=max_examples or profile.max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )

    @config
    @given(programs(writes=writes))
    def check(program: Program) -> None:
        assume(check_program(program, context_factory, rtol=rtol, atol=atol))

    check()


def assert_hooks_preserve_gradients(
    pack_hook: Callable[[torch.Tensor], Any],
    unpack_hook: Callable[[Any], torch.Tensor],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    max_examples: int | None = None,
    writes: bool = True,
) -> None:
    """Check on random programs that a pack/unpack pair never changes a gradient.

    The pair is pushed with `tensorhooks.saved_tensors_hooks`, so a pack that returns the tensor
    itself passes (its safety net raises autograd's in-place error); use
    `assert_context_preserves_gradients` to check a pair under another context.

    Example:
        >>> from tensorhooks.testing import assert_hooks_preserve_gradients
        >>> assert_hooks_preserve_gradients(
        ...     lambda t: t.detach().clone(), lambda t: t, max_examples=5)

    Args:
        pack_hook: ``pack_hook(tensor) -> Any``.
        unpack_hook: ``unpack_hook(packed) -> Tensor``.
        rtol: relative tolerance of the comparison (0: bitwise equal).
        atol: absolute tolerance of the comparison.
        max_examples: how many programs to try; default: the active hypothesis profile's.
        writes: whether programs change tensors in place.

    Raises:
        GradientMismatchError: on the first (shrunk) program whose gradients differ.
    """
    assert_context_preserves_gradients(
        lambda: saved_tensors_hooks(pack_hook, unpack_hook),
        rtol=rtol,
        atol=atol,
        max_examples=max_examples,
        writes=writes,
    )
