"""tensorhooks: faster, safer saved-tensor hooks and multi-grad hooks for PyTorch autograd.

The public names mirror `torch.autograd.graph` (same signatures and defaults), so
``import tensorhooks as graph`` works in code written for torch.
"""

from importlib import metadata as _metadata

from torch.utils.checkpoint import CheckpointError as CheckpointError

from . import distributed as distributed
from ._activation_offload import OffloadStats as OffloadStats
from ._activation_offload import save_on_cpu as save_on_cpu
from ._checkpoint import checkpoint as checkpoint
from ._checkpoint import (
    create_selective_checkpoint_contexts as create_selective_checkpoint_contexts,
)
from ._checkpoint import is_recomputing as is_recomputing
from ._core.errors import CheckpointArgumentTypeError as CheckpointArgumentTypeError
from ._core.errors import CheckpointArgumentValueError as CheckpointArgumentValueError
from ._core.errors import GradientSyncError as GradientSyncError
from ._core.errors import GraphTaskError as GraphTaskError
from ._core.errors import HookArgumentTypeError as HookArgumentTypeError
from ._core.errors import HookArgumentValueError as HookArgumentValueError
from ._core.errors import InvalidHookArgumentError as InvalidHookArgumentError
from ._core.errors import InvalidHookModeError as InvalidHookModeError
from ._core.errors import InvalidOffloadOptionError as InvalidOffloadOptionError
from ._core.errors import InvalidSyncArgumentError as InvalidSyncArgumentError
from ._core.errors import MutationContextExitedError as MutationContextExitedError
from ._core.errors import OffloadArgumentValueError as OffloadArgumentValueError
from ._core.errors import OffloadCaptureError as OffloadCaptureError
from ._core.errors import ParameterOffloadDeviceError as ParameterOffloadDeviceError
from ._core.errors import ParameterOffloadStateError as ParameterOffloadStateError
from ._core.errors import ParameterOffloadTypeError as ParameterOffloadTypeError
from ._core.errors import ParameterOffloadValueError as ParameterOffloadValueError
from ._core.errors import PlanArgumentTypeError as PlanArgumentTypeError
from ._core.errors import PlanArgumentValueError as PlanArgumentValueError
from ._core.errors import PlanBudgetError as PlanBudgetError
from ._core.errors import PlanBudgetWarning as PlanBudgetWarning
from ._core.errors import PlanStateError as PlanStateError
from ._core.errors import SavedTensorModifiedError as SavedTensorModifiedError
from ._core.errors import SyncArgumentTypeError as SyncArgumentTypeError
from ._core.errors import SyncArgumentValueError as SyncArgumentValueError
from ._core.errors import TensorHooksError as TensorHooksError
from ._core.errors import UnguardedHooksError as UnguardedHooksError
from ._core.graph import GradientEdge as GradientEdge
from ._core.graph import Node as Node
from ._core.graph import get_gradient_edge as get_gradient_edge
from ._core.graph import increment_version as increment_version
from ._core.graph import torch_only_names as _torch_only_names
from ._core.store import live_graph_tasks as live_graph_tasks
from ._core.torch_compat import CheckpointPolicy as CheckpointPolicy
from ._hooks import disable_saved_tensors_hooks as disable_saved_tensors_hooks
from ._hooks import register_multi_grad_hook as register_multi_grad_hook
from ._hooks import saved_tensors_hooks as saved_tensors_hooks
from ._mutation import MutationContext as MutationContext
from ._mutation import allow_mutation_on_saved_tensors as allow_mutation_on_saved_tensors
from ._parameter_offload import CudaTransfer as CudaTransfer
from ._parameter_offload import ParameterOffloadHandle as ParameterOffloadHandle
from ._parameter_offload import ParameterTransfer as ParameterTransfer
from ._parameter_offload import offload_parameters as offload_parameters
from ._planner import ActivationPlan as ActivationPlan
from ._planner import ActivationPlanHandle as ActivationPlanHandle
from ._planner import BlockPlan as BlockPlan
from ._planner import Explanation as Explanation
from ._planner import HeldTensor as HeldTensor
from ._planner import Lint as Lint
from ._planner import PlanReport as PlanReport
from ._planner import StepProfile as StepProfile
from ._planner import explain as explain
from ._planner import plan_activations as plan_activations
from ._planner import profile_step as profile_step

try:
    __version__ = _metadata.version("tensorhooks")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# The rest of the installed torch's torch.autograd.graph.__all__ (names that only some torch
# releases have), so that `import tensorhooks as graph` finds every one. Outside __all__, which
# lists what every supported torch has.
globals().update(_torch_only_names())

__all__ = [
    "ActivationPlan",
    "ActivationPlanHandle",
    "BlockPlan",
    "CheckpointArgumentTypeError",
    "CheckpointArgumentValueError",
    "CheckpointError",
    "CheckpointPolicy",
    "CudaTransfer",
    "Explanation",
    "GradientEdge",
    "GradientSyncError",
    "GraphTaskError",
    "HeldTensor",
    "HookArgumentTypeError",
    "HookArgumentValueError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "Lint",
    "MutationContext",
    "MutationContextExitedError",
    "Node",
    "OffloadArgumentValueError",
    "OffloadCaptureError",
    "OffloadStats",
    "ParameterOffloadDeviceError",
    "ParameterOffloadHandle",
    "ParameterOffloadStateError",
    "ParameterOffloadTypeError",
    "ParameterOffloadValueError",
    "ParameterTransfer",
    "PlanArgumentTypeError",
    "PlanArgumentValueError",
    "PlanBudgetError",
    "PlanBudgetWarning",
    "PlanReport",
    "PlanStateError",
    "SavedTensorModifiedError",
    "StepProfile",
    "SyncArgumentTypeError",
    "SyncArgumentValueError",
    "TensorHooksError",
    "UnguardedHooksError",
    "allow_mutation_on_saved_tensors",
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "disable_saved_tensors_hooks",
    "distributed",
    "explain",
    "get_gradient_edge",
    "increment_version",
    "is_recomputing",
    "live_graph_tasks",
    "offload_parameters",
    "plan_activations",
    "profile_step",
    "register_multi_grad_hook",
    "save_on_cpu",
    "saved_tensors_hooks",
]
