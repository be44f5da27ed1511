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
    "MutationContextExitedError",
    "SavedTensorModifiedError",
    "TensorHooksError",
    "UnguardedHooksError",
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
    """A value `tensorhooks.distributed.sync_gradients` cannot work with.

    Inherits `ValueError`, like torch's errors for an uninitialised process group.
    """


class MutationContextExitedError(TensorHooksError, RuntimeError):
    """Backward needed a tensor saved inside ``allow_mutation_on_saved_tensors`` after it exited.

    Writes are only tracked while the context is open, so a saved tensor cannot be trusted once
    it has closed. torch raises ``AssertionError`` here; this is a ``RuntimeError``.
    """


class UnguardedHooksError(TensorHooksError, RuntimeError):
    """An in-place write ran under saved-tensor hooks that cannot keep mutation protection.

    Raised inside ``allow_mutation_on_saved_tensors`` when torch's own
    ``torch.autograd.graph.saved_tensors_hooks`` (or a subclass such as torch's ``save_on_cpu``)
    is the innermost pair: tensors it saved are invisible to the context, so a write could reach
    backward unnoticed.
    """
