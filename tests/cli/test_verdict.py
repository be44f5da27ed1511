"""The one rule that reads a ratio from its rounds, and the places that use it agree."""

from __future__ import annotations

import pytest

from tensorhooks.cli._bench.chart import VERDICT_COLORS
from tensorhooks.cli._bench.results import Checked, Comparison, Target
from tensorhooks.cli._bench.run import _target_lines
from tensorhooks.cli._demo.render import ratio_cell
from tensorhooks.cli._harness import TARGET_MARKERS, Timings, check_target
from tensorhooks.cli._verdict import (
    MIN_ROUNDS,
    Side,
    Spread,
    TargetVerdict,
    side,
    target_verdict,
    verdict,
)


def test_noise_is_not_a_win() -> None:
    """A ratio whose rounds straddle 1.00, or lie within the margin of it, reads as noise."""
    assert verdict(Spread(0.90, 0.96, 1.02)) == "same (within noise)"
    assert verdict(Spread(0.93, 0.95, 0.97)) == "same (within noise)"
    assert verdict(Spread(1.01, 1.02, 1.03)) == "same (within noise)"
    assert verdict(Spread(1.06, 1.08, 1.10)) == "slower"
    assert verdict(Spread(0.80, 0.85, 0.94)) == "faster"


@pytest.mark.parametrize(
    ("spread", "threshold", "expected"),
    [
        (Spread(0.80, 0.85, 0.94, 5), 1.0, Side.BELOW),  # every round below 0.95
        (Spread(0.80, 0.85, 0.95, 5), 1.0, Side.WITHIN_NOISE),  # one round at the margin
        (Spread(1.06, 1.08, 1.10, 5), 1.0, Side.ABOVE),  # every round above 1.05
        (Spread(1.05, 1.08, 1.10, 5), 1.0, Side.WITHIN_NOISE),
        (Spread(0.70, 1.00, 1.30, 5), 1.0, Side.WITHIN_NOISE),  # straddles
        (Spread(0.50, 0.50, 0.50, 1), 1.0, Side.WITHIN_NOISE),  # one round: no spread
        (Spread(0.50, 0.50, 0.50, 2), 1.0, Side.WITHIN_NOISE),
        (Spread(0.50, 0.50, 0.50, MIN_ROUNDS), 1.0, Side.BELOW),
        (Spread(0.50, 0.50, 0.50), 1.0, Side.BELOW),  # written down: read as given
        # About a bound, the margin is relative to the bound: 5% of 0.625 is 0.03125.
        (Spread(0.64, 0.68, 0.84, 21), 0.625, Side.WITHIN_NOISE),
        (Spread(0.66, 0.68, 0.84, 21), 0.625, Side.ABOVE),
        (Spread(0.50, 0.55, 0.59, 21), 0.625, Side.BELOW),
    ],
)
def test_side_on_constructed_spreads(spread: Spread, threshold: float, expected: Side) -> None:
    """Below or above only when every round is past the threshold by the margin, with 3+ rounds."""
    assert side(spread, threshold) is expected


@pytest.mark.parametrize(
    ("spread", "bound", "at_least", "expected"),
    [
        (Spread(0.97, 1.00, 1.03, 11), 1.10, False, TargetVerdict.MET),
        (Spread(0.97, 1.04, 1.15, 11), 1.10, False, TargetVerdict.NOT_DECIDABLE),
        (Spread(1.16, 1.20, 1.30, 11), 1.10, False, TargetVerdict.MISSED),
        (Spread(1.10, 1.20, 1.30, 11), 1.10, False, TargetVerdict.NOT_DECIDABLE),  # at the bound
        (Spread(1.70, 1.80, 1.90, 11), 1.6, True, TargetVerdict.MET),
        (Spread(1.25, 1.49, 1.63, 11), 1.6, True, TargetVerdict.NOT_DECIDABLE),
        (Spread(1.25, 1.40, 1.50, 11), 1.6, True, TargetVerdict.MISSED),
        (Spread(0.50, 0.50, 0.50, 1), 1.10, False, TargetVerdict.NOT_DECIDABLE),  # one round
    ],
)
def test_targets_met_missed_or_not_decidable(
    spread: Spread, bound: float, at_least: bool, expected: TargetVerdict
) -> None:
    """A target is met or missed only when every round lies clearly on one side of its bound."""
    assert target_verdict(spread, bound, at_least=at_least) is expected


def test_speedup_reads_as_the_ratio_it_inverts() -> None:
    """A speedup's spread is the reciprocal of the ratio's, so both read the same against 1.00."""
    ratio = Spread(0.60, 0.68, 0.80, 11)
    speedup = ratio.reciprocal()
    assert (speedup.low, speedup.high) == (1 / 0.80, 1 / 0.60)
    assert target_verdict(speedup, 1.6, at_least=True) is TargetVerdict.NOT_DECIDABLE
    assert side(ratio, 1.0) is Side.BELOW
    assert side(speedup, 1.0) is Side.ABOVE


@pytest.mark.parametrize(
    "spread",
    [
        Spread(0.80, 0.85, 0.94, 5),
        Spread(1.06, 1.08, 1.10, 5),
        Spread(0.90, 0.96, 1.02, 5),
        Spread(0.60, 0.60, 0.60, 1),
    ],
)
def test_demo_bench_and_chart_read_a_ratio_alike(
    spread: Spread, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's cell, the chart's colour and a target of 1.00 say the same of one ratio."""
    reading = side(spread, 1.0)
    cell = ratio_cell(spread)
    assert cell.endswith({Side.BELOW: "faster", Side.ABOVE: "slower"}.get(reading, "noise"))
    colour = {Side.BELOW: "tab:green", Side.ABOVE: "tab:red", Side.WITHIN_NOISE: "tab:gray"}
    assert VERDICT_COLORS[reading] == colour[reading]
    met = check_target("ratio", spread, at_most=1.0)
    target = {
        Side.BELOW: TargetVerdict.MET,
        Side.ABOVE: TargetVerdict.MISSED,
        Side.WITHIN_NOISE: TargetVerdict.NOT_DECIDABLE,
    }[reading]
    assert capsys.readouterr().out.startswith(TARGET_MARKERS[target])
    assert met == (target is TargetVerdict.MET)


def test_bench_prints_no_missed_target_within_noise() -> None:
    """A bench target whose rounds straddle its bound prints 'not decidable', never MISSED."""
    timings = Timings({"ours": [1.0, 1.2, 0.97], "torch": [1.0, 1.0, 1.0]})
    checked = Target("ours", "torch", 1.10, "x torch").check(timings)
    assert checked == Checked("x torch", Spread(0.97, 1.0, 1.2), TargetVerdict.NOT_DECIDABLE, 1.10)
    spread = Spread(0.97, 1.0, 1.2)
    row = Comparison("feature", spread, spread, spread, (checked,))
    (line,) = _target_lines([row])
    assert "TARGET MISSED" not in line
    assert line == (
        "[yellow]target not decidable:[/] feature at 1.000x torch, rounds 0.970-1.200 (at most 1.1)"
    )
