"""The demo's plan_activations case."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_plan_row(rows: list[Row]) -> None:
    """Torch's eager step ignores the budget; tensorhooks' planned step holds within it."""
    (row,) = rows_of(rows, "plan_activations")
    assert row.torch.result == "ignores the budget", row
    assert not row.torch.good
    assert "torch.compile" in row.torch.detail
    assert row.ours.result == "within the budget", row
    assert row.ours.good
    assert row.timing is None
