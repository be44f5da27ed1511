"""tensorhooks: faster, safer saved-tensor hooks and multi-grad hooks for PyTorch autograd.

The public names mirror `torch.autograd.graph` (same signatures and defaults), so
``import tensorhooks as graph`` works in code written for torch.
"""

from . import distributed as distributed
from ._errors import GradientSyncError as GradientSyncError
from ._errors import GraphTaskError as GraphTaskError
from ._errors import InvalidHookArgumentError as InvalidHookArgumentError
from ._errors import InvalidHookModeError as InvalidHookModeError
from ._errors import InvalidOffloadOptionError as InvalidOffloadOptionError
from ._errors import InvalidSyncArgumentError as InvalidSyncArgumentError
from ._errors import MutationContextExitedError as MutationContextExitedError
from ._errors import SavedTensorModifiedError as SavedTensorModifiedError
from ._errors import TensorHooksError as TensorHooksError
from ._errors import UnguardedHooksError as UnguardedHooksError
from ._multigrad import register_multi_grad_hook as register_multi_grad_hook
from ._mutation import MutationContext as MutationContext
from ._mutation import allow_mutation_on_saved_tensors as allow_mutation_on_saved_tensors
from ._offload import save_on_cpu as save_on_cpu
from ._saved import disable_saved_tensors_hooks as disable_saved_tensors_hooks
from ._saved import saved_tensors_hooks as saved_tensors_hooks
from ._store import live_graph_tasks as live_graph_tasks

__version__ = "0.1.0"

__all__ = [
    "GradientSyncError",
    "GraphTaskError",
    "InvalidHookArgumentError",
    "InvalidHookModeError",
    "InvalidOffloadOptionError",
    "InvalidSyncArgumentError",
    "MutationContext",
    "MutationContextExitedError",
    "SavedTensorModifiedError",
    "TensorHooksError",
    "UnguardedHooksError",
    "allow_mutation_on_saved_tensors",
    "disable_saved_tensors_hooks",
    "distributed",
    "live_graph_tasks",
    "register_multi_grad_hook",
    "save_on_cpu",
    "saved_tensors_hooks",
]
