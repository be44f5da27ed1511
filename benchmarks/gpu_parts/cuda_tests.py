"""Every CUDA test (``pytest -m cuda``), then the offload tests under the CUDA sanitizer.

``run_tests`` runs ``pytest -m cuda tests``: activation offloading (streams and events, the
stream rules with their negative controls, conjugate and negative views, capture refused,
prefetch, pinned pools), torch's own ``save_on_cpu`` conformance cases, mutation during
backward, and parameter streaming. ``run_sanitizer`` runs the offload tests again with
``TORCH_CUDA_SANITIZER=1`` (torch's CSAN, which raises on an unsynchronised access between
streams), less the negative controls; then the negative controls alone under the sanitizer,
where it is expected to catch their deliberate races (a check that the sanitizer run can see a
race at all), except those it cannot model (`CSAN_BLIND`). pytest runs verbosely into a log
that is parsed here, also when it is stopped at the deadline, so the report names every outcome
seen and the test that was running.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .process import run_logged
from .record import FAILED, OK, TIMEOUT, Recorder

PART = "cuda tests"
PYTEST = ("-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "--tb=short")
OFFLOAD_TESTS = ("tests/activation_offload", "tests/parameter_offload")
NEGATIVE_CONTROLS = "_is_caught"  # the stream rules' negative controls end so
RANDOM_PROGRAMS = "test_random_programs_on_cuda"
CSAN_BLIND = {
    "test_hand_over_without_record_stream_is_caught": (
        "not a race CSAN models: it forgets a block's accesses when the block is freed, so "
        "another stream reusing the memory is not seen (the test itself sees the wrong values)"
    ),
}
"""Negative controls whose race the sanitizer cannot see, with the reason (not counted)."""
RESERVE_S = 8.0

OUTCOME = re.compile(
    r"^(?P<id>\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
    r"(?: \((?P<why>.*?)\))?"
)
SHORT = re.compile(r"^(?P<outcome>FAILED|ERROR) (?P<id>\S+::\S+)(?: - (?P<message>.*))?$")
STARTED = re.compile(r"^(?P<id>\S+::\S+) ?$")
SECTION = re.compile(r"^_{3,} (?P<title>\S+) _{3,}$")  # a failure's section: "___ TestX.test_y ___"
ERROR_LINE = re.compile(r"^E {3}(?P<message>\S.*)$")
FINAL = re.compile(r"^=+ (?P<text>.*?) in [\d.]+s(?: \([^)]*\))? =+$")


@dataclass
class PytestRun:
    """What a verbose pytest log says: outcome per test, messages, the closing line, and so on."""

    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    final: str | None = None
    running: str | None = None  # the test that had started and not finished when the log ends

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def describe(self) -> str:
        """``"34 passed, 2 failed"`` from the outcomes seen (pytest's closing line if none)."""
        counts = Counter(self.outcomes.values())
        order = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
        text = ", ".join(f"{counts[o]} {o.lower()}" for o in order if counts[o])
        return text or (self.final or "no test ran")


def parse_log(text: str) -> PytestRun:
    """Read a ``pytest -v`` log (possibly cut short).

    Example:
        >>> run = parse_log(
        ...     "tests/a.py::test_x PASSED [ 50%]\\n"
        ...     "tests/a.py::test_y FAILED [100%]\\n"
        ...     "FAILED tests/a.py::test_y - AssertionError: no\\n"
        ...     "tests/a.py::test_z \\n"
        ... )
        >>> run.describe(), run.messages["tests/a.py::test_y"], run.running
        ('1 passed, 1 failed', 'AssertionError: no', 'tests/a.py::test_z')
    """
    run = PytestRun()
    section: str | None = None  # the failure section being read, as "TestX.test_y"
    for line in text.splitlines():
        if match := SECTION.match(line):
            section = match["title"]
        elif section and (match := ERROR_LINE.match(line)):
            _first_error(run, section, match["message"])
            section = None
        elif match := OUTCOME.match(line):
            run.outcomes[match["id"]] = match["outcome"]
            if match["why"]:
                run.messages.setdefault(match["id"], match["why"])
            run.running = None
        elif (match := SHORT.match(line)) and match["message"]:
            run.messages[match["id"]] = match["message"]
        elif match := FINAL.match(line):
            run.final = match["text"]
        elif (match := STARTED.match(line)) and match["id"] not in run.outcomes:
            run.running = match["id"]
    return run


def _first_error(run: PytestRun, section: str, message: str) -> None:
    """Take a failure section's first ``E`` line as the message of the test it is about.

    Verbose pytest leaves the message out of its short summary; the section is titled by the
    test's class and name (``TestX.test_y[param]``), without the file.
    """
    for test in run.outcomes:
        if ".".join(test.split("::")[1:]) == section:
            run.messages.setdefault(test, message)


def pytest(
    ctx: Any, label: str, args: list[str], *, limit_s: float, sanitizer: bool = False
) -> tuple[PytestRun, int | None]:
    """Run pytest with ``args`` under ``limit_s``; its parsed log and exit status (None: late)."""
    env = dict(os.environ)
    # The suite as CI runs it: the checkout on the path, not the benchmark scripts beside it.
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    scripts = ctx.root / "benchmarks"
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p and Path(p).resolve() != scripts)
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    log = ctx.scratch / f"{label}.log"
    argv = [sys.executable, *PYTEST, *args]
    print(f"$ {'TORCH_CUDA_SANITIZER=1 ' if sanitizer else ''}{' '.join(argv[1:])}", flush=True)
    finished = run_logged(argv, log=log, limit_s=max(limit_s, 1.0), env=env, cwd=ctx.root)
    text = log.read_text(errors="replace")
    print(text, flush=True)  # into the run's log
    return parse_log(text), finished.returncode


def _per_file(run: PytestRun) -> list[list[str]]:
    files: dict[str, Counter[str]] = {}
    for test, outcome in run.outcomes.items():
        files.setdefault(test.split("::")[0], Counter())[outcome] += 1
    rows = []
    for name, counts in sorted(files.items()):
        rows.append([name, *(str(counts[o]) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED"))])
    return rows


def _not_passed(run: PytestRun) -> list[list[str]]:
    return [
        [test, outcome.lower(), run.messages.get(test, "")[:200]]
        for test, outcome in run.outcomes.items()
        if outcome not in ("PASSED", "XFAIL")
    ]


def _record(rec: Recorder, title: str, run: PytestRun) -> None:
    rec.table(
        f"{title}: outcome per file",
        ["file", "passed", "failed", "errors", "skipped"],
        _per_file(run),
    )
    rows = _not_passed(run)
    if rows:
        rec.table(f"{title}: tests that did not pass", ["test", "outcome", "message"], rows)


def _verdict(
    rec: Recorder, ctx: Any, run: PytestRun, returncode: int | None, label: str
) -> str | None:
    """The reason this pytest run is a failure, or None."""
    if returncode is None:
        where = f" while {run.running} was running" if run.running else ""
        return f"{label}: stopped at the deadline{where}, after {run.describe()}"
    if run.count("FAILED") or run.count("ERROR"):
        return f"{label}: {run.describe()}"
    if returncode not in (0, 5) or (returncode == 5 and not ctx.dry_run):
        return f"{label}: pytest exited with {returncode} ({run.final or 'no closing line'})"
    if not ctx.dry_run and run.outcomes and run.count("PASSED") == 0:
        return f"{label}: every test was skipped ({run.describe()}); CUDA not seen by pytest?"
    return None


def run_tests(rec: Recorder, ctx: Any) -> None:
    """``pytest -m cuda tests``."""
    run, returncode = pytest(ctx, "cuda", ["tests"], limit_s=ctx.seconds_left() - RESERVE_S)
    _record(rec, "pytest -m cuda", run)
    rec.put("outcomes", run.outcomes)
    problem = _verdict(rec, ctx, run, returncode, "pytest -m cuda")
    status = OK if problem is None else (TIMEOUT if returncode is None else FAILED)
    rec.finish(status, run.describe(), problem)


def run_sanitizer(rec: Recorder, ctx: Any) -> None:
    """The offload tests under ``TORCH_CUDA_SANITIZER=1``, the negative controls, random programs.

    Three pytest runs, so that the slowest (the property test of random programs, many examples,
    each kernel launch checked by the sanitizer in Python) cannot hold back the others: the
    offload tests less that one and the negative controls (half of the time), the negative
    controls (a fifth), then the random programs with what is left. Random programs stopped at
    the deadline are reported as not finished, not as a failure.
    """
    budget = ctx.seconds_left() - RESERVE_S
    main, main_code = pytest(
        ctx,
        "sanitizer",
        [*OFFLOAD_TESTS, "-k", f"not {NEGATIVE_CONTROLS} and not {RANDOM_PROGRAMS}"],
        limit_s=budget * 0.5,
        sanitizer=True,
    )
    _record(rec, "offload tests under the sanitizer", main)
    rec.put("outcomes", main.outcomes)
    controls, controls_code = pytest(
        ctx,
        "controls",
        [OFFLOAD_TESTS[0], "-k", NEGATIVE_CONTROLS],
        limit_s=budget * 0.2,
        sanitizer=True,
    )
    seen, expected = _controls(rec, controls)
    random, random_code = pytest(
        ctx,
        "random",
        [OFFLOAD_TESTS[0], "-k", RANDOM_PROGRAMS],
        limit_s=ctx.seconds_left() - RESERVE_S,
        sanitizer=True,
    )
    _record(rec, "random programs under the sanitizer", random)
    problems = [
        problem
        for problem in (
            _verdict(rec, ctx, main, main_code, "offload tests under the sanitizer"),
            None
            if random_code is None
            else _verdict(rec, ctx, random, random_code, "random programs under the sanitizer"),
        )
        if problem
    ]
    summary = f"{main.describe()}; sanitizer caught {seen} of the {expected} negative controls "
    summary += "it can see" + (" (stopped at the deadline)" if controls_code is None else "")
    summary += "; random programs " + (
        "not finished by the deadline" if random_code is None else random.describe()
    )
    if random_code is None:
        rec.note(
            "The property test of random programs under the sanitizer was stopped at the "
            "deadline: no race was reported in the examples it ran, but it did not finish."
        )
    status = OK if not problems else (TIMEOUT if main_code is None else FAILED)
    rec.finish(status, summary, "; ".join(problems) or None)


def _controls(rec: Recorder, controls: PytestRun) -> tuple[int, int]:
    """Record the negative controls' outcomes; how many the sanitizer caught, of those it can."""
    rows = []
    for test, outcome in controls.outcomes.items():
        name = test.split("::")[-1]
        message = controls.messages.get(test, "")
        caught = outcome in ("FAILED", "ERROR") and "sanitizer" in message.lower()
        seen = "yes" if caught else CSAN_BLIND.get(name, "no")
        rows.append([name, outcome.lower(), seen, message[:160]])
    rec.table(
        "Negative controls under the sanitizer (deliberate races: expected caught)",
        ["test", "outcome", "caught by the sanitizer", "message"],
        rows,
    )
    expected = sum(1 for row in rows if row[0] not in CSAN_BLIND)
    return sum(1 for row in rows if row[2] == "yes"), expected
