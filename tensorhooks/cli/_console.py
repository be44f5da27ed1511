"""How the command line prints: a rich console, a progress bar, sizes in binary units."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["format_bytes", "make_console", "progress"]


def make_console(stream: TextIO | None = None, width: int | None = None) -> Console:
    """A rich console writing to ``stream`` (standard output by default)."""
    return Console(file=stream, width=width, highlight=False)


@contextlib.contextmanager
def progress(
    console: Console, total: int, description: str, *, lines: bool = False
) -> Iterator[Callable[[str], None]]:
    """A progress bar over ``total`` steps; yields ``advance(description_of_next_step)``.

    Where the console is not a terminal (piped, redirected to a log) a bar shows nothing; with
    ``lines`` each step then prints one line instead: ``[3/11, 25s] CPU round 3``.
    """
    if lines and not console.is_terminal:
        started, done = time.perf_counter(), 0

        def log(next_description: str) -> None:
            nonlocal done
            done += 1
            elapsed = time.perf_counter() - started
            console.print(f"[{done}/{total}, {elapsed:.0f}s] {next_description}", markup=False)

        yield log
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(next_description: str) -> None:
            bar.update(task, advance=1, description=next_description)

        yield advance


def format_bytes(count: float) -> str:
    """Bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**20)
        '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"
