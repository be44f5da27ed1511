"""What a part of the GPU runner records: tables, design targets and numbers, written as it goes.

A part runs in a process of its own. It writes its result file (JSON) after every table and
target, so that when the runner stops it at its time limit, what was measured before is kept.
Imports no torch: the runner and the tests of the report read these records too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# How the runner tells a part where to write and when its time is up (seconds since the epoch).
RESULT_ENV = "TENSORHOOKS_GPU_RESULT"
DEADLINE_ENV = "TENSORHOOKS_GPU_DEADLINE"

# A part's status, as the report shows it.
OK = "ok"
FAILED = "failed"
TIMEOUT = "timeout"
SKIPPED = "skipped"
RUNNING = "running"


@dataclass(frozen=True)
class Target:
    """One design target, evaluated: what was measured, the bound, and whether it was met.

    ``met`` is None when the value could not be measured (the reason is in ``detail``).
    """

    part: str
    name: str
    shown: str
    bound: str
    met: bool | None
    detail: str = ""
    value: float | None = None

    @property
    def verdict(self) -> str:
        """``met``, ``MISSED`` or ``not measured``, as the report's tables say it."""
        if self.met is None:
            return "not measured"
        return "met" if self.met else "MISSED"


def evaluate(
    part: str,
    name: str,
    value: float | None,
    *,
    at_most: float | None = None,
    at_least: float | None = None,
    fmt: str = "{:.2f}",
    detail: str = "",
    missing: str = "not measured",
) -> Target:
    """Evaluate ``value`` against one bound (``at_most`` or ``at_least``).

    ``detail`` (the numbers behind the value, what limits it) is shown when ``value`` was
    measured, ``missing`` (why it was not) when it is None.

    Example:
        >>> evaluate("p", "ratio", 0.25, at_most=0.30).verdict
        'met'
        >>> evaluate("p", "ratio", None, at_least=0.8, missing="no copies seen").detail
        'no copies seen'
    """
    if (at_most is None) == (at_least is None):
        raise ValueError(f"evaluate({name!r}): give exactly one of at_most and at_least")
    bound_value = at_most if at_most is not None else at_least
    bound = ("<= " if at_most is not None else ">= ") + fmt.format(bound_value)
    if value is None:
        return Target(part, name, "-", bound, None, missing, None)
    met = value <= at_most if at_most is not None else value >= at_least  # type: ignore[operator]
    return Target(part, name, fmt.format(value), bound, met, detail, float(value))


@dataclass(frozen=True)
class Table:
    """A Markdown table: a title above it, cells already formatted, notes below it."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[str]]
    notes: Sequence[str] = ()


def seconds_left(default: float = 3600.0) -> float:
    """Seconds until this part's deadline (``default`` when run without the runner)."""
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline is None:
        return default
    return float(deadline) - time.time()


class Recorder:
    """A part's result, rewritten to its file (when it has one) after every change.

    Example:
        >>> rec = Recorder(None, "demo")
        >>> rec.table("t", ["a"], [["1"]])
        >>> rec.finish(OK, "one table")
        >>> rec.result["status"], len(rec.result["tables"])
        ('ok', 1)
    """

    def __init__(self, path: Path | None, part: str) -> None:
        self.path = path
        self.part = part
        self.result: dict[str, Any] = {
            "status": RUNNING,
            "summary": "",
            "reason": None,
            "tables": [],
            "targets": [],
            "notes": [],
            "data": {},
        }
        self._flush()

    @classmethod
    def from_environment(cls, part: str) -> Recorder:
        """The recorder the runner asked for (``RESULT_ENV``), or one that keeps to memory."""
        path = os.environ.get(RESULT_ENV)
        return cls(Path(path) if path else None, part)

    def table(
        self,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        notes: Sequence[str] = (),
    ) -> None:
        """Add a table (cells are strings, formatted by the part)."""
        self.result["tables"].append(asdict(Table(title, list(columns), rows, list(notes))))
        self._flush()

    def target(self, target: Target) -> None:
        """Add an evaluated design target."""
        self.result["targets"].append(asdict(target) | {"verdict": target.verdict})
        self._flush()

    def note(self, text: str) -> None:
        """Add a sentence shown under the part's tables."""
        self.result["notes"].append(text)
        self._flush()

    def put(self, key: str, value: Any) -> None:
        """Keep a raw number (or any JSON value) under ``data``."""
        self.result["data"][key] = value
        self._flush()

    def summary(self, text: str) -> None:
        """Set the one-line summary (kept if the part is stopped later)."""
        self.result["summary"] = text
        self._flush()

    def finish(self, status: str, summary: str | None = None, reason: str | None = None) -> None:
        """Set the final status, and the summary and reason when given."""
        self.result["status"] = status
        if summary is not None:
            self.result["summary"] = summary
        if reason is not None:
            self.result["reason"] = reason
        self._flush()

    def _flush(self) -> None:
        if self.path is None:
            return
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(partial, self.path)  # a reader never sees half a file


def load(path: Path) -> dict[str, Any] | None:
    """A part's result file, or None when it wrote none (or it cannot be read)."""
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded


def targets_met(targets: Sequence[dict[str, Any]]) -> str:
    """``"2 of 3 targets met"``, or ``""`` without targets.

    Example:
        >>> targets_met([{"met": True}, {"met": False}, {"met": None}])
        '1 of 3 targets met (1 not measured)'
    """
    if not targets:
        return ""
    met = sum(1 for t in targets if t["met"] is True)
    unknown = sum(1 for t in targets if t["met"] is None)
    text = f"{met} of {len(targets)} targets met"
    return text + (f" ({unknown} not measured)" if unknown else "")
