"""What every subcommand of the command line is made of: its record, the parser, value types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TextIO

__all__ = ["Parser", "Subcommand", "at_least_one"]


@dataclass(frozen=True)
class Subcommand:
    """One subcommand: its name, what ``--help`` says, its arguments, and what it runs.

    ``run`` gets the parsed arguments and the output stream and returns the exit status; it
    imports what it needs (rich, matplotlib, the models) when it runs, so that ``--help`` and a
    usage error stay fast.
    """

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, TextIO], int]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, naming the (sub)command."""

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and one line on standard error."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def at_least_one(text: str) -> int:
    """A whole number of at least 1, for counts of rounds and steps.

    Example:
        >>> at_least_one("3")
        3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
