"""What the bench measures and reports, as records: options, targets, rows, the report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tensorhooks.cli._harness import Timings
from tensorhooks.cli._verdict import Side, Spread, TargetVerdict, side, target_verdict

__all__ = [
    "OFFLOAD_PARAMETERS",
    "SAVE_ON_CPU",
    "SYNC",
    "BenchOptions",
    "BenchReport",
    "Checked",
    "Comparison",
    "GpuRow",
    "Target",
    "compare",
    "word",
]


@dataclass(frozen=True)
class BenchOptions:
    """What the bench runs and where it writes."""

    out: Path
    rounds: int = 11
    steps: int = 20
    gpu: bool = True
    processes: bool = True  # run sync_gradients on two gloo processes


@dataclass(frozen=True)
class Target:
    """A bound on a ratio: ``ratio(name, reference) <= at_most``."""

    name: str
    reference: str
    at_most: float
    label: str

    def check(self, timings: Timings) -> Checked:
        """The ratio's rounds, and whether they meet the bound (see `target_verdict`)."""
        spread = timings.ratio(self.name, self.reference)
        return Checked(self.label, spread, target_verdict(spread, self.at_most), self.at_most)


class Checked(NamedTuple):
    """A target as one run read it."""

    label: str  # what the ratio is over, after the figure: "x torch"
    spread: Spread  # the ratio's rounds
    verdict: TargetVerdict
    at_most: float

    def describe(self) -> str:
        """The ratio, its rounds and the bound, in the words of the table and the target lines.

        Example:
            >>> spread = Spread(0.9, 1.0, 1.2)
            >>> Checked("x torch", spread, TargetVerdict.NOT_DECIDABLE, 1.1).describe()
            '1.000x torch, rounds 0.900-1.200 (at most 1.1)'
        """
        spread = self.spread
        return (
            f"{spread.median:.3f}{self.label}, rounds {spread.low:.3f}-{spread.high:.3f} "
            f"(at most {self.at_most:g})"
        )


@dataclass(frozen=True)
class Comparison:
    """One row of the CPU table: a feature under torch and under tensorhooks."""

    mode: str
    torch: Spread | None  # step time over plain autograd's, per round
    ours: Spread | None
    ours_over_torch: Spread | None
    targets: tuple[Checked, ...] = ()
    reference: bool = False  # a floor measured for comparison, not a feature


@dataclass
class GpuRow:
    """One mode of a CUDA benchmark."""

    mode: str
    step: Spread  # seconds
    peak_bytes: int


# The parts of the bench besides the CPU table, by the name the report gives them.
SYNC = "sync_gradients"
SAVE_ON_CPU = "CUDA save_on_cpu"
OFFLOAD_PARAMETERS = "CUDA offload_parameters"


@dataclass
class BenchReport:
    """Everything one bench run measured, and what it skipped and why."""

    cpu: list[Comparison] = field(default_factory=list)
    gpu: list[GpuRow] = field(default_factory=list)  # save_on_cpu on a transformer stack
    params: list[GpuRow] = field(default_factory=list)  # offload_parameters, against resident
    skipped: dict[str, str] = field(default_factory=dict)  # part: why
    sync: str = ""  # the two-process setting in words, when it ran
    environment: str = ""

    def tally(self) -> dict[TargetVerdict, int]:
        """How many targets each verdict has, every verdict listed."""
        verdicts = [checked.verdict for row in self.cpu for checked in row.targets]
        return {reading: verdicts.count(reading) for reading in TargetVerdict}


def compare(
    timings: Timings,
    mode: str,
    theirs: str,
    ours: str | None,
    targets: Sequence[Target] = (),
    *,
    plain: str = "plain",
) -> Comparison:
    """One row of the table: torch's and ours over ``plain``, ours over torch, the targets."""
    checked = tuple(target.check(timings) for target in targets)
    return Comparison(
        mode,
        timings.ratio(theirs, plain),
        timings.ratio(ours, plain) if ours else None,
        timings.ratio(ours, theirs) if ours else None,
        checked,
        reference=ours is None,
    )


WORDS = {Side.BELOW: "faster", Side.ABOVE: "slower", Side.WITHIN_NOISE: "noise"}
"""Ours over torch in one word, by where its rounds lie against 1.00."""


def word(spread: Spread) -> str:
    """Ours over torch in one word by the one rule (see `side`): faster, slower, or noise.

    Example:
        >>> word(Spread(0.50, 0.55, 0.60, 11)), word(Spread(0.9, 1.0, 1.1, 11))
        ('faster', 'noise')
    """
    return WORDS[side(spread, 1.0)]
