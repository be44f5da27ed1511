"""The activation planner's GPU rows: ``python benchmarks/plan.py --gpu``, when that script exists.

The planner's own script measures and prints; this part runs it under the part's deadline and
takes into the report what it printed by the conventions every script in ``benchmarks/``
follows: Markdown tables (lines starting with ``|``, titled by the line above them), and lines
starting with ``target met:``, ``TARGET MISSED:`` or ``skipped:``. Without the script the part
is skipped with that reason; in a dry run it is not started (it is the planner's to test).
"""

from __future__ import annotations

import re
import sys
from typing import Any

from .process import run_logged
from .record import FAILED, OK, SKIPPED, TIMEOUT, Recorder, Target

PART = "planner"
SCRIPT = ("benchmarks", "plan.py")
ARGS = ("--gpu", "--rounds", "2")  # the part has 100 s: two rounds of each plan
TARGET_LINE = re.compile(r"^(target met|TARGET MISSED): (.*)$")
CHECKED = re.compile(
    r"^(?P<label>.*) (?P<value>\S+) \(target (?P<bound>[^)]*)\)$"
)  # check_target's


def parse_output(
    text: str, *, part: str = PART
) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[Target]]:
    """The Markdown tables and the target lines of a benchmark script's output (for ``part``).

    Example:
        >>> tables, targets = parse_output(
        ...     "GPU rows\\n| a | b |\\n|---|--:|\\n| x | 1 |\\n"
        ...     "TARGET MISSED: peak 1.2 (target <= 1.05)\\n"
        ... )
        >>> tables
        [('GPU rows', ['a', 'b'], [['x', '1']])]
        >>> targets[0].met, targets[0].name, targets[0].shown, targets[0].bound
        (False, 'peak', '1.2', '<= 1.05')
    """
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    targets: list[Target] = []
    title = ""
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            cells = [cell.strip() for cell in stripped.strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                block.append(cells)
            continue
        if block:
            tables.append((title, block[0], block[1:]))
            block = []
        if match := TARGET_LINE.match(stripped):
            met = match.group(1) == "target met"
            checked = CHECKED.match(match.group(2))
            if checked:
                name, shown, bound = checked.group("label", "value", "bound")
                targets.append(Target(part, name, shown, bound, met))
            else:
                targets.append(Target(part, match.group(2), "", "", met))
        elif stripped:
            title = stripped
    return tables, targets


def run(rec: Recorder, ctx: Any) -> None:
    """Run the planner's script, if there is one, and take in its tables and targets."""
    script = ctx.root.joinpath(*SCRIPT)
    if not script.exists():
        rec.finish(SKIPPED, reason="planner not present (benchmarks/plan.py does not exist)")
        return
    if ctx.dry_run:
        rec.finish(SKIPPED, reason="dry run: the planner's script is only run on a GPU")
        return
    log = ctx.scratch / "plan.log"
    finished = run_logged(
        [sys.executable, str(script), *ARGS, "--out", str(ctx.scratch)],
        log=log,
        limit_s=max(ctx.seconds_left() - 5, 1),
        cwd=ctx.root,
    )
    text = log.read_text(errors="replace")
    print(text)  # into the run's log
    tables, targets = parse_output(text)
    for title, columns, rows in tables:
        rec.table(title or "benchmarks/plan.py --gpu", columns, rows)
    for target in targets:
        rec.target(target)
    skipped = [line for line in text.splitlines() if line.startswith("skipped:")]
    if finished.timed_out:
        rec.finish(TIMEOUT, reason="benchmarks/plan.py --gpu was stopped at the deadline")
    elif finished.returncode != 0:
        rec.finish(FAILED, reason=f"benchmarks/plan.py --gpu exited with {finished.returncode}")
    elif skipped and not tables:
        rec.finish(SKIPPED, reason=skipped[0].removeprefix("skipped:").strip())
    else:
        rec.finish(OK, f"{len(tables)} tables from benchmarks/plan.py --gpu")
