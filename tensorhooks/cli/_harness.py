"""The one timing harness of the demo, the bench and the scripts in ``benchmarks/``.

See NOTE [How tensorhooks times things] below.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from tensorhooks.cli._verdict import Spread, TargetVerdict, target_verdict, verdict

__all__ = [
    "SKIPPED",
    "TARGET_MARKERS",
    "TARGET_MET",
    "TARGET_MISSED",
    "TARGET_NOT_DECIDABLE",
    "Spread",
    "Timings",
    "check_target",
    "cuda_event_seconds",
    "interleaved",
    "print_table",
    "skip",
    "verdict",
]

# NOTE [How tensorhooks times things]
#
# Ratios, not absolute times: on a shared machine absolute times drift by tens of percent
# between minutes, but variants timed in alternation drift together. Each round times every
# variant once, in an order that rotates from round to round, with `torch.utils.benchmark.Timer`
# (which warms the statement up, pins the number of intra-op threads, and synchronises CUDA).
# A comparison is the per-round ratio of two variants, reported as its median with the lowest
# and highest round beside it, and read by one rule (see NOTE [Reading a ratio from its rounds]
# in `tensorhooks.cli._verdict`): a ratio whose rounds do not all lie clearly on one side of 1.00
# is noise, never a win.
#
# On a GPU the same rounds can be timed with CUDA events instead (`cuda_event_seconds`): the
# device time between two events on the current stream, host-side gaps included. Every
# script and the bench time through `interleaved`, so a figure means the same wherever it is
# printed; a script that measured nothing says `skip(...)`, one that checks a bound says
# `check_target(...)`, and both print a marker at the start of a line that people and tests read.

# Markers at the start of a line of a script's output, read by people and by tests.
SKIPPED = "skipped:"
TARGET_MET = "target met:"
TARGET_MISSED = "TARGET MISSED:"
TARGET_NOT_DECIDABLE = "target not decidable:"
TARGET_MARKERS = {
    TargetVerdict.MET: TARGET_MET,
    TargetVerdict.MISSED: TARGET_MISSED,
    TargetVerdict.NOT_DECIDABLE: TARGET_NOT_DECIDABLE,
}
"""The marker that starts a target's line, by its verdict."""


@dataclass(frozen=True)
class Timings:
    """Seconds per call of each variant, one sample per round."""

    samples: Mapping[str, Sequence[float]]

    def spread(self, name: str) -> Spread:
        """Seconds per call of ``name`` over the rounds."""
        return Spread.of(self.samples[name])

    def median(self, name: str) -> float:
        """Median seconds per call of ``name``."""
        return statistics.median(self.samples[name])

    def ratio(self, name: str, reference: str) -> Spread:
        """Per-round ratio of ``name``'s time over ``reference``'s."""
        pairs = zip(self.samples[name], self.samples[reference], strict=True)
        return Spread.of([mine / theirs for mine, theirs in pairs])


def _seconds_per_call(fn: Callable[[], object], inner: int, threads: int) -> float:
    """Seconds per call of ``fn`` over exactly ``inner`` calls on ``threads`` intra-op threads.

    What ``Timer.timeit`` measures, without the two warm-up calls it makes each time: the
    thread count set and restored, CUDA synchronised before and after when it is in use.
    """
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / inner
    finally:
        torch.set_num_threads(previous)


def cuda_event_seconds(fn: Callable[[], object], inner: int, *, warm: bool = True) -> float:
    """Seconds per call of ``fn`` over ``inner`` calls, timed by CUDA events on the current stream.

    One untimed call first (as ``Timer`` warms up; not with ``warm=False``); the events then
    bracket ``inner`` calls, and the host waits for the second one.

    Args:
        fn: the step to time; it enqueues work on the current CUDA stream.
        inner: calls between the two events.
        warm: make one untimed call first.

    Returns:
        Device seconds between the events over ``inner``.
    """
    if warm:
        fn()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / inner


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 11,
    inner: int = 10,
    threads: int = 1,
    warmup: int = 0,
    warm_each_round: bool = True,
    cuda_events: bool = False,
    before_each: Callable[[], object] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Timings:
    """Time every variant ``inner`` calls per round, interleaved over ``rounds`` rounds.

    Example:
        >>> timings = interleaved({"a": lambda: None, "b": lambda: None}, rounds=3, inner=2)
        >>> [len(timings.samples[name]) for name in ("a", "b")]
        [3, 3]

    Args:
        variants: the callables to time, by name.
        rounds: rounds; each times every variant once, in an order rotating between rounds.
        inner: calls per variant and round (a warm-up call or two come before them, unless
            ``warm_each_round`` is False).
        threads: intra-op threads while timing with ``Timer`` (1: the project's CPU reference
            setting; ignored with ``cuda_events``).
        warmup: calls of every variant, in order, before the first round (first-call costs:
            allocator, lazy initialisation, autotuning).
        warm_each_round: warm a variant up before each of its timings (``Timer`` runs it
            twice, `cuda_event_seconds` once). False times exactly ``inner`` calls per round,
            ``warmup`` calls having warmed every variant once for all: for a step so long that
            per-round warm-up would double the cost of a round of one or two calls.
        cuda_events: time with `cuda_event_seconds` instead of ``torch.utils.benchmark.Timer``.
        before_each: called before each variant is timed, e.g. a barrier that lines up the
            processes of a distributed run so that none waits inside another's timing.
        progress: called with the number of the round just finished.

    Returns:
        Seconds per call of each variant, one sample per round.
    """
    # Imported here: torch.utils.benchmark imports torch.utils.cpp_extension, which warns on a
    # CUDA build without a CUDA runtime, and a usage error of the command line must stay one line.
    from torch.utils.benchmark import Timer  # noqa: PLC0415

    names = list(variants)
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    timers = {
        name: Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        for name, fn in variants.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            if before_each is not None:
                before_each()
            if cuda_events:
                seconds = cuda_event_seconds(variants[name], inner, warm=warm_each_round)
            elif warm_each_round:
                seconds = timers[name].timeit(inner).mean
            else:
                seconds = _seconds_per_call(variants[name], inner, threads)
            samples[name].append(seconds)
        if progress is not None:
            progress(index + 1)
    return Timings(samples)


def print_table(title: str, timings: Timings, baseline: str, *, file: TextIO | None = None) -> None:
    """Print each variant's median step with its range, and its per-round ratio to ``baseline``.

    Example:
        >>> print_table("t", Timings({"a": [0.002, 0.004], "b": [0.002, 0.002]}), "b")
        <BLANKLINE>
        t
        | variant | median step (ms, min-max) | ratio to b (min-max) |
        |---|---:|---:|
        | a | 3.000 ms (2.000-4.000) | 1.500x (1.000-2.000) |
        | b | 2.000 ms (2.000-2.000) | 1.000x (1.000-1.000) |

    Args:
        title: a line printed above the table.
        timings: what `interleaved` measured.
        baseline: the variant the ratios are taken against.
        file: where to print (standard output by default).
    """
    print(f"\n{title}", file=file)
    print(
        f"| variant | median step (ms, min-max) | ratio to {baseline} (min-max) |",
        file=file,
    )
    print("|---|---:|---:|", file=file)
    for name in timings.samples:
        step = timings.spread(name).format(" ms", scale=1e3, digits=3)
        ratio = timings.ratio(name, baseline).format(digits=3)
        print(f"| {name} | {step} | {ratio} |", file=file)


def _reading(spread: Spread, bound: float, exact: bool, *, at_least: bool) -> TargetVerdict:
    if not exact:
        return target_verdict(spread, bound, at_least=at_least)
    met = spread.low >= bound if at_least else spread.high <= bound
    return TargetVerdict.MET if met else TargetVerdict.MISSED


def check_target(
    label: str,
    value: Spread | float,
    *,
    at_most: float | None = None,
    at_least: float | None = None,
    exact: bool = False,
    unit: str = "x",
) -> bool:
    """Print whether ``value`` meets its target, read by `target_verdict`; True when it is met.

    A ``value`` that is one number is read as a spread written down (its one value as its
    range); give the rounds' `Spread` wherever there are rounds. ``exact`` says the value is a
    count that does not vary between runs (bytes held, not a time): it is then compared with the
    bound as it is, with no noise margin.

    Example:
        >>> check_target("speedup over torch", 1.5, at_least=1.6)
        TARGET MISSED: speedup over torch 1.50 (target >= 1.60)
        False
        >>> check_target("step, tensorhooks / torch", Spread(0.97, 1.04, 1.15, 11), at_most=1.10)
        target not decidable: step, tensorhooks / torch 1.04x (0.97-1.15) (target <= 1.10)
        False
        >>> check_target("peak / budget", 1.0, at_most=1.0, exact=True)
        target met: peak / budget 1.00 (target <= 1.00)
        True

    Args:
        label: what the value is, in words.
        value: the ratio's rounds, or one figure.
        at_most: the target is at most this (give this or ``at_least``).
        at_least: the target is at least this.
        exact: the value is a count, not a timing: no noise margin.
        unit: how the value is written after its figures (a ratio's ``x``, or `` s``).

    Returns:
        Whether the target is met; missed and not decidable both give False.
    """
    spread = value if isinstance(value, Spread) else Spread(value, value, value)
    shown = spread.format(unit) if isinstance(value, Spread) else f"{value:.2f}"
    if at_most is not None:
        reading, bound = _reading(spread, at_most, exact, at_least=False), f"<= {at_most:.2f}"
    else:
        assert at_least is not None, "check_target needs at_most or at_least"
        reading, bound = _reading(spread, at_least, exact, at_least=True), f">= {at_least:.2f}"
    print(f"{TARGET_MARKERS[reading]} {label} {shown} (target {bound})")
    return reading is TargetVerdict.MET


def skip(reason: str) -> None:
    """Say that a script measured nothing, and why; exit 0 (a skip is not a failure)."""
    print(f"{SKIPPED} {reason}")
    raise SystemExit(0)
