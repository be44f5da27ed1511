"""The demo from start to end: the cases it runs, what it says, its exit status."""

from __future__ import annotations

import io
from pathlib import Path

from tensorhooks.cli._demo.case import WARMUP, Case, DemoConfig, Outcome, Result, Row
from tensorhooks.cli._demo.cases import CASES
from tensorhooks.cli._demo.checkpoint import CHECKPOINT_GRAD
from tensorhooks.cli._demo.hooks import SAVED_TENSORS_HOOKS
from tensorhooks.cli._demo.run import DIFFERENCES, demo, run_demo
from tensorhooks.cli._main import _parser

from .conftest import DEFAULT, SMALL, DemoRun

ROOT = Path(__file__).resolve().parents[3]


def _outcome(*, good: bool) -> Outcome:
    return Outcome("ok" if good else "wrong", "detail", good)


def test_a_wrong_tensorhooks_result_exits_1() -> None:
    """A case where tensorhooks does wrong makes the demo say so and exit 1."""
    bad = Case("feature", "peer", "case", lambda shared: Result(*(_outcome(good=False),) * 2))
    stream = io.StringIO()
    assert demo(stream, rounds=1, steps=1, processes=False, width=80, cases=[bad]) == 1
    assert "tensorhooks got a case wrong: feature" in stream.getvalue()


def test_ends_pointing_at_the_differences_page() -> None:
    """The demo's last line names the page that lists every difference from torch."""
    good = Case("feature", "peer", "case", lambda shared: Result(*(_outcome(good=True),) * 2))
    stream = io.StringIO()
    assert demo(stream, rounds=1, steps=1, processes=False, width=80, cases=[good]) == 0
    last = " ".join(" ".join(stream.getvalue().splitlines()[-2:]).split())  # unwrapped
    assert last == DIFFERENCES
    assert "docs/differences.md" in DIFFERENCES
    assert (ROOT / "docs" / "differences.md").is_file()


def test_progress_names_the_features_not_functions() -> None:
    """The progress line says which feature's case is done, never an internal function name."""
    lines: list[str] = []
    run_demo(DemoConfig(SMALL), cases=[CHECKPOINT_GRAD, SAVED_TENSORS_HOOKS], progress=lines.append)
    assert lines == ["done: checkpoint", "done: saved_tensors_hooks"]
    assert not any(case.run.__name__ in line for case in CASES for line in lines)


def test_adding_a_feature_is_one_case() -> None:
    """A case is data around a function of the shared Demo; run_demo takes any list of them."""
    extra = Result(_outcome(good=False), _outcome(good=True))
    case = Case("extra", "peer", "case", lambda shared: extra)
    got = run_demo(DemoConfig(SMALL, rounds=1, steps=1), cases=[case])
    assert got == [Row.of(case, extra)]
    assert got[0].feature == "extra"


def test_default_demo_times_few_steps(demo_run: DemoRun) -> None:
    """By default each of the 7 in-process timed cases runs 1 + 5 x 1 steps a side: 84 in all."""
    assert (DemoConfig.rounds, DemoConfig.steps, WARMUP) == (5, 1, 1)
    assert DEFAULT.timed_steps == 6
    timed_cases = sum(row.timing is not None for row in demo_run.rows)
    assert timed_cases == 7
    assert demo_run.timed == {"torch": 7 * 6, "tensorhooks": 7 * 6}


def test_command_line_defaults_are_the_demos() -> None:
    """`python -m tensorhooks demo` times with DemoConfig's rounds and steps."""
    args = _parser().parse_args(["demo"])
    assert (args.rounds, args.steps) == (DemoConfig.rounds, DemoConfig.steps)
