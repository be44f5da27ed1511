"""Every case of the demo, in the order it shows them: the one list to extend."""

from __future__ import annotations

from .activation_offload import SAVE_ON_CPU
from .case import Case
from .checkpoint import (
    CHECKPOINT_GRAD,
    CHECKPOINT_OFFLOAD_POLICY,
    CHECKPOINT_STATE,
    CHECKPOINT_WRITE,
)
from .distributed import SYNC_GRADIENTS
from .explain import EXPLAIN
from .hooks import (
    DISABLE_SAVED_TENSORS_HOOKS,
    MULTI_GRAD_HOOK_FAILED_BACKWARD,
    MULTI_GRAD_HOOK_THREADS,
    SAVED_TENSORS_HOOKS,
)
from .mutation import ALLOW_MUTATION
from .parameter_offload import OFFLOAD_PARAMETERS
from .planner import PLAN_ACTIVATIONS

__all__ = ["CASES"]

CASES: tuple[Case, ...] = (
    SAVED_TENSORS_HOOKS,
    DISABLE_SAVED_TENSORS_HOOKS,
    SAVE_ON_CPU,
    ALLOW_MUTATION,
    MULTI_GRAD_HOOK_FAILED_BACKWARD,
    MULTI_GRAD_HOOK_THREADS,
    SYNC_GRADIENTS,
    CHECKPOINT_WRITE,
    CHECKPOINT_STATE,
    CHECKPOINT_GRAD,
    CHECKPOINT_OFFLOAD_POLICY,
    OFFLOAD_PARAMETERS,
    PLAN_ACTIVATIONS,
    EXPLAIN,
)
