"""checkpoint: activation checkpointing on saved-tensor hooks, with selective policies.

- `region`: `checkpoint` itself: a call's options, its forward pass, the compiled path.
- `recomputation`: a region's frame, what its forward saved, its recomputation in backward.
- `arguments`: the tensors among a call's arguments, saved as inputs and put back.
- `replay`: the RNG, autocast and default-device state replayed in recomputation.
- `policies`: selective checkpointing, each op saved, recomputed or offloaded.
- `state`, `reads`: what a region reads outside its arguments, and recomputation held to it.
"""

from .policies import create_selective_checkpoint_contexts
from .reads import watch_optimizer_steps
from .recomputation import is_recomputing
from .region import checkpoint

__all__ = ["checkpoint", "create_selective_checkpoint_contexts", "is_recomputing"]

watch_optimizer_steps()  # fused optimizer steps move versions: NOTE [Reads recorded as ...]
