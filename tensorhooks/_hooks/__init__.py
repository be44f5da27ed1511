"""The primitives: saved-tensor hooks and multi-grad hooks, as in ``torch.autograd.graph``."""

from .multigrad import MultiGradHandle, register_multi_grad_hook
from .saved import disable_saved_tensors_hooks, saved_tensors_hooks

__all__ = [
    "MultiGradHandle",
    "disable_saved_tensors_hooks",
    "register_multi_grad_hook",
    "saved_tensors_hooks",
]
