"""The demo's save_on_cpu case."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_dropped_graph(rows: list[Row]) -> None:
    """Torch keeps a dropped graph's tensors until a gc pass; ours frees them at once."""
    (save,) = rows_of(rows, "save_on_cpu")
    assert save.torch.result.startswith("keeps "), save
    assert save.ours.result == "frees it at once"
