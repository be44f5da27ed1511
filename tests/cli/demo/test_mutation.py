"""The demo's allow_mutation_on_saved_tensors case."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_write_through_a_view(rows: list[Row]) -> None:
    """On the view-write case torch's gradient is wrong and ours is right."""
    (row,) = rows_of(rows, "allow_mutation_on_saved_tensors")
    assert row.torch.result == "WRONG gradient", row
    assert row.ours.good, row
    assert row.ours.result == "right gradient"
