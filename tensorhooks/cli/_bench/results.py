"""What the bench measures and reports, as records: options, targets, rows, the report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensorhooks.cli._harness import Spread, Timings

__all__ = [
    "OFFLOAD_PARAMETERS",
    "SAVE_ON_CPU",
    "SYNC",
    "BenchOptions",
    "BenchReport",
    "Comparison",
    "GpuRow",
    "Target",
    "compare",
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

    def check(self, timings: Timings) -> tuple[float, bool]:
        """The median ratio and whether it meets the bound."""
        median = timings.ratio(self.name, self.reference).median
        return median, median <= self.at_most


@dataclass(frozen=True)
class Comparison:
    """One row of the CPU table: a feature under torch and under tensorhooks."""

    mode: str
    torch: Spread | None  # step time over plain autograd's, per round
    ours: Spread | None
    ours_over_torch: Spread | None
    targets: tuple[tuple[str, float, bool, float], ...] = ()  # (label, median, met, at most)
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

    @property
    def missed(self) -> list[str]:
        """The targets missed, in words."""
        return [
            f"{row.mode}: {label} {median:.2f}"
            for row in self.cpu
            for label, median, met, _ in row.targets
            if not met
        ]


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
    checked = tuple((target.label, *target.check(timings), target.at_most) for target in targets)
    return Comparison(
        mode,
        timings.ratio(theirs, plain),
        timings.ratio(ours, plain) if ours else None,
        timings.ratio(ours, theirs) if ours else None,
        checked,
        reference=ours is None,
    )
