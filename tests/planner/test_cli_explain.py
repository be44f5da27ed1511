"""``python -m tensorhooks explain``: the peak in a table, the trap found, a plan, a chart."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from tensorhooks.cli._explain.run import ExplainOptions, run_explain  # after the extras
from tensorhooks.cli._main import main


def test_children_checkpointed_finds_the_trap_and_plans_without_the_wrappers(
    tmp_path: Path,
) -> None:
    """The default (each layer's children wrapped): the trap, a plan, explain.png; 80 columns."""
    stream = io.StringIO()
    assert run_explain(ExplainOptions(out=tmp_path), stream) == 0
    text = stream.getvalue()
    assert "checkpointing: children" in text
    assert "trap: 4 layers (layers.0, layers.1 and 2 more) checkpoint their children" in text
    assert "no plan: the step checkpoints by itself (28 checkpointed regions seen)" in text
    assert "without its checkpoint wrappers, the cheapest plan under the budget:" in text
    assert "layers.*.mlp_norm" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "\u2026" not in text  # rich's ellipsis: a cell cut short
    assert (tmp_path / "explain.png").read_bytes()[:4] == b"\x89PNG"


def test_no_checkpointing_plans_for_the_budget(tmp_path: Path) -> None:
    """--checkpoint none: no trap, and the cheapest plan with what it costs against none."""
    stream = io.StringIO()
    assert main(["explain", "--checkpoint", "none", "--out", str(tmp_path)], stream) == 0
    text = stream.getvalue()
    assert "trap:" not in text
    assert "cheapest plan: predicted peak" in text
    assert "against no checkpointing" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("budget", ["0", "1.5"])
def test_a_fraction_out_of_range_is_a_usage_error(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget fraction outside (0, 1] is refused as a usage error, naming the range."""
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--budget", budget])
    assert exit_info.value.code == 2
    assert "a fraction must be in (0, 1]" in capsys.readouterr().err
