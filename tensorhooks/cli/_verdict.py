"""How to read a set of timed rounds: their `Spread`, and the one rule that decides what it shows.

See NOTE [Reading a ratio from its rounds]. The demo, the bench (its table, its target lines and
exit message, its chart's colours), the scripts in ``benchmarks/`` and the performance page all
read ratios through `side`: a ratio is faster, slower or within noise, and a target met, missed
or not decidable at this noise, by the same rule.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "MIN_ROUNDS",
    "NOISE_MARGIN",
    "Side",
    "Spread",
    "TargetVerdict",
    "side",
    "target_verdict",
    "verdict",
]

# NOTE [Reading a ratio from its rounds]
#
# A comparison is timed in rounds; each round gives one ratio (see
# NOTE [How tensorhooks times things]). Whether the ratio lies below or above a threshold (1.00
# for "faster or slower", the bound for a target) is decided from the lowest and highest round,
# with a margin:
#
# - below, when every round lies below the threshold by more than NOISE_MARGIN of it;
# - above, when every round lies above it by more than the margin;
# - within noise otherwise, and always with fewer than MIN_ROUNDS rounds.
#
# The margin is there because a variant timed against itself, over a few rounds on a loaded
# machine, can land on one side of 1.00 in every round by chance; the same happens about a
# bound. With one or two rounds there is no spread to judge the noise by. The rule is the same
# for every threshold, so the demo, the bench's table and chart, and a target line never
# contradict each other: a target that is "not decidable" is one whose rounds do not lie clearly
# on one side of its bound. Longer rounds (more steps each) or a quieter machine can decide it;
# more rounds alone cannot, as the lowest and highest of more rounds lie further apart.

NOISE_MARGIN = 0.05
"""How far past a threshold, relative to it, every round must lie to count as on that side."""

MIN_ROUNDS = 3
"""Fewer rounds than this say nothing about the noise: their ratio is read as within noise."""


@dataclass(frozen=True)
class Spread:
    """The lowest, median and highest of a set of rounds, and how many rounds there were.

    ``rounds`` is None for a spread written down rather than measured (a figure from a page,
    a test): its range is read as given. Two spreads are equal when their figures are.

    Example:
        >>> Spread.of([1.0, 3.0, 2.0]).format()
        '2.00x (1.00-3.00)'
    """

    low: float
    median: float
    high: float
    rounds: int | None = field(default=None, compare=False)

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one)."""
        return cls(min(values), statistics.median(values), max(values), len(values))

    def format(self, unit: str = "x", scale: float = 1.0, digits: int = 2) -> str:
        """``median (low-high)`` with ``unit`` after the median."""
        low, median, high = (scale * value for value in (self.low, self.median, self.high))
        return f"{median:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"

    def reciprocal(self) -> Spread:
        """The spread of ``1 / value``: a speedup from a ratio of times, say.

        Example:
            >>> Spread(0.5, 0.625, 1.0, 3).reciprocal()
            Spread(low=1.0, median=1.6, high=2.0, rounds=3)
        """
        return Spread(1 / self.high, 1 / self.median, 1 / self.low, self.rounds)


class Side(enum.Enum):
    """Where a spread lies against a threshold."""

    BELOW = "below"
    ABOVE = "above"
    WITHIN_NOISE = "within noise"


def side(spread: Spread, threshold: float) -> Side:
    """Where ``spread`` lies against ``threshold``: the one rule every verdict is read by.

    See NOTE [Reading a ratio from its rounds].

    Example:
        >>> side(Spread(0.80, 0.85, 0.94), 1.0)
        <Side.BELOW: 'below'>
        >>> side(Spread(0.93, 0.95, 0.97), 1.0)  # every round below, but not by the margin
        <Side.WITHIN_NOISE: 'within noise'>
        >>> side(Spread(0.55, 0.60, 0.66, rounds=1), 1.0)  # one round: no spread to judge by
        <Side.WITHIN_NOISE: 'within noise'>

    Args:
        spread: the rounds of a ratio.
        threshold: the value it is read against (positive).

    Returns:
        `Side.BELOW` or `Side.ABOVE` when every round lies on that side by more than
        `NOISE_MARGIN` of ``threshold``, else `Side.WITHIN_NOISE`.
    """
    if spread.rounds is not None and spread.rounds < MIN_ROUNDS:
        return Side.WITHIN_NOISE
    if spread.high < threshold * (1 - NOISE_MARGIN):
        return Side.BELOW
    if spread.low > threshold * (1 + NOISE_MARGIN):
        return Side.ABOVE
    return Side.WITHIN_NOISE


_READINGS = {Side.BELOW: "faster", Side.ABOVE: "slower", Side.WITHIN_NOISE: "same (within noise)"}


def verdict(ratio: Spread) -> str:
    """How to read a ratio of step times (this over a reference): faster, slower, or noise.

    Example:
        >>> verdict(Spread(0.90, 0.96, 1.02))
        'same (within noise)'
        >>> verdict(Spread(0.93, 0.95, 0.97))
        'same (within noise)'
        >>> verdict(Spread(0.55, 0.60, 0.66))
        'faster'
    """
    return _READINGS[side(ratio, 1.0)]


class TargetVerdict(enum.Enum):
    """Whether a target is met, missed, or not decidable at the noise of the rounds."""

    MET = "met"
    MISSED = "missed"
    NOT_DECIDABLE = "not decidable at this noise"


def target_verdict(spread: Spread, bound: float, *, at_least: bool = False) -> TargetVerdict:
    """Whether ``spread`` meets its target, by `side`.

    Example:
        >>> target_verdict(Spread(0.97, 1.00, 1.03), 1.10).value
        'met'
        >>> target_verdict(Spread(0.97, 1.04, 1.15), 1.10).value
        'not decidable at this noise'
        >>> target_verdict(Spread(1.40, 1.45, 1.50), 1.6, at_least=True).value
        'missed'

    Args:
        spread: the rounds of a ratio.
        bound: the target: a ratio of at most this (of at least this with ``at_least``).
        at_least: whether the target is a lower bound.

    Returns:
        `TargetVerdict.MET` when every round lies clearly on the bound's good side,
        `TargetVerdict.MISSED` when every round lies clearly past it, else
        `TargetVerdict.NOT_DECIDABLE`.
    """
    where = side(spread, bound)
    if where is Side.WITHIN_NOISE:
        return TargetVerdict.NOT_DECIDABLE
    return (
        TargetVerdict.MET
        if where is (Side.ABOVE if at_least else Side.BELOW)
        else (TargetVerdict.MISSED)
    )
