"""What the checkpoint tests share: small float64 weights and blocks, op and byte counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy


def torch_ckpt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach it (those a selective context does not answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Any, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w1 = torch.randn(6, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(6, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    return w1, w2


def input_tensor(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, generator=generator, dtype=torch.float64, requires_grad=True)


def block_of(w1: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(x: torch.Tensor) -> torch.Tensor:
        return (torch.mm(x, w1).sin().exp() @ w2).tanh()

    return block


def grads(run: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(run().sum(), list(inputs)))


def assert_same(left: Sequence[torch.Tensor], right: Sequence[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def mm_policy(choice: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    """A policy applying ``choice`` to ``aten.mm`` and recomputing every other op."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return choice if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class LiveBytes(TorchDispatchMode):
    """The peak of bytes held by storages that ops made while it is active (forward and backward).

    After every op it adds up the storages still alive that any op made since it was entered
    (tensors made before, such as parameters and inputs, are left out): what a step holds beyond
    its model, as an allocator would count it, less transient buffers inside one op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        live = self.live
        for key in [key for key, (ref, _) in live.items() if ref.expired()]:
            del live[key]
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                if storage._cdata not in live:
                    live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in live.values()))
        return out
