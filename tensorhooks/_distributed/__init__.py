"""sync_gradients: bucketed gradient averaging on torch.distributed, from multi-grad hooks.

- `sync_gradients`: the buckets' hooks, the all-reduces and the end-of-backward wait.
- `buckets`: how parameters are grouped into buckets.
"""

from .sync import GradientSyncHandle, sync_gradients

__all__ = ["GradientSyncHandle", "sync_gradients"]
