"""The bench's sync_gradients part: against DistributedDataParallel on two local gloo processes.

The bench (``python -m tensorhooks bench``, `run_sync`) and ``benchmarks/sync_gradients.py`` both
run `run_two_processes`: two processes on this machine, one intra-op thread each, train the same MLP
(forward + backward + ``p.grad = None`` per step) wrapped in DDP, under ``sync_gradients``, and
without any synchronisation (how much of the step is communication), timed in interleaved rounds
by the one harness (see NOTE [How tensorhooks times things]), a barrier before each variant so
that no process waits for the other inside a timing. Rank 0's timings come back.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tensorhooks.cli._harness import Timings, interleaved
from tensorhooks.cli._models import mlp
from tensorhooks.cli._two_processes import WORLD_SIZE, run_on_two_processes

from .results import BenchOptions, Comparison, Target, compare

__all__ = [
    "SYNC_CONFIG",
    "SyncConfig",
    "SyncResult",
    "measure",
    "run_sync",
    "run_two_processes",
    "sync_seconds",
]


@dataclass(frozen=True)
class SyncConfig:
    """The model each process trains, and how long it is timed."""

    layers: int = 6
    width: int = 1024
    batch: int = 32
    bucket_cap_mb: float = 25.0
    rounds: int = 30
    inner: int = 3
    warmup: int = 2


@dataclass(frozen=True)
class SyncResult:
    """What rank 0 measured: step times of ``DDP``, ``sync_gradients`` and ``no sync (local)``."""

    timings: Timings
    difference: float  # largest |gradient difference| between DDP and sync_gradients
    buckets: int  # sync_gradients' buckets
    gradient_bytes: int

    def describe(self, config: SyncConfig) -> str:
        """The setting in one sentence."""
        return (
            f"MLP {config.layers} x Linear({config.width}, {config.width}), batch "
            f"{config.batch} per process, {self.gradient_bytes / 2**20:.1f} MiB of float32 "
            f"gradients, {WORLD_SIZE} gloo processes, {self.buckets} buckets, {config.rounds} "
            f"rounds x {config.inner} steps; max |grad difference| sync_gradients vs DDP "
            f"{self.difference:.1e}"
        )


def _step(model: nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(batch).sum().backward()
        for param in model.parameters():
            param.grad = None

    return run


def measure(config: SyncConfig, rank: int) -> SyncResult:
    """Time the three variants in this process; the process group must be initialised."""
    import torch.distributed as dist  # noqa: PLC0415  # only the worker processes need it
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from tensorhooks.distributed import sync_gradients  # noqa: PLC0415

    base = mlp(config.layers, config.width)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ours = copy.deepcopy(base)
    handle = sync_gradients(ours, bucket_cap_mb=config.bucket_cap_mb)
    local = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randn(config.batch, config.width, generator=generator)
    variants = {
        "DDP": _step(ddp, batch),
        "sync_gradients": _step(ours, batch),
        "no sync (local)": _step(local, batch),
    }
    timings = interleaved(
        variants,
        rounds=config.rounds,
        inner=config.inner,
        warmup=config.warmup,
        before_each=dist.barrier,
    )
    # The two synchronised variants must agree, or the timing compares different work.
    ddp(batch).sum().backward()
    ours(batch).sum().backward()
    difference = max(
        float((a.grad - b.grad).abs().max())
        for a, b in zip(ddp.module.parameters(), ours.parameters(), strict=True)
    )
    buckets = len(handle.buckets)
    handle.remove()
    del ddp
    gc.collect()
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return SyncResult(timings, difference, buckets, gradient_bytes)


def _rank(rank: int, config: SyncConfig) -> SyncResult:
    return measure(config, rank)


def run_two_processes(config: SyncConfig) -> SyncResult:
    """Start two gloo processes on this machine, time the variants, return rank 0's result.

    Raises:
        torch.multiprocessing.ProcessRaisedException: when a process raised (its traceback
            is in the message).
    """
    return run_on_two_processes(_rank, config)


# Smaller than benchmarks/sync_gradients.py's default (6 x Linear(1024, 1024)): the bench's steps
# per round apply here too, and the whole bench should take about a minute on two cores.
SYNC_CONFIG = SyncConfig(layers=4, width=512, batch=32)


STARTUP_SECONDS = 10.0
"""About what starting the two processes and their process group costs, before any round."""


def sync_seconds(options: BenchOptions, config: SyncConfig = SYNC_CONFIG) -> float:
    """About how long `run_sync` takes: a local step of its model, timed here, times the calls.

    Each process runs three variants of ``options.steps`` steps (two warm-up calls each) per
    round, on its own core; communication is not counted, so this is a lower estimate.
    """
    step = _step(mlp(config.layers, config.width), torch.randn(config.batch, config.width))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()
        started = time.perf_counter()
        step()
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    calls = 3 * (options.steps + 2) * options.rounds + 3 * config.warmup
    return STARTUP_SECONDS + seconds * calls


def run_sync(options: BenchOptions, config: SyncConfig = SYNC_CONFIG) -> tuple[Comparison, str]:
    """sync_gradients against DDP on two gloo processes: the table's row, the setting in words.

    Both over the same step without synchronisation, which stands for plain autograd here.
    """
    config = SyncConfig(
        layers=config.layers,
        width=config.width,
        batch=config.batch,
        bucket_cap_mb=config.bucket_cap_mb,
        rounds=options.rounds,
        inner=options.steps,
        warmup=config.warmup,
    )
    result = run_two_processes(config)
    target = Target("sync_gradients", "DDP", 1.10, "x DDP")
    row = compare(
        result.timings,
        "sync_gradients vs DDP (2 processes)",
        "DDP",
        "sync_gradients",
        (target,),
        plain="no sync (local)",
    )
    return row, result.describe(config)
