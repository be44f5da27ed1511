"""``python -m tensorhooks plan``: plan tables, a summary and a chart, in under a minute."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from tensorhooks.cli._main import main  # after the extras are known present
from tensorhooks.cli._plan.run import PlanOptions, run_plan


def test_plan_command_prints_tables_and_draws_the_chart(tmp_path: Path) -> None:
    """Each budget's plan, the summary against the hand choices, plan.png; 80 columns fit."""
    stream = io.StringIO()
    started = time.perf_counter()
    status = run_plan(
        PlanOptions(out=tmp_path, budgets=(0.6, 1.0), rounds=3, steps=1), stream, width=80
    )
    assert time.perf_counter() - started < 60
    text = stream.getvalue()
    assert status == 0
    assert "plan 60%" in text
    assert "plan 100%" in text
    assert "layers.3" in text
    for preset in ("keep", "recompute", "save matmuls"):
        assert preset in text
    assert "offload all" not in text  # no link, no offloading choices
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "\u2026" not in text  # rich's ellipsis: a cell cut short
    assert "time: what the choice adds to the step time" in text
    assert "not the ratio of the medians" in text
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_plan_command_with_a_simulated_link(tmp_path: Path) -> None:
    """--bandwidth plans for a simulated link: the offloading hand choices appear."""
    stream = io.StringIO()
    assert main(["plan", "--out", str(tmp_path), "--bandwidth", "2"], stream) == 0
    text = stream.getvalue()
    assert "offload inputs" in text
    assert "offload all" in text
    assert max(len(line) for line in text.splitlines()) <= 80  # with the host column too
    assert "\u2026" not in text


def test_plan_command_refuses_a_bad_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    """A bandwidth that is not a positive number is a usage error, named."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--bandwidth", "0"])
    assert exit_info.value.code == 2
    assert "must be positive, got 0.0" in capsys.readouterr().err


@pytest.mark.slow
def test_benchmark_script_runs_and_says_the_gpu_part_is_skipped(tmp_path: Path) -> None:
    """benchmarks/plan.py --quick: every CPU target met, the chart, the GPU part skipped."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "plan.py"),
            "--quick",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr
    assert "TARGET MISSED" not in done.stdout
    assert done.stdout.count("target met:") == 6
    assert "offload input" in done.stdout
    assert (tmp_path / "plan.png").stat().st_size > 0
    if not torch.cuda.is_available():
        assert "skipped: GPU part: no CUDA" in done.stdout
