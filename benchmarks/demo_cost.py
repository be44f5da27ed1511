"""What `python -m tensorhooks demo` costs: CPU-seconds and wall seconds, over fresh runs.

Each round runs the demo as a user does, in a new interpreter (imports included), and reads its
CPU time from the operating system (user + system, of the demo and of the two processes its
sync_gradients case starts) and its wall time. The figures are the median over the rounds with
the lowest and highest; the load average before and after says how quiet the machine was. The
target (README, getting-started): at most 20 CPU-seconds, read by the one rule (see
NOTE [Reading a ratio from its rounds]): met when every round is clearly under it. CPU time
grows with load too (shared caches, hyperthreads), less than wall time: measure on a quiet
machine for a figure to publish.

    python benchmarks/demo_cost.py --rounds 5
    python benchmarks/demo_cost.py --rounds 5 -- --no-processes
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time

from harness import Spread, check_target

TARGET_CPU_SECONDS = 20.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(demo_args: list[str]) -> tuple[float, float]:
    """One demo in a fresh interpreter: its CPU-seconds (with its children's) and wall seconds.

    Raises:
        SystemExit: when the demo exits with an error (its output is printed).
    """
    cpu_before, started = _children_cpu(), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tensorhooks", "demo", *demo_args],
        capture_output=True,
        text=True,
        check=False,
    )
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu_before
    if done.returncode != 0:
        print(done.stdout, done.stderr, sep="\n")
        raise SystemExit(f"the demo exited with status {done.returncode}")
    return cpu, wall


def conditions() -> str:
    """The machine and its load, in words."""
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return f"{platform.machine()}, {os.cpu_count()} logical CPUs, load average {load}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="demo runs (default: 5)")
    parser.add_argument("demo_args", nargs="*", help="after --: the demo's own arguments")
    options = parser.parse_args()
    print(f"before: {conditions()}")
    cpu, wall = [], []
    for index in range(options.rounds):
        seconds = run_once(options.demo_args)
        cpu.append(seconds[0])
        wall.append(seconds[1])
        print(f"round {index + 1}: {seconds[0]:.1f} CPU-s, {seconds[1]:.1f} s wall", flush=True)
    print(f"after: {conditions()}")
    command = " ".join(["python -m tensorhooks demo", *options.demo_args])
    print(
        f"{command}: {Spread.of(cpu).format(' CPU-s', digits=1)}, "
        f"{Spread.of(wall).format(' s wall', digits=1)}, median (lowest-highest) of "
        f"{options.rounds} runs"
    )
    check_target(
        "CPU-seconds of the demo", Spread.of(cpu), at_most=TARGET_CPU_SECONDS, unit=" CPU-s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
