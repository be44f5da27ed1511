"""sync_gradients over NCCL in one process (world size 1), against DistributedDataParallel.

One process joins a process group of one (NCCL on the GPU, gloo in a dry run), so the NCCL path
of ``tensorhooks.distributed.sync_gradients`` runs for real: buckets filled from the gradients,
``all_reduce`` launched asynchronously during backward, waited for and written back at its end.
Recorded: the number of ``all_reduce`` calls the profiler sees in one synchronised backward
against the number of buckets; the gradients read back from the buckets against the same
step's without any synchronisation and against DDP's (with one process the average is the
gradient itself, so they must be equal bit for bit); and the step time (forward, backward,
``p.grad = None``) of DDP, sync_gradients and no synchronisation, in interleaved rounds (CUDA
events), with the CPU target's bound (at most 1.10x DDP's step) evaluated here too.

Size on the GPU: an MLP of 8 x Linear(4096, 4096) + ReLU, fp32, batch 256: 512 MiB of gradients,
every 64 MiB weight in a bucket of its own (over the 25 MiB cap), a few milliseconds of compute
per step. A dry run uses 2 x Linear(32, 32) on the CPU.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from harness import mlp
from torch import nn

from . import common
from .common import MiB, attempt
from .record import FAILED, OK, Recorder, Target, evaluate

PART = "sync_gradients"


@dataclass(frozen=True)
class Size:
    """The MLP, its batch, and how long to time it."""

    layers: int
    width: int
    batch: int
    rounds: int
    inner: int


GPU_SIZE = Size(layers=8, width=4096, batch=256, rounds=10, inner=5)
DRY_SIZE = Size(layers=2, width=32, batch=8, rounds=2, inner=1)


def step_of(model: nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    """Forward, backward, ``p.grad = None``."""

    def step() -> None:
        model(batch).sum().backward()
        for param in model.parameters():
            param.grad = None

    return step


def grads_after_step(model: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    """The ``.grad`` of every parameter after one forward and backward (then cleared)."""
    model(batch).sum().backward()
    grads = []
    for param in model.parameters():
        assert param.grad is not None, "a parameter got no gradient"
        grads.append(param.grad)
        param.grad = None
    return grads


def all_reduce_calls(step: Callable[[], object], backend: str) -> int:
    """How many ``all_reduce`` collectives of ``backend`` the profiler sees in one call of step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        step()
    counts = Counter(event.name for event in profile.events())
    return counts[f"{backend}:all_reduce"]


def run(rec: Recorder, ctx: Any) -> None:
    """Measure, record the tables, evaluate the target."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from tensorhooks.distributed import sync_gradients  # noqa: PLC0415

    size = DRY_SIZE if ctx.dry_run else GPU_SIZE
    backend = common.init_single_process_group(ctx.device, ctx.scratch)
    base = mlp(size.layers, size.width).to(ctx.device)
    batch = torch.randn(size.batch, size.width, device=ctx.device)
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rec.note(
        f"MLP {size.layers} x Linear({size.width}, {size.width}) + ReLU, fp32, batch "
        f"{size.batch}: {gradient_bytes / MiB:,.0f} MiB of gradients; {backend}, world size "
        f"{dist.get_world_size()}; DDP and sync_gradients with 25 MiB buckets."
    )
    device_ids = [0] if ctx.device == "cuda" else None
    ddp = DistributedDataParallel(copy.deepcopy(base), device_ids=device_ids)
    ours = copy.deepcopy(base)
    handle = sync_gradients(ours, bucket_cap_mb=25.0)
    local = copy.deepcopy(base)
    steps = {
        "DDP": step_of(ddp, batch),
        "sync_gradients": step_of(ours, batch),
        "no sync (local)": step_of(local, batch),
    }
    errors: dict[str, str] = {}
    for name, step in steps.items():
        attempt(name, errors, lambda s=step: (s(), s()))
    calls = attempt(
        "sync_gradients", errors, lambda: all_reduce_calls(steps["sync_gradients"], backend)
    )
    _read_back(rec, ddp=ddp, ours=ours, local=local, batch=batch, errors=errors)
    rec.put("buckets", len(handle.buckets))
    rec.put("all_reduce_calls", calls)
    rec.note(
        f"sync_gradients: {len(handle.buckets)} buckets; the profiler saw {calls} {backend} "
        "all_reduce calls in one backward."
    )
    working = {name: step for name, step in steps.items() if name not in errors}
    timings = common.timed_rounds(working, rounds=size.rounds, inner=size.inner, device=ctx.device)
    rows = [
        [
            name,
            common.spread_ms(timings, name),
            common.ratio(timings, name, "DDP") if "DDP" in working else "-",
        ]
        for name in working
    ]
    rounds = len(next(iter(timings.samples.values()), []))
    rec.table(
        f"Step time (forward, backward, grads set to None), median (min-max) of {rounds} "
        f"interleaved rounds x {size.inner} steps",
        ["variant", "step", "x DDP"],
        rows,
    )
    rec.put("step_seconds", timings.samples)
    ratio = (
        timings.ratio("sync_gradients", "DDP")
        if {"DDP", "sync_gradients"} <= working.keys()
        else None
    )
    rec.target(
        evaluate(
            PART,
            "step over DDP's (NCCL, world size 1)",
            None if ratio is None else ratio.median,
            at_most=1.10,
            fmt="{:.3f}x",
            missing="a variant failed",
            detail="" if ratio is None else f"per-round range {ratio.format(digits=3)}",
        )
    )
    if ratio is not None:
        rec.summary(
            f"{ratio.median:.2f}x DDP's step; {calls} all_reduce calls for "
            f"{len(handle.buckets)} buckets"
        )
    handle.remove()
    del ddp
    dist.destroy_process_group()
    if errors:
        rec.table("Variants that failed", ["variant", "error"], list(map(list, errors.items())))
        rec.finish(FAILED, reason="failed: " + ", ".join(errors))
    else:
        rec.finish(OK)


def _read_back(
    rec: Recorder,
    *,
    ddp: nn.Module,
    ours: nn.Module,
    local: nn.Module,
    batch: torch.Tensor,
    errors: dict[str, str],
) -> None:
    """Gradients read back from sync_gradients' buckets and DDP's, against no synchronisation."""
    reference = grads_after_step(local, batch)
    rows = []
    for name, model in (("sync_gradients", ours), ("DDP", ddp)):
        got = attempt(name, errors, lambda m=model: grads_after_step(m, batch))
        if got is None:
            continue
        equal = common.bitwise_equal(got, reference)
        difference = common.max_difference(got, reference)
        rows.append([name, "yes" if equal else "no", f"{difference:.3g}"])
        rec.put(f"{name} gradients equal", equal)
    rec.table(
        "Gradients after one synchronised step against the same step without synchronisation",
        ["variant", "bit for bit", "max abs difference"],
        rows,
    )
    verdict = next((row[1] for row in rows if row[0] == "sync_gradients"), None)
    rec.target(
        Target(
            PART,
            "gradients read back from the buckets equal the local ones",
            "-" if verdict is None else ("equal" if verdict == "yes" else "DIFFERENT"),
            "bit for bit (one process: the average is the gradient)",
            None if verdict is None else verdict == "yes",
        )
    )
