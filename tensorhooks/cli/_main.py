"""``python -m tensorhooks <command>``: the argument parser, built from `SUBCOMMANDS`, and `main`.

The commands draw with rich and chart with matplotlib: both come with the ``cli`` extra
(``pip install 'tensorhooks[cli]'``). Without them a command says so in one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from ._arguments import Parser, Subcommand
from ._bench.command import BENCH
from ._demo.command import DEMO
from ._environment import missing_extras, version
from ._explain.command import EXPLAIN
from ._plan.command import PLAN

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS: tuple[Subcommand, ...] = (DEMO, BENCH, PLAN, EXPLAIN)
"""Every subcommand, in the order ``--help`` lists them: a new command is one entry here."""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m tensorhooks",
        description="tensorhooks' command line: see what it does differently from torch, and "
        "what it costs. Each command has its own --help.",
    )
    parser.add_argument("--version", action="version", version=version())
    names = ",".join(command.name for command in SUBCOMMANDS)
    commands = parser.add_subparsers(dest="command", metavar=f"{{{names}}}")
    for command in SUBCOMMANDS:
        command.add_arguments(
            commands.add_parser(command.name, help=command.help, description=command.description)
        )
    return parser


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
        stream: where output goes (default: standard output).

    Returns:
        The exit status: 0 on success (a missed bench target or a skipped part is reported,
        not an error), 1 when tensorhooks got a demo case wrong, 2 on a usage error or a
        missing ``cli`` extra.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.command is None:
        parser.print_help(out)
        return 2
    missing = missing_extras()
    if missing:
        print(
            f"python -m tensorhooks {args.command}: needs {' and '.join(missing)}; install the "
            "cli extra: pip install 'tensorhooks[cli]'",
            file=sys.stderr,
        )
        return 2
    (command,) = (command for command in SUBCOMMANDS if command.name == args.command)
    return command.run(args, out)
