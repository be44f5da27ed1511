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
