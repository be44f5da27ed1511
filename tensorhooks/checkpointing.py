"""Every name of `torch.utils.checkpoint`, with tensorhooks' checkpoint: change one import line.

```python
import tensorhooks.checkpointing as checkpoint_utils  # was: import torch.utils.checkpoint
from tensorhooks.checkpointing import checkpoint, checkpoint_sequential  # was: torch's
```

``checkpoint`` and ``checkpoint_sequential`` are tensorhooks' (the non-reentrant, hook-based
variant; ``torch.autograd.grad`` works), as are ``create_selective_checkpoint_contexts`` (which
honours ``*_CPU_OFFLOAD`` in eager mode) and ``noop_context_fn``. The rest are torch's own
objects, re-exported unchanged: ``set_checkpoint_early_stop`` and
``set_checkpoint_debug_enabled`` steer tensorhooks' checkpoint as they steer torch's.
``checkpoint_module`` is the counterpart of torch's composable
``torch.distributed._composable.checkpoint(module)``.

See docs/checkpointing.md, and docs/differences.md for where the behaviour differs.
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint
from torch.utils.checkpoint import (
    CheckpointError,
    CheckpointFunction,
    DefaultDeviceType,
    SelectiveCheckpointContext,
    check_backward_validity,
    detach_variable,
    get_device_states,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
    set_device_states,
)

from ._checkpoint import (
    checkpoint,
    checkpoint_module,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from ._core.torch_compat import CheckpointPolicy

# The names of the installed torch's torch.utils.checkpoint.__all__ not bound above: those only
# some supported releases have (GraphExecGroup, SAC_IGNORED_OPS), torch's own objects.
_TORCH_ONLY = {
    name: getattr(_torch_checkpoint, name)
    for name in getattr(_torch_checkpoint, "__all__", ())
    if name not in globals()
}
globals().update(_TORCH_ONLY)

__all__ = [
    "CheckpointError",
    "CheckpointFunction",
    "CheckpointPolicy",
    "DefaultDeviceType",
    "SelectiveCheckpointContext",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "get_device_states",
    "noop_context_fn",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]
__all__ += sorted(_TORCH_ONLY)  # noqa: PLE0605 (the installed torch's extra names)
