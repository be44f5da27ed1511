"""The exceptions tensorhooks raises.

Every class also inherits the builtin that torch raises in the same situation, so code written
against ``torch.autograd.graph`` (``except RuntimeError:``) keeps working unchanged.
"""

from __future__ import annotations

__all__ = [
    "GradientSyncError",
    "GraphTaskError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "SavedTensorModifiedError",
    "TensorHooksError",
]


class TensorHooksError(Exception):
    """Base class of every exception raised by tensorhooks."""


class SavedTensorModifiedError(TensorHooksError, RuntimeError):
    """A tensor saved for backward was changed in place before backward read it.

    The message starts like autograd's own in-place error ("one of the variables needed for
    gradient computation has been modified by an inplace operation"), so code that matches on it
    keeps working.
    """


class GradientSyncError(TensorHooksError, RuntimeError):
    """Gradients could not be synchronised across processes during a backward call."""


class GraphTaskError(TensorHooksError, RuntimeError):
    """Per-backward state was used outside a backward call, or after its graph task ended."""


class InvalidHookModeError(TensorHooksError, ValueError):
    """A ``mode`` argument that is not one of the supported modes."""


class InvalidOffloadOptionError(TensorHooksError, ValueError):
    """An offloading option with a value out of range, such as a negative byte threshold."""


class InvalidHookArgumentError(TensorHooksError, TypeError):
    """An argument of the wrong type, such as a non-tensor where tensors are expected."""


class InvalidSyncArgumentError(TensorHooksError, ValueError):
    """A value :func:`tensorhooks.distributed.sync_gradients` cannot work with.

    Inherits :class:`ValueError`, like torch's errors for an uninitialised process group.
    """
