"""FSDP2 over NCCL on every GPU of the machine: ``python benchmarks/fsdp2.py --gpu``.

The script starts one rank per GPU under torchrun, shards a bf16 stack of MLP blocks with
``fully_shard`` and compares, on every rank, plans of `plan_activations` with torch's
``checkpoint`` per block: saved-activation peaks and step times (CUDA events, 10 interleaved
rounds). This part runs it under the part's deadline and takes in its Markdown tables and target
lines (`planner.parse_output`). A dry run takes the script's CPU path instead: 2 gloo ranks at
tiny sizes, two rounds.
"""

from __future__ import annotations

import sys
from typing import Any

from .planner import parse_output
from .process import run_logged
from .record import FAILED, OK, SKIPPED, TIMEOUT, Recorder

PART = "fsdp2"
SCRIPT = ("benchmarks", "fsdp2.py")
GPU_ARGS = ("--gpu", "--rounds", "10")
DRY_ARGS = ("--quick", "--rounds", "2")


def run(rec: Recorder, ctx: Any) -> None:
    """Run benchmarks/fsdp2.py under torchrun and take in its tables and targets."""
    script = ctx.root.joinpath(*SCRIPT)
    log = ctx.scratch / "fsdp2.log"
    finished = run_logged(
        [sys.executable, str(script), *(DRY_ARGS if ctx.dry_run else GPU_ARGS)],
        log=log,
        limit_s=max(ctx.seconds_left() - 5, 1),
        cwd=ctx.root,
    )
    text = log.read_text(errors="replace")
    print(text)  # into the run's log
    tables, targets = parse_output(text, part=PART)
    lines = text.splitlines()
    heading = next((line for line in lines if line.startswith("FSDP2 on ")), None)
    if heading is not None:
        rec.note(heading)
    for title, columns, rows in tables:
        rec.table(title or "benchmarks/fsdp2.py", columns, rows)
    for target in targets:
        rec.target(target)
    for line in lines:  # a time ratio whose rounds straddle its bound: said, not a verdict
        if line.startswith("target not decidable:"):
            rec.note(line)
    skipped = [line for line in lines if line.startswith("skipped:")]
    command = "benchmarks/fsdp2.py " + " ".join(DRY_ARGS if ctx.dry_run else GPU_ARGS)
    if finished.timed_out:
        rec.finish(TIMEOUT, reason=f"{command} was stopped at the deadline")
    elif finished.returncode != 0:
        rec.finish(FAILED, reason=f"{command} exited with {finished.returncode}")
    elif skipped and not tables:
        rec.finish(SKIPPED, reason=skipped[0].removeprefix("skipped:").strip())
    else:
        rec.finish(OK, f"{len(tables)} tables from {command}")
