"""plan_activations under FSDP2 against FSDP2 with torch's checkpoint per block, on every rank.

A stack of residual MLP blocks, each block and the root under ``fully_shard``, is trained by
every rank of a torchrun launch (2 gloo ranks on the CPU; with ``--gpu``, one NCCL rank per GPU
of the machine). Three variants, in one run:

- ``torch checkpoint``: every block's forward under ``torch.utils.checkpoint.checkpoint``
  (non-reentrant), the usual way to checkpoint an FSDP2 model;
- ``plan at its peak``: `plan_activations` with torch checkpoint's saved-activation peak as the
  budget (the largest over the ranks, so every rank plans alike);
- ``plan 50%``: `plan_activations` at half the unplanned peak.

Per rank: the saved-activation peak (bytes autograd holds for backward, recomputation included,
parameters and FSDP2's gathered parameters left out; counted the planner's way for all three,
see `torch_checkpointed`) as a ratio to torch checkpoint's, and the step time (forward,
backward, ``p.grad = None``) over interleaved rounds, the ranks lined up by a barrier before
each variant, as the median per-round ratio to torch checkpoint's with its range and reading.

Run: python benchmarks/fsdp2.py [--rounds 11] [--quick]       (launches 2 gloo ranks itself)
     python benchmarks/fsdp2.py --gpu [--rounds 10]           (one NCCL rank per GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tensorhooks
from tensorhooks._core.torch_compat import current_graph_task_id
from tensorhooks._planner.accounting import HeldBytes, delegating_hooks, holding_hooks, module_keys
from tensorhooks.cli._harness import Spread, Timings, check_target, interleaved, print_table
from tensorhooks.cli._verdict import verdict

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch checkpoint"
MiB = float(1 << 20)


@dataclass(frozen=True)
class Size:
    """The stack and its batch (rows per rank)."""

    blocks: int
    width: int
    hidden: int
    rows: int


CPU_SIZE = Size(blocks=6, width=256, hidden=1024, rows=128)
QUICK_SIZE = Size(blocks=3, width=32, hidden=64, rows=16)
GPU_SIZE = Size(blocks=8, width=4096, hidden=16384, rows=4096)


class Block(nn.Module):
    """``x + down(gelu(up(norm(x))))``: a transformer's MLP half."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


@contextlib.contextmanager
def torch_checkpointed(blocks: list[nn.Module], held: HeldBytes | None = None) -> Iterator[None]:
    """Each block's forward under torch's non-reentrant checkpoint; measured into ``held``.

    Measured the planner's way: ``holding_hooks`` around the step (the caller's) see the
    inputs torch's checkpoint saves; inside a recomputation a pair on top of torch's holds what
    it keeps, until the next recomputation begins. Every tensor a block's recomputation keeps is
    held at once right after it (backward then unpacks them one by one), and the next block's
    recomputation starts after they are all used, so the peak is the one torch's holds.
    """
    holds: list[Any] = []

    def keep(tensor: torch.Tensor) -> None:
        assert held is not None
        holds.append(held.hold(tensor))

    def region(forward: Callable[..., Any], *args: Any) -> Any:
        if held is None or current_graph_task_id() == -1:
            return forward(*args)
        holds.clear()  # the previous block's recomputation is all used by now
        with delegating_hooks(keep):
            return forward(*args)

    for block in blocks:
        body = functools.partial(region, block.forward)
        block.forward = functools.partial(checkpoint, body, use_reentrant=False)
    try:
        yield
    finally:
        holds.clear()
        for block in blocks:
            del block.forward


def torch_peak(model: nn.Module, blocks: list[nn.Module], step: Callable[[], None]) -> int:
    """Torch checkpoint's saved-activation peak of one step on this rank."""
    held = HeldBytes(module_keys(model))
    with torch_checkpointed(blocks, held), holding_hooks(held):
        step()
    return held.peak[0]


def applied(plan: tensorhooks.ActivationPlan, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with plan.apply():
            step()

    return run


def under_torch(blocks: list[nn.Module], step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with torch_checkpointed(blocks):
            step()

    return run


def build(size: Size, device: str, dtype: torch.dtype) -> tuple[nn.Module, Callable[[], None]]:
    """The sharded stack on this rank and its step (same weights everywhere, own rows)."""
    torch.manual_seed(0)
    with torch.device(device):  # a GPU initialises 4 GiB of weights in a blink, a CPU does not
        model = nn.Sequential(*(Block(size.width, size.hidden) for _ in range(size.blocks)))
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(size.rows, size.width, generator=generator).to(device=device, dtype=dtype)

    def step() -> None:
        model(x).float().square().mean().backward()
        for parameter in model.parameters():
            parameter.grad = None

    return model, step


def measure(size: Size, device: str, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """This rank's peaks and step times of the three variants."""
    model, step = build(size, device, dtype)
    blocks = list(model)
    step()  # FSDP2's lazy initialisation and buffers
    peak = torch_peak(model, blocks, step)
    agreed = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, dist.ReduceOp.MAX)
    profile = tensorhooks.profile_step(model, step, blocks=blocks, rounds=3)
    variants: dict[str, Callable[[], None]] = {TORCH: under_torch(blocks, step)}
    peaks, budgets, notes = {TORCH: peak}, {}, []
    for name, budget in (("plan at its peak", int(agreed.item())), ("plan 50%", 0.5)):
        try:
            plan = tensorhooks.plan_activations(model, step, budget, blocks=blocks, profile=profile)
        except tensorhooks.PlanBudgetError as error:
            notes.append(f"{name}: {error}")
            continue
        with plan:
            step()
        assert plan.measured_peak_bytes is not None
        peaks[name], budgets[name] = plan.measured_peak_bytes, plan.budget_bytes
        variants[name] = applied(plan, step)
    timings = interleaved(
        variants,
        rounds=rounds,
        inner=1 if device == "cuda" else 3,
        warmup=1,
        cuda_events=device == "cuda",
        before_each=dist.barrier,
    )
    return {
        "rank": dist.get_rank(),
        "peaks": peaks,
        "budgets": budgets,
        "samples": {name: list(values) for name, values in timings.samples.items()},
        "notes": notes,
    }


def report(results: list[dict[str, Any]], size: Size, device: str, dtype: torch.dtype) -> None:
    """Rank 0: the tables and the targets, one row per rank and variant."""
    print(
        f"FSDP2 on {len(results)} {device} ranks ({'NCCL' if device == 'cuda' else 'gloo'}), "
        f"{size.blocks} blocks of width {size.width} (hidden {size.hidden}), {size.rows} rows "
        f"per rank, {dtype}; each block and the root under fully_shard"
    )
    for result in results:
        for note in result["notes"]:
            print(f"rank {result['rank']}: {note}")
    print("\nSaved-activation peak per rank (bytes held for backward, recomputation included)")
    print(f"| rank | variant | peak MiB | x {TORCH} | budget MiB |")
    print("|---|---|---:|---:|---:|")
    for result in results:
        base = result["peaks"][TORCH]
        for name, peak in result["peaks"].items():
            budget = result["budgets"].get(name)
            shown = "-" if budget is None else f"{budget / MiB:.3f}"
            print(
                f"| {result['rank']} | {name} | {peak / MiB:.3f} | {peak / max(base, 1):.2f} "
                f"| {shown} |"
            )
    rounds = len(results[0]["samples"][TORCH])
    for result in results:
        timings = Timings(result["samples"])
        title = f"step time, rank {result['rank']} ({rounds} interleaved rounds)"
        print_table(title, timings, TORCH)
        for name in timings.samples:
            if name != TORCH:
                reading = verdict(timings.ratio(name, TORCH))
                print(f"rank {result['rank']}: {name} / {TORCH}: {reading}")
    for result in results:
        rank = result["rank"]
        for name, budget in result["budgets"].items():
            check_target(
                f"rank {rank}: {name}, measured peak / budget",
                result["peaks"][name] / budget,
                at_most=1.0,
                exact=True,
            )
        if "plan at its peak" in result["samples"]:
            ratio: Spread = Timings(result["samples"]).ratio("plan at its peak", TORCH)
            check_target(f"rank {rank}: plan at its peak, step / {TORCH}'s", ratio, at_most=1.0)


def launch(options: argparse.Namespace) -> None:
    """Start this script under torchrun: 2 gloo ranks, or one NCCL rank per GPU."""
    ranks = torch.cuda.device_count() if options.gpu else options.ranks
    if ranks < 1:
        print("skipped: no CUDA device")
        raise SystemExit(0)
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    if not options.gpu:
        environment["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={ranks}", __file__, *sys.argv[1:]]
    os.execve(sys.executable, argv, environment)


def main() -> NoReturn:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    parser.add_argument("--gpu", action="store_true", help="NCCL, one rank per GPU, bf16")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo)")
    options = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        launch(options)
    device = "cuda" if options.gpu else "cpu"
    dtype = torch.bfloat16 if options.gpu else torch.float32
    size = QUICK_SIZE if options.quick else GPU_SIZE if options.gpu else CPU_SIZE
    if options.gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if options.gpu else "gloo")
    result = measure(size, device, dtype, options.rounds)
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        report(results, size, device, dtype)
    sys.stdout.flush()
    dist.barrier()
    # Leave without destroying the group or shutting the interpreter down: gloo's worker threads
    # can abort either ("terminate called without an active exception", seen here under load)
    # once all the work is done. See NOTE [Leaving a gloo process group] in
    # tensorhooks/cli/_two_processes.py.
    os._exit(0)


if __name__ == "__main__":
    main()
