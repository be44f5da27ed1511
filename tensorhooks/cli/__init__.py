"""The command line, ``python -m tensorhooks demo|bench``: see `tensorhooks.cli._main`.

Not part of the library's API: it draws with rich and charts with matplotlib, which come with the
``cli`` extra (``pip install 'tensorhooks[cli]'``).

- `_main`: the argument parser, built from its list of subcommands, and ``main``.
- `_arguments`: what a subcommand is made of (`Subcommand`), the parser, value types.
- `_environment`: the version, the ``cli`` extra, the machine in words.
- `_console`: the rich console, the progress bar, sizes in binary units.
- `_harness`: the one timing harness of the demo, the bench and ``benchmarks/``.
- `_models`: the models they train.
- `_two_processes`: a function run on two local gloo processes, rank 0's result back.
- `_demo/`: ``demo``: torch's contexts and tensorhooks' side by side, one case per situation.
- `_bench/`: ``bench``: every feature timed against torch; a Markdown report and a chart.
- `_plan/`: ``plan``: the activation planner on the tiny Llama; tables and a chart.
- `_explain/`: ``explain``: what holds the tiny Llama's activation peak, the traps, a plan.
"""

from ._main import main

__all__ = ["main"]
