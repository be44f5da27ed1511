"""checkpoint: activation checkpointing on saved-tensor hooks, with selective policies.

- `checkpoint`: regions, their recomputation in backward, and the compiled path.
- `policies`: selective checkpointing, each op saved, recomputed or offloaded.
"""

from .policies import create_selective_checkpoint_contexts
from .region import checkpoint, is_recomputing

__all__ = ["checkpoint", "create_selective_checkpoint_contexts", "is_recomputing"]
