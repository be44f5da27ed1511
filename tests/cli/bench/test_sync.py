"""The bench's sync_gradients part, on two processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tensorhooks.cli._bench.results import BenchOptions
from tensorhooks.cli._bench.sync import STARTUP_SECONDS, SyncConfig, run_sync, sync_seconds
from tensorhooks.cli._verdict import TargetVerdict, target_verdict


@pytest.mark.slow
def test_sync_gradients_part_on_two_processes() -> None:
    """Two gloo processes: a row against DDP over the unsynchronised step, equal gradients."""
    config = SyncConfig(layers=2, width=32, batch=4, warmup=1)
    row, described = run_sync(BenchOptions(Path("."), rounds=2, steps=2), config)
    assert row.mode == "sync_gradients vs DDP (2 processes)"
    for spread in (row.torch, row.ours, row.ours_over_torch):
        assert spread is not None
        assert 0 < spread.low <= spread.median <= spread.high
    ((label, spread, reading, bound),) = row.targets
    assert (label, bound) == ("x DDP", 1.10)
    assert reading is target_verdict(spread, 1.10)
    assert reading is TargetVerdict.NOT_DECIDABLE  # two rounds say nothing about the noise
    assert "2 rounds x 2 steps" in described
    difference = float(re.search(r"vs DDP (\S+)$", described).group(1))  # type: ignore[union-attr]
    assert difference < 1e-6


def test_the_estimate_grows_with_rounds_and_steps() -> None:
    """sync_seconds: the start-up, plus a step timed here for every call the rounds make."""
    config = SyncConfig(layers=2, width=32, batch=4, warmup=1)
    short = sync_seconds(BenchOptions(Path("."), rounds=1, steps=1), config)
    long = sync_seconds(BenchOptions(Path("."), rounds=100, steps=100), config)
    assert STARTUP_SECONDS < short < long
