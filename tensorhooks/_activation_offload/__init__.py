"""save_on_cpu: saved activations copied to host memory in forward and back in backward.

- `save_on_cpu`: the context manager and its hooks.
- `session`: per-context options and what one forward pass offloaded.
- `records`: a saved tensor's host copy, its copy-back and the prefetch timeline.
- `copy_engines`: the streams copies run on (injectable: tests use a simulated device).
- `pinned_pool`: pooled pinned host buffers, and the bytes moved through them.
"""

from .context import save_on_cpu
from .pinned_pool import OffloadStats

__all__ = ["OffloadStats", "save_on_cpu"]
