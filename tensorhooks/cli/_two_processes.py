"""Run a function on two local gloo processes and bring rank 0's result back.

The demo's sync_gradients case and the bench's sync_gradients part both run here: two processes
on this machine, one intra-op thread each, in one gloo process group.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["WORLD_SIZE", "run_on_two_processes"]

WORLD_SIZE = 2

Result = TypeVar("Result")

# NOTE [Leaving a gloo process group]
#
# A process does not call `torch.distributed.destroy_process_group` at its end: it passes a last
# barrier (rank 0 has written its result before it) and leaves with `os._exit(0)`. Destroying a
# gloo group joins its worker threads while holding the GIL, and a worker thread that is just
# releasing a finished collective (the last barrier holds the collectives before it, and those
# hold tensors Python made) takes the GIL to free them: each waits for the other, for ever
# (https://github.com/pytorch/pytorch/issues/56297). The demo was seen hanging there, under
# load, with that stack in gdb. After the barrier nothing is left to send or keep: leaving at
# once is safe, and the parent reads the result once both processes have exited with status 0.


def run_on_two_processes(worker: Callable[..., Result], *args: Any) -> Result:
    """Run ``worker(rank, *args)`` on two gloo processes; return what rank 0's call returned.

    Args:
        worker: a module-level function (the processes import it), called in each process once
            the group is up; its result on rank 0 must be picklable.
        args: its arguments after the rank (picklable).

    Returns:
        Rank 0's result.

    Raises:
        torch.multiprocessing.ProcessRaisedException: when a process raised (its traceback is
            in the message).
    """
    from torch.multiprocessing.spawn import spawn  # noqa: PLC0415  # only these runs need it

    with tempfile.TemporaryDirectory() as directory:
        spawn(_process, args=(directory, worker, args), nprocs=WORLD_SIZE, join=True)  # type: ignore[no-untyped-call]
        result: Result = torch.load(Path(directory) / "result.pt", weights_only=False)
    return result


def _process(
    rank: int, directory: str, worker: Callable[..., object], args: tuple[Any, ...]
) -> None:
    """One process: join the group, run ``worker``, rank 0 writes its result, then leave."""
    import torch.distributed as dist  # noqa: PLC0415  # only the processes need it

    torch.set_num_threads(1)
    init = f"file://{Path(directory) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD_SIZE)
    result = worker(rank, *args)
    if rank == 0:
        torch.save(result, Path(directory) / "result.pt")
    dist.barrier()
    os._exit(0)  # See NOTE [Leaving a gloo process group]
