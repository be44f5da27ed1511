"""What checkpointing and a selective policy cost beyond the ops they run, on this machine.

See NOTE [Costs that do not depend on the model] below.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .apply import FULL, KEEP, SAVE, Action, Application
from .recording import StepClock, record

__all__ = ["Overheads", "overheads"]

# NOTE [Costs that do not depend on the model]
#
# Four figures of the time model are the machinery's, not the model's: what checkpointing a
# block costs beyond its recomputation (its hooks, the RNG state it stashes), what a selective
# policy costs per op it is asked about (forward and recomputation), what caching one op's
# output costs it, and what recording costs per op beyond what the recorder measures of itself
# (torch's dispatch to a Python mode: the recorded step's time, less this, is the step's own).
# They are measured once per process and device on a tiny stack of blocks of
# cheap elementwise ops, the best of a few repetitions of each variant (no plan, every block
# recomputed, a policy caching nothing, a policy caching every op), rather than on the model's
# own step: no run of the step is spent on them, and their noise does not depend on the model.

_BLOCKS = 4
_OPS = (
    torch.ops.aten.sin.default,
    torch.ops.aten.cos.default,
    torch.ops.aten.exp.default,
    torch.ops.aten.tanh.default,
    torch.ops.aten.sigmoid.default,
    torch.ops.aten.neg.default,
)


@dataclass(frozen=True)
class Overheads:
    """Seconds the machinery costs: per checkpointed block, per op a policy sees, per cached op."""

    checkpoint_seconds: float
    policy_op_seconds: float
    cached_op_seconds: float
    dispatch_op_seconds: float = 0.0
    """What recording costs per op beyond the recorder's own bookkeeping (torch's dispatch to
    a Python mode and back): what the recorded step's time is less of, per op recorded."""


class _Cheap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos().exp().tanh().sigmoid().neg()


def _best(run: Callable[[], None], sync: Callable[[], None], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        for _ in range(3):
            run()
        sync()
        best = min(best, (time.perf_counter() - began) / 3)
    return best


@functools.cache
def overheads(device: torch.device) -> Overheads:
    """The `Overheads` of ``device``, measured once per process (see NOTE above)."""
    blocks: list[nn.Module] = [_Cheap() for _ in range(_BLOCKS)]
    # Not random: calibrating must leave the random number generators as they were.
    x = torch.linspace(-1.0, 1.0, 64, device=device).reshape(8, 8).requires_grad_()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward() -> None:
        h = x
        for block in blocks:
            h = block(h)
        h.sum().backward()  # type: ignore[no-untyped-call]

    def timed(actions: list[Action]) -> float:
        application = Application(blocks, actions, caller="profile_step")
        application.install()
        try:
            return _best(forward, sync)
        finally:
            application.remove()

    every = {(op, 0): SAVE for op in _OPS}
    forward()  # warm up

    plain = timed([KEEP] * _BLOCKS)
    stack = nn.Sequential(*blocks)
    recorded = [
        record(stack, blocks, forward, StepClock(device), keep=True, caller="profile_step")
        for _ in range(3)
    ]
    residual = min(
        (recorder.step_seconds - recorder.overhead_total - plain) / max(recorder.op_count, 1)
        for recorder in recorded
    )
    full = timed([FULL] * _BLOCKS)
    policy = timed([Action(checkpoint=True, selective=True)] * _BLOCKS)
    cached = timed([Action(checkpoint=True, cached=every, selective=True)] * _BLOCKS)
    with torch.enable_grad():
        again = _best(lambda: _forward_only(blocks, x), sync)
    x.grad = None
    return Overheads(
        checkpoint_seconds=max(0.0, (full - plain - again) / _BLOCKS),
        policy_op_seconds=max(0.0, (policy - full) / (2 * _BLOCKS * len(_OPS))),
        cached_op_seconds=max(0.0, (cached - policy) / (_BLOCKS * len(_OPS))),
        dispatch_op_seconds=max(0.0, residual),
    )


def _forward_only(blocks: Sequence[nn.Module], x: torch.Tensor) -> None:
    h = x
    for block in blocks:
        h = block(h)
