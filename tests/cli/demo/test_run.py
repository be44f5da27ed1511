"""The demo from start to end: the cases it runs, what it says, its exit status."""

from __future__ import annotations

import io

from tensorhooks.cli._demo.case import Case, DemoConfig, Outcome, Result, Row
from tensorhooks.cli._demo.run import demo, run_demo

from .conftest import SMALL


def _outcome(*, good: bool) -> Outcome:
    return Outcome("ok" if good else "wrong", "detail", good)


def test_a_wrong_tensorhooks_result_exits_1() -> None:
    """A case where tensorhooks does wrong makes the demo say so and exit 1."""
    bad = Case("feature", "peer", "case", lambda shared: Result(*(_outcome(good=False),) * 2))
    stream = io.StringIO()
    assert demo(stream, rounds=1, steps=1, processes=False, width=80, cases=[bad]) == 1
    assert "tensorhooks got a case wrong: feature" in stream.getvalue()


def test_adding_a_feature_is_one_case() -> None:
    """A case is data around a function of the shared Demo; run_demo takes any list of them."""
    extra = Result(_outcome(good=False), _outcome(good=True))
    case = Case("extra", "peer", "case", lambda shared: extra)
    got = run_demo(DemoConfig(SMALL, rounds=1, steps=1), cases=[case])
    assert got == [Row.of(case, extra)]
    assert got[0].feature == "extra"
