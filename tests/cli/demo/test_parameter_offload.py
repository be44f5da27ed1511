"""The demo's offload_parameters case."""

from __future__ import annotations

import re

import torch

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_offload_parameters_row(rows: list[Row]) -> None:
    """.grad() works through offloaded blocks, which ran on copies and left none behind."""
    (row,) = rows_of(rows, "offload_parameters")
    assert row.torch.result == "no counterpart"
    assert row.ours.result == "on the host", row
    assert row.ours.good, row
    copies = "device copies" if torch.cuda.is_available() else "fresh copies of their parameters"
    assert re.search(rf"the gradient; (\d+) of \1 blocks ran on {copies}", row.ours.detail)
    assert "after it 0 B of " in row.ours.detail
    assert row.timing is not None


def test_no_device_spoken_of_without_one(rows: list[Row]) -> None:
    """On CPU the row says where the copies are made, and no word of it speaks of a device."""
    (row,) = rows_of(rows, "offload_parameters")
    words = (row.situation, row.torch.detail, row.ours.detail, row.timed)
    assert all("device" not in text.replace("no device here", "") for text in words), words
    assert "no device here: made in host memory" in row.ours.detail
    assert row.torch.detail.endswith("of parameters stay resident")
