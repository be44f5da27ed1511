"""The demo's sync_gradients case, on two processes."""

from __future__ import annotations

import pytest

from tensorhooks.cli._demo.case import Demo, DemoConfig
from tensorhooks.cli._demo.distributed import SYNC_GRADIENTS

from .conftest import SMALL


@pytest.mark.slow
def test_sync_gradients_case_on_two_processes() -> None:
    """Two gloo processes: DDP raises on the unused parameter, sync_gradients trains."""
    result = SYNC_GRADIENTS.run(Demo(DemoConfig(SMALL, rounds=1, steps=1)))
    assert result.torch.result == "raises at step 2"
    assert result.ours.good
    assert result.ours.result == "trains"
    assert result.timing is not None
