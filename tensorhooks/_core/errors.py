"""The exceptions tensorhooks raises.

One class per feature and failure. Every class also inherits the builtin that torch raises in the
same situation, so code written against ``torch.autograd.graph`` (``except RuntimeError:``,
``except TypeError:``) keeps working unchanged. Feature, failure: class (builtin).

* every feature: the base class `TensorHooksError` (``Exception``).
* hook APIs (``saved_tensors_hooks``, ``disable_saved_tensors_hooks``,
  ``register_multi_grad_hook``, ``save_on_cpu``), an argument of the wrong type:
  `HookArgumentTypeError` (``TypeError``); an argument value they do not accept:
  `HookArgumentValueError` (``ValueError``).
* saved-tensor hooks, a saved tensor changed in place before backward:
  `SavedTensorModifiedError` (``RuntimeError``).
* ``save_on_cpu``, an option value out of range: `OffloadArgumentValueError` (``ValueError``); an
  offload while a CUDA graph is being captured: `OffloadCaptureError` (``RuntimeError``).
* ``allow_mutation_on_saved_tensors``, backward after the context exited:
  `MutationContextExitedError` (``RuntimeError`` and ``AssertionError``); a write under torch's
  own hooks: `UnguardedHooksError` (``RuntimeError``).
* ``checkpoint``, an option it does not take: `CheckpointArgumentValueError` (``ValueError``);
  a selective-checkpoint argument or policy answer of the wrong type:
  `CheckpointArgumentTypeError` (``TypeError``).
* ``offload_parameters``, an argument of the wrong type: `ParameterOffloadTypeError`
  (``TypeError``); blocks or options it cannot work with: `ParameterOffloadValueError`
  (``ValueError``); no accelerator to stream to: `ParameterOffloadDeviceError` (``RuntimeError``);
  backward over a graph built before the handle was removed, or a model changed in a way it
  cannot follow: `ParameterOffloadStateError` (``RuntimeError``).
* ``sync_gradients``, an argument of the wrong type: `SyncArgumentTypeError` (``TypeError``); a
  value it cannot use: `SyncArgumentValueError` (``ValueError``); synchronisation failed in
  backward: `GradientSyncError` (``RuntimeError``).
* the graph-task store, used outside backward: `GraphTaskError` (``RuntimeError``).
* ``plan_activations`` and ``profile_step``, an argument of the wrong type:
  `PlanArgumentTypeError` (``TypeError``); a value they cannot use: `PlanArgumentValueError`
  (``ValueError``); a budget below the least peak any plan reaches: `PlanBudgetError`
  (``ValueError``); a plan applied twice, or a step that does not run as profiled:
  `PlanStateError` (``RuntimeError``); a planned step that may hold more than the budget (a
  warning, not an error): `PlanBudgetWarning` (``UserWarning``).
* ``tensorhooks.testing``, hooks or a context that changed a gradient: its
  ``GradientMismatchError`` (``AssertionError``), defined there with the checkers that raise it;
  a strategy or checker option it does not know: its ``CheckArgumentValueError``
  (``ValueError``).

Earlier names stay importable as aliases of the same classes: ``InvalidHookArgumentError``
(`HookArgumentTypeError`), ``InvalidHookModeError`` (`HookArgumentValueError`),
``InvalidOffloadOptionError`` (`OffloadArgumentValueError`) and ``InvalidSyncArgumentError``
(`SyncArgumentValueError`).
"""

from __future__ import annotations

__all__ = [
    "CheckpointArgumentTypeError",
    "CheckpointArgumentValueError",
    "GradientSyncError",
    "GraphTaskError",
    "HookArgumentTypeError",
    "HookArgumentValueError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "MutationContextExitedError",
    "OffloadArgumentValueError",
    "OffloadCaptureError",
    "ParameterOffloadDeviceError",
    "ParameterOffloadStateError",
    "ParameterOffloadTypeError",
    "ParameterOffloadValueError",
    "PlanArgumentTypeError",
    "PlanArgumentValueError",
    "PlanBudgetError",
    "PlanBudgetWarning",
    "PlanStateError",
    "SavedTensorModifiedError",
    "SyncArgumentTypeError",
    "SyncArgumentValueError",
    "TensorHooksError",
    "UnguardedHooksError",
]


class TensorHooksError(Exception):
    """Base class of every exception raised by tensorhooks."""


# --- Hook APIs ----------------------------------------------------------------------------------


class HookArgumentTypeError(TensorHooksError, TypeError):
    """An argument of a hook API with the wrong type, such as a non-tensor where tensors go.

    Raised by `saved_tensors_hooks`, `disable_saved_tensors_hooks`, `register_multi_grad_hook`
    and `save_on_cpu`. Also importable as ``InvalidHookArgumentError``, its earlier name.
    """


class HookArgumentValueError(TensorHooksError, ValueError):
    """An argument of a hook API with a value it does not accept, such as an unknown ``mode``.

    Also importable as ``InvalidHookModeError``, its earlier name.
    """


class SavedTensorModifiedError(TensorHooksError, RuntimeError):
    """A tensor saved for backward was changed in place before backward read it.

    The message starts like autograd's own in-place error ("one of the variables needed for
    gradient computation has been modified by an inplace operation"), so code that matches on it
    keeps working.
    """


# --- save_on_cpu --------------------------------------------------------------------------------


class OffloadArgumentValueError(TensorHooksError, ValueError):
    """An offloading option with a value out of range, such as a negative byte threshold.

    Also importable as ``InvalidOffloadOptionError``, its earlier name.
    """


class OffloadCaptureError(TensorHooksError, RuntimeError):
    """``save_on_cpu`` was asked to offload a tensor while its device's stream is being captured.

    A CUDA graph replays the copies it captured into the same host buffers, which the pool hands
    to later saves: offloading cannot be captured. Inherits `RuntimeError`, what torch raises for
    work that is not permitted during capture.
    """


# --- allow_mutation_on_saved_tensors ------------------------------------------------------------


class MutationContextExitedError(TensorHooksError, RuntimeError, AssertionError):
    """Backward needed a tensor saved inside ``allow_mutation_on_saved_tensors`` after it exited.

    Writes are only tracked while the context is open, so a saved tensor cannot be trusted once
    it has closed. torch raises ``AssertionError`` here; this is a ``RuntimeError`` and also an
    ``AssertionError``, so handlers written for either catch it.
    """


class UnguardedHooksError(TensorHooksError, RuntimeError):
    """An in-place write ran under saved-tensor hooks that cannot keep mutation protection.

    Raised inside ``allow_mutation_on_saved_tensors`` when torch's own
    ``torch.autograd.graph.saved_tensors_hooks`` (or a subclass such as torch's ``save_on_cpu``)
    is the innermost pair: tensors it saved are invisible to the context, so a write could reach
    backward unnoticed.
    """


# --- sync_gradients -----------------------------------------------------------------------------


class SyncArgumentTypeError(TensorHooksError, TypeError):
    """An argument of `tensorhooks.distributed.sync_gradients` with the wrong type."""


class SyncArgumentValueError(TensorHooksError, ValueError):
    """A value `tensorhooks.distributed.sync_gradients` cannot work with.

    Inherits `ValueError`, like torch's errors for an uninitialised process group. Also
    importable as ``InvalidSyncArgumentError``, its earlier name.
    """


class GradientSyncError(TensorHooksError, RuntimeError):
    """Gradients could not be synchronised across processes during a backward call."""


# --- The graph-task store -----------------------------------------------------------------------


class GraphTaskError(TensorHooksError, RuntimeError):
    """Per-backward state was used outside a backward call, or after its graph task ended."""


# --- offload_parameters -----------------------------------------------------------------------


class ParameterOffloadValueError(TensorHooksError, ValueError):
    """`tensorhooks.offload_parameters` was given blocks or options it cannot work with.

    Such as a block that is not a submodule of the module, two blocks of which one contains the
    other, or a negative ``prefetch``. Inherits `ValueError`, like torch's argument checks.
    """


class ParameterOffloadTypeError(TensorHooksError, TypeError):
    """`tensorhooks.offload_parameters` was given an argument of the wrong type.

    Such as a module that is not an ``nn.Module``, or a block that is not one. Inherits
    `TypeError`, like torch's argument checks.
    """


class ParameterOffloadStateError(TensorHooksError, RuntimeError):
    """`tensorhooks.offload_parameters` met a model or a graph in a state it cannot work with.

    Backward over a graph built before ``remove()`` (the handle's hooks are gone, so nothing
    would bring the parameters back or move their gradients); a block starting while its module
    holds a new object in place of a streamed parameter (``load_state_dict(assign=True)``: the
    hooks are on the old one); backward needing a weight whose data was replaced since forward.
    Inherits `RuntimeError`, what autograd raises for a graph it can no longer run.
    """


class ParameterOffloadDeviceError(TensorHooksError, RuntimeError):
    """An accelerator was asked for (or needed by default) and none is available.

    Inherits `RuntimeError`, what torch raises when a device it was built without is used.
    """


# Earlier names, kept because they are public API: the same class objects.
InvalidHookArgumentError = HookArgumentTypeError
InvalidHookModeError = HookArgumentValueError
InvalidOffloadOptionError = OffloadArgumentValueError
InvalidSyncArgumentError = SyncArgumentValueError


class CheckpointArgumentTypeError(TensorHooksError, TypeError):
    """A selective-checkpoint argument or policy answer of the wrong type.

    Such as a policy that is neither a function nor a list of ops, an ``offload`` that is not a
    `save_on_cpu`, or a policy function returning something other than a ``CheckpointPolicy`` or
    a bool. Inherits `TypeError`, what torch raises for arguments of the wrong type.
    """


class CheckpointArgumentValueError(TensorHooksError, ValueError):
    """An option `tensorhooks.checkpoint` does not take, such as ``use_reentrant=True``.

    Inherits `ValueError`, like torch's errors for checkpoint options.
    """


# --- plan_activations ---------------------------------------------------------------------------


class PlanArgumentTypeError(TensorHooksError, TypeError):
    """A `tensorhooks.plan_activations` or `tensorhooks.profile_step` argument of the wrong type.

    Such as a model that is not an ``nn.Module``, a step that is not callable, or a budget that
    is neither an int (bytes) nor a float (a fraction). Inherits `TypeError`, like torch's
    argument checks.
    """


class PlanArgumentValueError(TensorHooksError, ValueError):
    """`tensorhooks.plan_activations` or `tensorhooks.profile_step` got a value it cannot use.

    Such as a negative budget, a fraction above 1, a bandwidth that is not positive, or blocks
    that are not submodules of the model. Inherits `ValueError`, like torch's argument checks.
    """


class PlanBudgetError(TensorHooksError, ValueError):
    """The budget of `tensorhooks.plan_activations` is below the least peak any plan reaches.

    The message names that least peak, in bytes and as a fraction of the unplanned peak, and
    what would lower it. Inherits `ValueError`: the budget is an argument value.
    """


class PlanStateError(TensorHooksError, RuntimeError):
    """A plan was applied while already applied, or the step did not run as it was profiled.

    Such as entering a plan twice, removing a handle twice, a block that ran twice in one step,
    or a block whose forward was replaced by someone else meanwhile. Inherits `RuntimeError`.
    """


class PlanBudgetWarning(TensorHooksError, UserWarning):  # noqa: N818  # a warning category
    """A planned step may hold more than the plan's budget, and the plan cannot prevent it.

    Warned once per plan with the figures: a step whose input sizes outgrow what any plan fits
    in the budget, a measured peak above the budget, or a Hugging Face layer in eval mode that
    keeps its KV cache and so is not recomputed. Turn it into an error with
    ``warnings.simplefilter("error", tensorhooks.PlanBudgetWarning)``. A ``UserWarning``, as
    torch's own warnings about a setting it cannot honour, and a `TensorHooksError` like every
    class here.
    """
