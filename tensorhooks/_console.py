"""Terminal output for ``python -m tensorhooks``: rich when installed, plain text otherwise.

The command line never needs more than torch. With the ``cli`` extra installed (``pip install
'tensorhooks[cli]'``) progress bars and tables are drawn by rich; without it, or with
``--plain``, the same information is printed as plain text that also reads well in a log file.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Generator, Sequence
from typing import Any, Protocol, TextIO

__all__ = [
    "Console",
    "PlainConsole",
    "Progress",
    "RichConsole",
    "make_console",
    "markdown_table",
    "plain_table",
]


class Progress(Protocol):
    """A running progress indicator."""

    def advance(self, description: str) -> None:
        """Mark one more unit of work done; ``description`` names the unit that follows."""
        ...


class Console(Protocol):
    """Where the command line writes: lines, tables and progress."""

    rich: bool

    def line(self, text: str = "") -> None:
        """Print one line of text."""
        ...

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """Print a table with a title."""
        ...

    def progress(self, total: int, description: str) -> contextlib.AbstractContextManager[Progress]:
        """Show progress over ``total`` units of work while the context is open."""
        ...


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render a table as aligned plain-text columns.

    Example:
        >>> print(plain_table(["feature", "ok"], [["plain", "yes"], ["hooks", "no"]]))
        feature  ok
        -------  ---
        plain    yes
        hooks    no

    Args:
        columns: the column titles.
        rows: one sequence of cells per row, as many as there are columns.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    widths = [len(title) for title in columns]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
        for cells in (columns, ["-" * width for width in widths], *rows)
    ]
    return "\n".join(lines)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render a table as GitHub-flavoured Markdown.

    Example:
        >>> print(markdown_table(["mode", "ratio"], [["hooks", "1.02x"]]))
        | mode | ratio |
        |---|---|
        | hooks | 1.02x |

    Args:
        columns: the column titles.
        rows: one sequence of cells per row; ``|`` in a cell is escaped.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """

    def render(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([render(columns), "|" + "---|" * len(columns), *map(render, rows)])


class _PlainProgress:
    """Progress as text: an updating bar on a terminal, a line per tenth of the work in a log."""

    def __init__(self, stream: TextIO, total: int, description: str) -> None:
        self._stream = stream
        self._total = max(total, 1)
        self._done = 0
        self._tty = stream.isatty()
        self._started = time.perf_counter()
        self._last_reported = -1
        self._show(description)

    def advance(self, description: str) -> None:
        self._done = min(self._done + 1, self._total)
        self._show(description)

    def _show(self, description: str) -> None:
        elapsed = time.perf_counter() - self._started
        if self._tty:
            filled = 30 * self._done // self._total
            bar = "#" * filled + "." * (30 - filled)
            status = f"\r[{bar}] {self._done}/{self._total} {elapsed:5.1f}s {description}"
            self._stream.write(status.ljust(100)[:100])
            self._stream.flush()
            return
        # In a log, one line per tenth of the work keeps the output short.
        tenth = 10 * self._done // self._total
        if tenth != self._last_reported:
            self._last_reported = tenth
            self._stream.write(f"  [{self._done}/{self._total}] {elapsed:5.1f}s {description}\n")
            self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


class PlainConsole:
    """Plain-text output to a stream; needs nothing beyond the standard library."""

    rich = False

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def line(self, text: str = "") -> None:
        """Print one line of text."""
        self._stream.write(text + "\n")
        self._stream.flush()

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """Print a title and an aligned plain-text table."""
        self.line(title)
        self.line(plain_table(columns, rows))

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Generator[Progress, None, None]:
        """Show a text progress bar (or log lines when the stream is not a terminal)."""
        progress = _PlainProgress(self._stream, total, description)
        try:
            yield progress
        finally:
            progress.close()


class _RichProgress:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress = progress
        self._task = task

    def advance(self, description: str) -> None:
        self._progress.update(self._task, advance=1, description=description)


class RichConsole:
    """Output drawn by rich (the ``cli`` extra)."""

    rich = True

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console as _RichConsole  # noqa: PLC0415  # optional dependency

        # Logs and pipes have no width: give tables room instead of rich's 80-column default.
        width = None if stream.isatty() or "COLUMNS" in os.environ else 120
        self._console = _RichConsole(file=stream, highlight=False, width=width)

    def line(self, text: str = "") -> None:
        """Print one line of text (no markup is interpreted)."""
        self._console.print(text, markup=False)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """Print a rich table."""
        from rich.table import Table  # noqa: PLC0415  # optional dependency

        table = Table(title=title, title_justify="left")
        for index, column in enumerate(columns):
            # Only the last column (free text) wraps; names and figures stay on one line.
            table.add_column(column, no_wrap=index < len(columns) - 1, overflow="fold")
        for row in rows:
            table.add_row(*row)
        self._console.print(table)

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Generator[Progress, None, None]:
        """Show a rich progress bar with elapsed time."""
        from rich import progress  # noqa: PLC0415  # optional dependency

        columns = (
            progress.SpinnerColumn(),
            progress.BarColumn(),
            progress.MofNCompleteColumn(),
            progress.TimeElapsedColumn(),
            progress.TextColumn("{task.description}"),
        )
        with progress.Progress(*columns, console=self._console, transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield _RichProgress(bar, task)


def make_console(stream: TextIO, *, plain: bool = False) -> Console:
    """Return rich output when rich is importable and ``plain`` is false, else plain text.

    Args:
        stream: where to write.
        plain: force plain text even when rich is installed.

    Returns:
        A `Console`.
    """
    if not plain:
        try:
            return RichConsole(stream)
        except ImportError:
            pass
    return PlainConsole(stream)
