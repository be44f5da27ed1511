"""The errors of `tensorhooks.testing`: a check that failed, an argument it cannot use."""

from __future__ import annotations

from tensorhooks._core.errors import TensorHooksError

__all__ = ["CheckArgumentValueError", "GradientMismatchError"]


class GradientMismatchError(TensorHooksError, AssertionError):
    """Hooks or a context changed what backward computes; the message holds the program.

    An ``AssertionError``, as a test's failed check is, and a `tensorhooks.TensorHooksError`.
    """


class CheckArgumentValueError(TensorHooksError, ValueError):
    """A strategy or checker of `tensorhooks.testing` was given a value it does not know.

    A ``ValueError``, and a `tensorhooks.TensorHooksError`; the message lists the values it
    takes.
    """
