"""Hypothesis profiles and the fixtures every test module shares."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

import tensorhooks

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _store_is_empty_after_each_test() -> Iterator[None]:
    """Every test must leave no per-backward state behind."""
    yield
    assert tensorhooks.live_graph_tasks() == 0, "graph-task state leaked past backward"
