"""Gradient buckets: which parameters are averaged together, and their flat buffers.

A bucket is a group of parameters of one dtype and device whose gradients travel in one
``all_reduce``. Each bucket owns one flat buffer, allocated once and reused by every step: the
scaled gradients first, then one flag per parameter (1 where this process computed the
parameter's gradient in the step or in a ``no_sync()`` step since the last synchronised one, 0
where it did not), so that after the all-reduce a flag of 0 means the parameter was unused on
every process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import Node

from tensorhooks._core.errors import GradientSyncError
from tensorhooks._core.graph import grad_node

__all__ = ["MIB", "Bucket", "assign_buckets"]

MIB = 1024 * 1024
"""Bytes in a mebibyte: ``bucket_cap_mb`` counts MiB, as DistributedDataParallel does."""


def assign_buckets(
    params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Group parameters into buckets, in the order their gradients are expected to be ready.

    Parameters are taken in reverse order (backward reaches the last layers first) and grouped
    by ``(dtype, device)``. A bucket is closed before a parameter would take it past
    ``cap_bytes``; a parameter larger than that gets a bucket of its own. The first bucket of
    each group is also closed as soon as it holds ``first_cap_bytes``, so that the first
    all-reduce starts right after the last layer's gradients, as in DistributedDataParallel's
    buckets once it has seen one backward (its first bucket is closed at 1 MiB or more).

    Args:
        params: the parameters, in registration order.
        cap_bytes: the largest size of a bucket, in bytes.
        first_cap_bytes: the size at which the first bucket of each ``(dtype, device)`` is
            closed.

    Returns:
        Buckets as lists of indices into ``params``, each in reverse registration order, the
        buckets ordered by their first index in reverse registration order.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    buckets: list[list[int]] = []
    for index in reversed(range(len(params))):
        param = params[index]
        key = (param.dtype, param.device)
        size = param.numel() * param.element_size()
        first = closed_count.get(key, 0) == 0
        members, used = open_buckets.get(key, ([], 0))
        if members and (used + size > cap_bytes or (first and used >= first_cap_bytes)):
            buckets.append(members)
            closed_count[key] = closed_count.get(key, 0) + 1
            members, used = [], 0
        members.append(index)
        open_buckets[key] = (members, used + size)
    buckets.extend(members for members, _ in open_buckets.values())
    # Reverse registration order is descending index: the bucket holding the highest index of
    # those not yet placed is the one whose gradients are expected first.
    buckets.sort(key=lambda members: -members[0])
    return buckets


class Bucket:
    """The parameters of one bucket and the flat buffer their gradients are averaged in.

    ``views[i]`` is the part of ``flat`` that holds ``params[i]``'s gradient, shaped like the
    parameter; ``flags`` is the tail of ``flat`` holding one used-flag per parameter.
    ``used_since_sync[i]`` records that ``params[i]`` got a gradient, accumulated into ``.grad``,
    in a backward that did not synchronise since the last one that did.
    """

    __slots__ = (
        "accumulators",
        "flags",
        "flat",
        "params",
        "position_of_node",
        "used_since_sync",
        "views",
    )

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = tuple(params)
        # The accumulator nodes are kept alive here: autograd caches them weakly, and the
        # identity of the node running a hook tells which parameter's gradient is not yet
        # accumulated into .grad (see NOTE [What a bucket averages] in `sync.py`).
        self.accumulators: tuple[Node, ...] = tuple(map(grad_node, self.params))
        self.position_of_node = {id(node): i for i, node in enumerate(self.accumulators)}
        sizes = [param.numel() for param in self.params]
        total = sum(sizes)
        first = self.params[0]
        self.flat = torch.zeros(total + len(sizes), dtype=first.dtype, device=first.device)
        views: list[torch.Tensor] = []
        offset = 0
        for param, size in zip(self.params, sizes, strict=True):
            views.append(self.flat[offset : offset + size].view(param.shape))
            offset += size
        self.views = tuple(views)
        self.flags = self.flat[total:]
        self.used_since_sync = [False] * len(self.params)

    def note_used(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Record the parameters that got a gradient in a backward that does not synchronise."""
        for position, grad in enumerate(grads):
            if grad is not None:
                self.used_since_sync[position] = True

    def fill(self, grads: Sequence[torch.Tensor | None], scale: float) -> bool:
        """Write ``scale`` times each parameter's ``.grad`` into the buffer.

        Called once every parameter of the bucket that gets a gradient in the step has had it
        accumulated into ``.grad`` and its hooks run: the values averaged are the ``.grad``
        that accumulation and the hooks produced, as DistributedDataParallel's reducer reads
        them (see NOTE [What a bucket averages] in `sync.py`).

        Args:
            grads: the gradients the bucket's multi-grad hook received, ``None`` where this
                process computed none in the step; only which are ``None`` is used.
            scale: the factor applied to every gradient (one over the world size).

        Returns:
            Whether some parameter got no gradient on this process, neither in this step nor in
            a ``no_sync()`` step since the last synchronised one.

        Raises:
            GradientSyncError: if a gradient is not a dense (strided) tensor (a
                ``RuntimeError``).
        """
        idle = False
        for position, (param, view, grad) in enumerate(
            zip(self.params, self.views, grads, strict=True)
        ):
            held = param.grad
            _check_dense(param, held)
            if grad is None:
                idle = idle or not self.used_since_sync[position]
            else:
                _check_dense(param, grad)
            _write_scaled(view, held, scale)
        if idle:
            used = [
                grad is not None or earlier
                for grad, earlier in zip(grads, self.used_since_sync, strict=True)
            ]
            self._write_flags(used)
        else:
            self.flags.fill_(1)
        return idle

    def fill_idle(self, scale: float) -> None:
        """Write the buffer for a step in which this process computed none of its gradients."""
        for param, view in zip(self.params, self.views, strict=True):
            _write_scaled(view, param.grad, scale)
        if any(self.used_since_sync):
            self._write_flags(self.used_since_sync)
        else:
            self.flags.zero_()

    def _write_flags(self, used: Sequence[bool]) -> None:
        # One copy rather than one kernel per flag. The source is pageable: non_blocking lets the
        # driver stage it without waiting for the device (as ``fill_`` would not wait).
        values = torch.tensor(used, dtype=self.flags.dtype)
        self.flags.copy_(values, non_blocking=True)

    def write_back(self, idle: bool) -> None:
        """Copy the averaged gradients from the buffer into each parameter's ``.grad``.

        Args:
            idle: whether some parameter got no gradient on this process; only then are the
                flags read, and a parameter that no process computed a gradient for is left
                untouched.

        The record of ``no_sync()`` usage is cleared: what it covered has now been averaged.
        """
        used: Sequence[float] = self.flags.tolist() if idle else ()
        for position, (param, view) in enumerate(zip(self.params, self.views, strict=True)):
            if idle and used[position] == 0:
                continue
            held = param.grad
            if held is None:
                param.grad = torch.empty_like(param, memory_format=torch.preserve_format)
                param.grad.copy_(view)
            else:
                held.copy_(view)
        self.used_since_sync = [False] * len(self.params)


def _write_scaled(out: torch.Tensor, grad: torch.Tensor | None, scale: float) -> None:
    if grad is None:
        out.zero_()
    elif scale == 1.0:
        out.copy_(grad)
    elif grad.device != out.device:
        # A host .grad (offload_parameters) into a device buffer: same rounding, one multiply.
        out.copy_(grad).mul_(scale)
    else:
        # One pass, as DistributedDataParallel's reducer divides while copying into its bucket.
        torch.mul(grad, scale, out=out)


def _check_dense(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None and grad.layout != torch.strided:
        raise GradientSyncError(
            f"sync_gradients: a parameter of shape {tuple(param.shape)} got a gradient with "
            f"layout {grad.layout}; only dense (torch.strided) gradients can be averaged; "
            "create sparse modules (nn.Embedding(sparse=True)) with sparse=False"
        )
