"""checkpoint: activation checkpointing on saved-tensor hooks, with selective policies.

- `region`: `checkpoint` itself: a call's options, its forward pass, the compiled path.
- `recomputation`: a region's frame, what its forward saved, its recomputation in backward.
- `arguments`: the tensors among a call's arguments, saved as inputs and put back.
- `replay`: the RNG, autocast and default-device state replayed in recomputation.
- `policies`: selective checkpointing, each op saved, recomputed or offloaded.
- `state`, `reads`: what a region reads outside its arguments, and recomputation held to it.
- `sequential`: `checkpoint_sequential`, a sequence cut into checkpointed segments.
- `module`: `checkpoint_module`, a module's forward checkpointed from its hooks.
"""

from .module import checkpoint_module
from .policies import create_selective_checkpoint_contexts
from .reads import watch_optimizer_steps
from .recomputation import is_recomputing
from .region import checkpoint, noop_context_fn
from .sequential import checkpoint_sequential

__all__ = [
    "checkpoint",
    "checkpoint_module",
    "checkpoint_sequential",
    "create_selective_checkpoint_contexts",
    "is_recomputing",
    "noop_context_fn",
]

watch_optimizer_steps()  # fused optimizer steps move versions: NOTE [Reads recorded as ...]
