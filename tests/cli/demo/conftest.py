"""The demo's rows, run once for every test module of the demo: each module reads its own cases."""

from __future__ import annotations

import pytest

from tensorhooks.cli._demo.case import DemoConfig, Row
from tensorhooks.cli._demo.run import run_demo
from tensorhooks.cli._models import ModelConfig

SMALL = ModelConfig(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32)


@pytest.fixture(scope="session")
def rows() -> list[Row]:
    """Every case but the two-process one, on a tiny model, timed once."""
    config = DemoConfig(SMALL, rounds=1, steps=1, processes=False)
    return run_demo(config)


def rows_of(rows: list[Row], feature: str) -> list[Row]:
    """The rows of one feature, in the demo's order."""
    return [row for row in rows if row.feature == feature]
