"""Plans under FSDP2: every rank of the model's mesh plans from one profile.

See NOTE [Plans under FSDP2] below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from tensorhooks._core.errors import PlanStateError
from tensorhooks._core.torch_compat import fsdp_meshes

__all__ = ["agreed", "figures", "largest", "together"]

# NOTE [Plans under FSDP2]
#
# What a plan counts. FSDP2 (`fully_shard`) all-gathers a block's parameters into buffers of
# its own before the block's forward and registers views of them on the module, so the ops save
# those, not the model's (sharded) parameters; after the forward it frees the buffers (resizes
# their storage to 0) and gathers into them again before the backward. They are parameters, not
# activations: the budget leaves them out like the model's own, by the storages FSDP2 keeps
# for them (`fsdp_unsharded_tensors`, used by `accounting.module_keys`). The buffers are made at
# the first forward; `profile_step` runs a step before anything it measures, so they are known by
# then.
#
# One plan for every rank. Ranks may differ: uneven shards (the last rank's is smaller), inputs
# of other lengths, a slower host. Each rank profiles its own step, then the ranks of each mesh
# that shards the model agree on one profile: every byte and time figure is the largest over the
# ranks (all-reduced with MAX over each dimension of the mesh, which is the largest over the
# whole mesh), the host link the slowest. Each rank then solves the same table and gets the same
# plan, with a budget that the rank holding the most fits, so every rank fits it. One plan rather
# than one per rank because a data-parallel step is as slow as its slowest rank (a rank planned
# faster only waits at the next collective), and because every rank then runs the same
# recomputations: what runs inside a block (a collective of tensor parallelism, say) stays in
# step across ranks. The profile's structure (blocks, ops, which outputs a policy may cache) must
# be the same on every rank: it is compared first, and a difference raises. The device stays each
# rank's own.
#
# A failure on one rank fails them all. Were one rank to raise while profiling, the others would
# wait in the next collective until the process group's timeout (half an hour by default). So
# profiling runs in two stages, each ended by `together`: every rank all-reduces whether it
# failed (and its rank) before any figure is exchanged. The failing rank raises its own error;
# the others a PlanStateError that names it. The first stage checks the arguments and the model
# (no collective runs there, so every rank reaches its end); the second runs the profiled steps
# and summarizes them. A step that raises on one rank while the others are inside one of FSDP2's
# own collectives (an all-gather in the forward) is not covered: they wait there, as FSDP2 does
# without tensorhooks; the failing process exiting (torchrun then stops the others) ends it.

_Profile = TypeVar("_Profile")

# Figures where less is the worse case: the host link's bandwidth.
_SLOWEST = frozenset({"bandwidth"})
# Fields each rank keeps as its own: the device ("cuda:0" on one rank, "cuda:1" on the next),
# and how its bytes grow with its inputs' sizes (its own shapes; a plan is not made again per
# shape under FSDP2, see NOTE [Sizes that vary between steps] in `shapes`).
_OWN = frozenset({"device", "sizes"})


def _walk(value: Any, name: str, numbers: list[float], shape: list[str]) -> None:
    """Collect the figures of ``value`` (signed so that MAX is the worse case), and its shape."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        shape.append(repr(value))
    elif isinstance(value, (int, float)):
        shape.append(type(value).__name__)
        numbers.append(-float(value) if name in _SLOWEST else float(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        shape.append(type(value).__name__)
        for field in dataclasses.fields(value):
            if field.name not in _OWN:
                _walk(getattr(value, field.name), field.name, numbers, shape)
    elif isinstance(value, tuple):
        shape.append(f"({len(value)}")
        for item in value:
            _walk(item, name, numbers, shape)
        shape.append(")")
    else:  # an operator
        shape.append(str(value))


def figures(profile: object) -> tuple[list[float], float]:
    """The figures the ranks agree on, and a signature of the rest (equal on every rank)."""
    numbers: list[float] = []
    shape: list[str] = []
    _walk(profile, "", numbers, shape)
    return numbers, float(zlib.crc32(" ".join(shape).encode()))


def _rebuilt(value: Any, name: str, numbers: Iterator[float]) -> Any:
    """``value`` with its figures taken from ``numbers``, in the order `_walk` collected them."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        number = next(numbers)
        number = -number if name in _SLOWEST else number
        return round(number) if isinstance(value, int) else number
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            field.name: _rebuilt(getattr(value, field.name), field.name, numbers)
            for field in dataclasses.fields(value)
            if field.name not in _OWN
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(_rebuilt(item, name, numbers) for item in value)
    return value


def _groups(model: nn.Module) -> list[tuple[Any, str]]:
    """The process group of every dimension of every mesh sharding ``model``, with its device."""
    return [
        (mesh.get_group(dim), mesh.device_type)
        for mesh in fsdp_meshes(model)
        for dim in range(mesh.ndim)
    ]


@contextlib.contextmanager
def together(model: object, caller: str) -> Iterator[None]:
    """Run the body on every rank of the meshes sharding ``model``: if one rank raises, all do.

    A collective at the body's end, on success and failure alike (see NOTE [Plans under FSDP2]).
    The failing rank re-raises its own error; every other rank raises `PlanStateError` naming
    the lowest failing rank. Without ``fully_shard`` in ``model``, the body alone.
    """
    groups = _groups(model) if isinstance(model, nn.Module) else []
    failure: BaseException | None = None
    try:
        yield
    except BaseException as error:
        if not groups or not isinstance(error, Exception):
            raise  # one process; or an interrupt, which must not wait for the others
        failure = error
    if not groups:
        return
    rank = torch.distributed.get_rank()
    # The lowest failing rank: MAX over (world - rank) for the failed, 0 for the rest.
    world = torch.distributed.get_world_size()
    flags = _all_max(torch.tensor([float(world - rank if failure else 0)]), groups)
    if failure is not None:
        raise failure
    if flags[0].item() > 0:
        failed = world - round(flags[0].item())
        raise PlanStateError(
            f"{caller}: rank {failed} raised while profiling the step, so no rank can plan; "
            f"its error is in rank {failed}'s output. Fix it there; every rank of the mesh "
            "must profile the same step"
        )


def _all_max(values: torch.Tensor, groups: list[tuple[Any, str]]) -> torch.Tensor:
    for group, device in groups:
        values = values.to(device)
        torch.distributed.all_reduce(values, torch.distributed.ReduceOp.MAX, group=group)
    return values.cpu()


def largest(value: int, model: nn.Module) -> int:
    """``value``'s largest over the ranks of the meshes sharding ``model``; itself without FSDP2.

    A collective: every rank of those meshes calls it.
    """
    groups = _groups(model)
    if not groups:
        return value
    return round(_all_max(torch.tensor([float(value)], dtype=torch.float64), groups)[0].item())


def agreed(profile: _Profile, model: nn.Module) -> _Profile:
    """``profile``, made the same on every rank of the meshes that shard ``model`` with FSDP2.

    Every figure becomes its worst case over the ranks: bytes and times their largest, the host
    link's bandwidth its smallest (see NOTE [Plans under FSDP2]). A collective: every rank of
    those meshes calls it. Without ``fully_shard`` in ``model``, ``profile`` unchanged.

    Raises:
        PlanStateError: if the ranks profiled steps of another structure (other blocks or
            ops), which one plan cannot fit.
    """
    groups = _groups(model)
    if not groups:
        return profile
    numbers, signature = figures(profile)
    check = _all_max(torch.tensor([signature, -signature], dtype=torch.float64), groups)
    if check[0].item() != signature or -check[1].item() != signature:
        raise PlanStateError(
            "profile_step: the ranks sharding the model with fully_shard profiled steps of "
            "another structure (other blocks, ops or cacheable outputs), so no one plan fits "
            "them all; run the same step on every rank (same model, same kind of input)"
        )
    worst = _all_max(torch.tensor(numbers, dtype=torch.float64), groups)
    return _rebuilt(profile, "", iter(worst.tolist()))  # type: ignore[no-any-return]
