"""The demo's offload_parameters case."""

from __future__ import annotations

import re

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_offload_parameters_row(rows: list[Row]) -> None:
    """.grad() works through offloaded blocks, which ran on copies and left none behind."""
    (row,) = rows_of(rows, "offload_parameters")
    assert row.torch.result == "no counterpart"
    assert row.ours.result == "on the host", row
    assert row.ours.good, row
    assert re.search(r"the gradient; (\d+) of \1 blocks ran on device copies", row.ours.detail)
    assert "after it 0 B of " in row.ours.detail
    assert row.timing is not None
