"""Gradient averaging across processes, started from multi-grad hooks while backward runs.

`sync_gradients` does what the reducer of
`torch.nn.parallel.DistributedDataParallel` does, without wrapping the module: the
parameters are grouped into buckets, one ``"all"`` multi-grad hook per bucket starts an
asynchronous ``all_reduce`` on `torch.distributed` as soon as the bucket's gradients are
complete, and at the end of backward every ``.grad`` holds the average across processes.

See NOTE [What a bucket averages] in `tensorhooks/_distributed/sync.py`.
"""

from __future__ import annotations

from ._distributed import GradientSyncHandle, sync_gradients

__all__ = ["GradientSyncHandle", "sync_gradients"]
