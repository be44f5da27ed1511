"""The GPU runner: every part in a process of its own, under its own time limit, one report.

``python benchmarks/gpu.py --out DIR`` probes the machine, then runs each part as
``python benchmarks/gpu.py --part NAME`` under its time limit (clipped to what is left of the
run's budget). A part that fails, crashes or runs out of time is reported as such, with the end
of its output, and the next part runs. After every part the runner rewrites
``DIR/gpu-results.json`` and ``DIR/gpu-report.md`` and prints one line, so a run cut short
still leaves its report; every part's output goes to ``DIR/gpu-log.txt``. Without CUDA each
part is reported as ``skipped: no CUDA`` without being started. ``--dry-run`` runs every part
on the CPU at tiny sizes, to check the code paths without a GPU (its numbers mean nothing).

This module imports no torch: the runner's own process must not be the one that hangs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import record
from .process import run_logged
from .record import FAILED, OK, RUNNING, SKIPPED, TIMEOUT, Recorder
from .report import render, summary_line

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"

REPORT = "gpu-report.md"
RESULTS = "gpu-results.json"
LOG = "gpu-log.txt"

MIN_START_S = 10.0
"""A part is not started with less than this left of the run's budget."""

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class Part:
    """One part of the run: its name on the command line, its title, its time limit.

    ``entry`` is ``module:function`` in this package, called with a `Recorder` and a `Context`
    in the part's own process; ``argv``, when given, is run instead (the tests' stand-in parts).
    """

    name: str
    title: str
    limit_s: float
    entry: str = ""
    needs_cuda: bool = True
    argv: tuple[str, ...] | None = None


# NOTE [Sizing the GPU run]
#
# The whole run must end within 8 minutes (480 s) on one H100 or H200, start-up included. The
# limits below add up to 430 s, and the run's budget (440 s) clips the limits of the last parts
# when earlier ones ran long, so the parts end by 440 s plus, at worst, the last one's grace
# period between SIGINT and SIGKILL (5 s); the runner itself starts in well under a second (it
# imports no torch). Measured on an H200 (2026-11-28): environment 6 s, CUDA tests 15 s, the
# sanitizer's runs past 70 s (the property test of random programs is cut at the deadline by
# design: every kernel launch is checked in Python), save_on_cpu 36 s, checkpoint 16 s, parameter
# offloading 25 s, sync_gradients 12 s; the planner's script did not finish in 30 s (profiling
# and three rounds of every plan of an 8-block bf16 stack), so it has 100 s and two rounds. The
# sizes are chosen
# so that copies and kernels take milliseconds to tenths of a second per step, far above launch
# overheads: save_on_cpu moves about 6.8 GB each way per step, the checkpointed stack 1.2 GB of
# matmul outputs, the parameter-offloaded stack 1.2 GiB of fp32 weights. A part that sees its
# deadline coming times fewer rounds rather than none (`common.timed_rounds`), and records its
# tables as it goes, so a part stopped at its limit still reports what it measured.
# The FSDP2 part (torchrun, one NCCL rank per GPU: start-up, a profile and 10 rounds of three
# variants of a bf16 stack whose step takes tens of milliseconds) has 45 s, taken from parts that
# ended well within theirs: CUDA tests 50 -> 40 s, save_on_cpu 70 -> 60, checkpoint 40 -> 30,
# parameter offloading 50 -> 40, sync_gradients 25 -> 20. It is not measured on a GPU yet.
PARTS: tuple[Part, ...] = (
    Part("environment", "Environment", 20, "environment:run", needs_cuda=False),
    Part("cuda-tests", "CUDA tests (`pytest -m cuda`)", 40, "cuda_tests:run_tests"),
    Part(
        "sanitizer", "Offload tests under `TORCH_CUDA_SANITIZER=1`", 75, "cuda_tests:run_sanitizer"
    ),
    Part(
        "save-on-cpu",
        "save_on_cpu(pin_memory=True) on a bf16 transformer",
        60,
        "activation_offload:run",
    ),
    Part("checkpoint", "checkpoint: recompute, save or offload matmuls", 30, "checkpointing:run"),
    Part(
        "offload-parameters",
        "offload_parameters against FSDP2 and fairscale",
        40,
        "parameter_offload:run",
    ),
    Part("sync-gradients", "sync_gradients over NCCL against DDP", 20, "gradient_sync:run"),
    Part("planner", "Activation planner", 100, "planner:run"),
    Part(
        "fsdp2", "FSDP2 over NCCL on every GPU: plans against torch's checkpoint", 45, "fsdp2:run"
    ),
)

DRY_RUN_SLACK = 4.0
"""A dry run on the CPU gives every part, and the run, this many times its limit."""

DEFAULT_BUDGET_S = 440.0
"""Seconds for all parts together; see NOTE [Sizing the GPU run]."""


@dataclass
class Context:
    """What a part is told: whether this is a dry run on the CPU, and where things are."""

    dry_run: bool
    root: Path = ROOT
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpu-part-")))

    @property
    def device(self) -> str:
        """``"cpu"`` in a dry run, else ``"cuda"``."""
        return "cpu" if self.dry_run else "cuda"

    @staticmethod
    def seconds_left() -> float:
        """Seconds until the runner stops this part."""
        return record.seconds_left()


def run_child(name: str, dry_run: bool, parts: Sequence[Part] = PARTS) -> int:
    """Run one part in this process (the runner started it); its result goes to its file.

    Returns:
        The exit status: 0 when the part returned, 1 when it raised, 3 when it was interrupted
        (the runner's SIGINT at its time limit).
    """
    part = next(part for part in parts if part.name == name)
    rec = Recorder.from_environment(name)
    module, function = part.entry.split(":")
    try:
        run = getattr(importlib.import_module(f"{__package__}.{module}"), function)
        run(rec, Context(dry_run))
    except KeyboardInterrupt:  # the runner's SIGINT at the time limit
        traceback.print_exc()
        rec.finish(TIMEOUT, reason=f"stopped at its time limit at {_where()}")
        return 3
    except Exception as error:
        traceback.print_exc()
        rec.finish(FAILED, reason=f"{type(error).__name__}: {_first_line(error)}")
        return 1
    if rec.result["status"] == RUNNING:
        rec.finish(OK)
    return 0


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else "(no message)"


def _where() -> str:
    """Where the exception being handled came from: the part's own line, and the innermost."""
    frames = traceback.extract_tb(sys.exc_info()[2])[1:]  # below run_child's own frame
    if not frames:
        return "an unknown place"
    ours = [frame for frame in frames if Path(frame.filename).parent.name == "gpu_parts"]
    shown = [ours[-1]] if ours else []
    if frames[-1] not in shown:
        shown.append(frames[-1])
    return " in ".join(f"{Path(f.filename).name}:{f.lineno} ({f.name})" for f in reversed(shown))


def _child_env(result: Path, deadline: float, dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    if dry_run:  # tiny tensors: more threads only contend (and CI machines are small)
        env["OMP_NUM_THREADS"] = "1"
    paths = [str(ROOT), str(ROOT / "benchmarks")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env[record.RESULT_ENV] = str(result)
    env[record.DEADLINE_ENV] = repr(deadline)
    return env


def _log_tail(log: Path, offset: int) -> str:
    with log.open("rb") as file:
        file.seek(offset)
        text = file.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])[-6000:]


def run_part(
    part: Part, *, out: Path, limit_s: float, dry_run: bool, scratch: Path
) -> dict[str, Any]:
    """Run one part in a process of its own under ``limit_s``; return its record for the report."""
    log = out / LOG
    result_file = scratch / f"{part.name}.json"
    with log.open("a") as file:
        file.write(f"\n===== [{part.name}] {part.title}: limit {limit_s:.0f} s =====\n")
    offset = log.stat().st_size
    argv = (
        list(part.argv)
        if part.argv is not None
        else [
            sys.executable,
            str(SCRIPT),
            "--part",
            part.name,
            *(["--dry-run"] if dry_run else []),
        ]
    )
    finished = run_logged(
        argv,
        log=log,
        limit_s=limit_s,
        env=_child_env(result_file, time.time() + limit_s, dry_run),
        cwd=ROOT,
    )
    result = record.load(result_file) or {
        "status": RUNNING,
        "summary": "",
        "reason": None,
        "tables": [],
        "targets": [],
        "notes": [],
        "data": {},
    }
    if finished.timed_out:
        result["status"] = TIMEOUT
        result["reason"] = result.get("reason") or f"stopped at its time limit ({limit_s:.0f} s)"
    elif finished.returncode != 0 and result["status"] in (OK, RUNNING):
        result["status"] = FAILED
        result["reason"] = f"exited with status {finished.returncode}"
    elif result["status"] == RUNNING:
        result["status"] = FAILED
        result["reason"] = "exited without recording a result"
    if result["status"] not in (OK, SKIPPED):
        result["log_tail"] = _log_tail(log, offset)
    return {
        "name": part.name,
        "title": part.title,
        "limit_s": limit_s,
        "seconds": round(finished.seconds, 2),
        **result,
    }


def _skipped(part: Part, reason: str) -> dict[str, Any]:
    return {
        "name": part.name,
        "title": part.title,
        "limit_s": part.limit_s,
        "seconds": None,
        "status": SKIPPED,
        "summary": "",
        "reason": reason,
        "tables": [],
        "targets": [],
        "notes": [],
        "data": {},
    }


def run_all(
    parts: Sequence[Part],
    *,
    out: Path,
    budget_s: float = DEFAULT_BUDGET_S,
    dry_run: bool = False,
    command: str = "",
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``parts`` in order, the first being the environment probe; write and return the record.

    The probe's data says whether CUDA is there; without it (and without ``dry_run``) every part
    that needs CUDA is skipped unstarted. A part gets its own limit or what is left of
    ``budget_s``, whichever is less, and is skipped when less than `MIN_START_S` is left.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / LOG).write_text("")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-run-"))
    start = time.monotonic()
    run: dict[str, Any] = {
        "command": command,
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": budget_s,
        "dry_run": dry_run,
        "seconds": 0.0,
        "environment": {},
        "parts": [],
    }
    for part in parts:
        left = budget_s - (time.monotonic() - start)
        cuda = run["environment"].get("cuda_available")
        if part.needs_cuda and not (cuda or dry_run):
            entry = _skipped(part, "no CUDA" if cuda is False else "no CUDA seen (no probe)")
        elif left < min(MIN_START_S, part.limit_s):
            entry = _skipped(
                part, f"out of time ({left:.0f} s of the {budget_s:.0f} s budget left)"
            )
        else:
            echo(f"[{part.name}] running (limit {min(part.limit_s, left):.0f} s)")
            entry = run_part(
                part, out=out, limit_s=min(part.limit_s, left), dry_run=dry_run, scratch=scratch
            )
        if part.name == "environment":
            run["environment"] = entry.get("data", {})
        run["parts"].append(entry)
        run["seconds"] = round(time.monotonic() - start, 2)
        write(run, out)
        echo(summary_line(entry))
    return run


def write(run: dict[str, Any], out: Path) -> None:
    """Write ``gpu-results.json`` and ``gpu-report.md`` (each replaced whole)."""
    for name, text in ((RESULTS, json.dumps(run, indent=1, default=str)), (REPORT, render(run))):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out / name)


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = {part.name for part in PARTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown part {', '.join(unknown)}; the parts are {', '.join(sorted(known))}"
        )
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu.py",
        description="Run every CUDA test and GPU benchmark, each under its own time limit, and "
        "write DIR/gpu-report.md and DIR/gpu-results.json.",
    )
    parser.add_argument("--out", type=Path, help="the folder for the report, results and log")
    parser.add_argument("--only", type=_names, help="comma-separated parts to run (and the probe)")
    parser.add_argument("--skip", type=_names, default=[], help="comma-separated parts to skip")
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts together"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="run every part on the CPU at tiny sizes"
    )
    parser.add_argument("--list", action="store_true", help="list the parts and their limits")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a part's own process
    args = parser.parse_args(argv)
    if not (args.list or args.part or args.out):
        parser.error("--out DIR is required")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns 1 when a part failed or ran out of time, else 0."""
    args = parse_args(argv)
    if args.part:
        return run_child(args.part, args.dry_run)
    if args.list:
        for part in PARTS:
            print(f"{part.name:20s} {part.limit_s:4.0f} s  {part.title}")
        print(f"{'total':20s} {sum(part.limit_s for part in PARTS):4.0f} s")
        return 0
    chosen = [
        part
        for part in PARTS
        if part.name == "environment"
        or ((args.only is None or part.name in args.only) and part.name not in args.skip)
    ]
    command = " ".join(["python", "benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    if args.dry_run:  # the limits are sized for an H100, not for a loaded CPU machine
        chosen = [
            dataclasses.replace(part, limit_s=part.limit_s * DRY_RUN_SLACK) for part in chosen
        ]
        args.budget *= DRY_RUN_SLACK
    run = run_all(chosen, out=args.out, budget_s=args.budget, dry_run=args.dry_run, command=command)
    print(f"report: {args.out / REPORT} ({run['seconds']:.0f} s)")
    bad = [part["name"] for part in run["parts"] if part["status"] in (FAILED, TIMEOUT)]
    return 1 if bad else 0
