"""What the demo prints."""

from __future__ import annotations

import io
import re

from tensorhooks.cli._console import make_console
from tensorhooks.cli._demo.case import Row
from tensorhooks.cli._demo.render import show_demo


def test_reads_at_80_columns(rows: list[Row]) -> None:
    """At 80 columns no line is wider, and every feature name is printed whole."""
    stream = io.StringIO()
    show_demo(make_console(stream, width=80), rows)
    output = stream.getvalue()
    assert max(len(line) for line in output.splitlines()) <= 80
    summary = output[output.index("Summary") :]
    for row in rows:
        assert re.search(rf"│ {re.escape(row.feature)} +│", summary), row.feature
    assert "…" not in output
    assert "..." not in output


def test_each_case_names_its_peer(rows: list[Row]) -> None:
    """Above each case the peer's column is named after it: DDP, torch.utils.checkpoint, ..."""
    stream = io.StringIO()
    show_demo(make_console(stream, width=80), rows)
    output = stream.getvalue()
    peers = {row.feature: row.peer for row in rows}
    assert peers["distributed.sync_gradients"] == "DDP"
    assert peers["checkpoint"] == "torch.utils.checkpoint"
    assert peers["offload_parameters"] == "fairscale / FSDP2 offload"
    assert peers["allow_mutation_on_saved_tensors"] == "torch.autograd.graph"
    headers = re.findall(r"^ (\S.*?\S) {2,}tensorhooks +$", output, re.M)
    assert headers == [row.peer for row in rows]
