"""The demo's explain case."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_explain_row(rows: list[Row]) -> None:
    """Torch runs the trapped step without a word; tensorhooks names the trap and its fix."""
    (row,) = rows_of(rows, "explain")
    assert row.torch.result == "says nothing", row
    assert not row.torch.good
    assert "what checkpointing each layer holds" in row.torch.detail
    assert row.ours.result == "names the trap", row
    assert row.ours.good
    assert "checkpoint the layer itself" in row.ours.detail
    assert row.timing is None
