"""The demo's rows, run once for every test module of the demo: each module reads its own cases."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from tensorhooks.cli._demo import case
from tensorhooks.cli._demo.case import DemoConfig, Row
from tensorhooks.cli._demo.run import run_demo
from tensorhooks.cli._harness import Timings
from tensorhooks.cli._models import ModelConfig

SMALL = ModelConfig(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32)


DEFAULT = DemoConfig(SMALL, processes=False)
"""The demo's default rounds and steps, on a tiny model, without the two-process case."""


@dataclass(frozen=True)
class DemoRun:
    """The rows of one run of the demo, and how many steps of each side it timed."""

    rows: list[Row]
    timed: Counter[str]


@pytest.fixture(scope="session")
def demo_run() -> DemoRun:
    """Every case but the two-process one, on a tiny model, with the default timing."""
    timed: Counter[str] = Counter()
    real = case.interleaved

    def counting(variants: Mapping[str, Callable[[], object]], **options: Any) -> Timings:
        def counted(name: str, step: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                timed[name] += 1
                return step()

            return run

        return real({name: counted(name, step) for name, step in variants.items()}, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(case, "interleaved", counting)
        return DemoRun(run_demo(DEFAULT), timed)


@pytest.fixture(scope="session")
def rows(demo_run: DemoRun) -> list[Row]:
    """The rows of `demo_run`."""
    return demo_run.rows


def rows_of(rows: list[Row], feature: str) -> list[Row]:
    """The rows of one feature, in the demo's order."""
    return [row for row in rows if row.feature == feature]
