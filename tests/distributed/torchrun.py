"""Run a test module as ranks started by torchrun, and collect what each rank reports.

The pytest side calls `launch` once per module (starting processes is the cost: each run
should check many cases inside); the rank side ends its module with
``if __name__ == "__main__": run_rank(cases)``, where ``cases(rank, world)`` returns a JSON-able
dict. Ranks join a gloo group on CPU from torchrun's environment; `cpu_mesh` gives FSDP2 its
mesh and `full_grads` the gradients of a sharded model as one process would hold them.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2


def _torchrun(target: list[str], cwd: Path, nproc: int, timeout: float) -> str:
    """Run torchrun on ``target`` with ``nproc`` ranks; its output. AssertionError if it fails."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = (
        [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    result = subprocess.run(
        [*launcher, "--standalone", f"--nproc-per-node={nproc}", *target],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun {' '.join(target)} failed:\n{output}"
    return result.stdout


def launch(
    module: str, out_dir: Path, *args: str, nproc: int = WORLD_SIZE, timeout: float = 240
) -> list[dict[str, Any]]:
    """Run ``python -m module OUT_DIR *args`` as ``nproc`` ranks under torchrun; their reports.

    Raises AssertionError with every rank's output when a rank fails.
    """
    _torchrun(["--module", module, str(out_dir), *args], ROOT, nproc, timeout)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(nproc)]


def run_script(
    script: Path, cwd: Path, *args: str, nproc: int = WORLD_SIZE, timeout: float = 240
) -> str:
    """Run ``script *args`` as ``nproc`` ranks under torchrun from ``cwd``; its standard output."""
    return _torchrun([str(script), *args], cwd, nproc, timeout)


def run_rank(cases: Callable[[int, int], dict[str, Any]]) -> None:
    """One rank of `launch`: join the gloo group, run ``cases``, write its report, leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        report = cases(rank, world)
    finally:
        # Wrappers and handles sit in reference cycles: free them (and the gloo work they hold)
        # while the interpreter is whole.
        gc.collect()
        dist.destroy_process_group()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    # torch 2.13's gloo threads can abort interpreter shutdown ("terminate called without an
    # active exception") after all the work is done: leave without it.
    os._exit(0)


def cpu_mesh() -> Any:
    """A one-dimensional CPU device mesh over every rank, for ``fully_shard(mesh=...)``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def full_grads(module: nn.Module) -> list[torch.Tensor | None]:
    """Each parameter's gradient whole: a sharded (DTensor) gradient is gathered from every rank."""
    grads: list[torch.Tensor | None] = []
    for param in module.parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads.append(None if grad is None else grad.detach().clone())
    return grads


def max_difference(
    got: list[torch.Tensor | None], expected: list[torch.Tensor | None]
) -> tuple[float, int, float]:
    """Largest |difference|, count of None mismatches, and the largest |expected|."""
    diff, mismatched, largest = 0.0, 0, 0.0
    for mine, theirs in zip(got, expected, strict=True):
        if (mine is None) != (theirs is None):
            mismatched += 1
        elif mine is not None and theirs is not None:
            diff = max(diff, (mine - theirs).abs().max().item())
            largest = max(largest, theirs.abs().max().item())
    return diff, mismatched, largest
