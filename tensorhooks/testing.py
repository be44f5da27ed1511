"""Property tests for saved-tensor hooks and contexts: random autograd programs and checkers.

Run random autograd programs with and without your hooks (or context) and compare gradients::

    from tensorhooks.testing import assert_hooks_preserve_gradients
    assert_hooks_preserve_gradients(my_pack, my_unpack)

This module needs hypothesis (``pip install tensorhooks[testing]``); the rest of tensorhooks
does not.

The check, per program: when plain autograd succeeds, the hooks must give the same gradients;
when plain autograd raises its in-place error (a saved tensor was changed before backward), the
hooks must either raise that error too or give the gradient of the values at save time (what
autograd computes when pack copies every saved tensor); never a third result. Gradients are
compared bitwise, or where they differ, within the rounding the computation itself shows (see
`check_program`). On failure the error shows the shrunk program as Python you can run.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401  # only to fail early, with the fix in the message
except ImportError as error:  # pragma: no cover (the test extra installs it)
    raise ImportError(
        "tensorhooks.testing needs hypothesis; install it with `pip install "
        "tensorhooks[testing]` (or `pip install hypothesis`)"
    ) from error

from ._testing.checkers import (
    assert_context_preserves_gradients,
    assert_hooks_preserve_gradients,
    check_checkpoint,
    check_compiled,
    check_program,
)
from ._testing.errors import CheckArgumentValueError, GradientMismatchError
from ._testing.modules import check_module
from ._testing.programs import Program, SavedOutputExp, Square, programs

__all__ = [
    "CheckArgumentValueError",
    "GradientMismatchError",
    "Program",
    "SavedOutputExp",
    "Square",
    "assert_context_preserves_gradients",
    "assert_hooks_preserve_gradients",
    "check_checkpoint",
    "check_compiled",
    "check_module",
    "check_program",
    "programs",
]
