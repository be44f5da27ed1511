"""The bench from start to end: what it prints, the report and chart it writes, what it skips."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tensorhooks.cli._bench.cpu import round_seconds
from tensorhooks.cli._bench.results import BenchOptions
from tensorhooks.cli._bench.run import _decide_line, _ours_over_torch, run_bench
from tensorhooks.cli._main import main
from tensorhooks.cli._verdict import Spread

TARGET_LINE = "(target met|TARGET MISSED|target not decidable): "


def test_report_chart_and_skipped_gpu(tmp_path: Path) -> None:
    """The bench writes a table with spreads, says what it skipped and why, draws a PNG."""
    stream = io.StringIO()
    options = BenchOptions(out=tmp_path, rounds=1, steps=1, gpu=False, processes=False)
    assert run_bench(options, stream, width=80) == 0
    markdown = (tmp_path / "benchmarks.md").read_text()
    for mode in (
        "saved_tensors_hooks",
        "register_multi_grad_hook",
        "save_on_cpu (CPU tensors)",
        "checkpoint (non-reentrant)",
    ):
        assert re.search(
            rf"^\| {re.escape(mode)} \| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \|",
            markdown,
            re.M,
        ), mode
    assert re.search(r"^\| checkpoint \(non-reentrant\) .*\(at most 1\.05\) \|$", markdown, re.M)
    assert "| reference: no-op TorchDispatchMode |" in markdown
    assert "Command: `python -m tensorhooks bench --rounds 1 --steps 1 --no-processes " in markdown
    assert "sync_gradients against DDP: skipped: --no-processes." in markdown
    assert markdown.count("Skipped: --no-gpu.") == 2  # save_on_cpu and offload_parameters
    assert "Lower is better" in markdown
    assert (tmp_path / "benchmarks.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    output = stream.getvalue()
    assert max(len(line) for line in output.splitlines()) <= 80
    assert "…" not in output
    assert "│ allow_mutation_on_saved_tensors" in output
    assert "│ checkpoint (non-reentrant)" in output
    assert re.search(rf"^{TARGET_LINE}allow_mutation", output, re.M)
    assert re.search(rf"^{TARGET_LINE}checkpoint \(non-reentrant\)", output, re.M)
    # One round says nothing about the noise: no target is met or missed on it.
    assert "TARGET MISSED" not in output
    assert re.search(r"^Targets: 0 met, 0 missed, 9 not decidable at this noise$", output, re.M)
    assert re.search(r"^To decide: at least 3 rounds \(--rounds 3 or more\)\.$", output, re.M)
    # Up front: how long; piped: a line per round; the table's word and the ratio's label.
    assert re.search(r"^About \d+ s here \(1 round x 1 step\)\.$", output, re.M)
    assert re.search(r"^\[1/1, \d+s\] CPU round 1$", output, re.M)
    assert re.search(r"│ +\d\.\d\dx noise │", output)  # one round: noise, by the one rule
    assert "not the ratio of the two medians" in output
    for line in (
        "skipped: sync_gradients (--no-processes)",
        "skipped: CUDA save_on_cpu (--no-gpu)",
        "skipped: CUDA offload_parameters (--no-gpu)",
    ):
        assert re.search(rf"^{re.escape(line)}$", output, re.M), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_gpu_parts_say_no_cuda(tmp_path: Path) -> None:
    """Without CUDA (and without --no-gpu) both CUDA parts are skipped for that reason."""
    stream = io.StringIO()
    assert main(["bench", "--rounds", "1", "--steps", "1", "--no-processes", "--out",
                 str(tmp_path)], stream) == 0  # fmt: skip
    output = stream.getvalue()
    assert "skipped: CUDA save_on_cpu (no CUDA device)" in output
    assert "skipped: CUDA offload_parameters (no CUDA device)" in output
    assert (tmp_path / "benchmarks.md").read_text().count("Skipped: no CUDA device.") == 2


@pytest.mark.parametrize(
    ("rounds", "steps", "line"),
    [
        (2, 20, "To decide: at least 3 rounds (--rounds 3 or more)."),
        (
            11,
            20,
            "To decide: a quieter machine or longer rounds (--steps 40), not more rounds.",
        ),
    ],
)
def test_what_decides_the_undecided_targets(rounds: int, steps: int, line: str) -> None:
    """Under three rounds, more rounds decide; past it, longer rounds or a quieter machine."""
    options = BenchOptions(out=Path("unused"), rounds=rounds, steps=steps)
    assert _decide_line(options) == line
    assert len(line) <= 80


@pytest.mark.parametrize(
    ("spread", "word"),
    [
        (Spread(0.50, 0.55, 0.60, 11), "faster"),
        (Spread(1.20, 1.30, 1.40, 11), "slower"),
        (Spread(0.90, 1.00, 1.10, 11), "noise"),
        (Spread(0.50, 0.55, 0.60, 2), "noise"),
    ],
)
def test_each_row_says_faster_slower_or_noise(spread: Spread, word: str) -> None:
    """The table's ours/torch cell carries the verdict the chart's colour does, by `side`."""
    cell = _ours_over_torch(spread)
    first, second = cell.split("\n")
    assert re.fullmatch(rf"{spread.median:.2f}x \[\w+\]{word}\[/\]", first)
    assert second == f"{spread.low:.2f}-{spread.high:.2f}"


def test_a_round_is_estimated_from_one_step_of_each_variant() -> None:
    """round_seconds: a warm call of each variant timed on one thread, scaled to a round."""
    calls: list[str] = []
    threads = torch.get_num_threads()

    def variant(name: str) -> Callable[[], None]:
        def run() -> None:
            calls.append(name)
            assert torch.get_num_threads() == 1
            time.sleep(0.01)

        return run

    seconds = round_seconds({"a": variant("a"), "b": variant("b")}, steps=8)
    assert calls == ["a", "a", "b", "b"]  # a warm call, then the timed one
    assert 2 * 0.01 * (8 + 2) <= seconds < 2 * 0.5 * (8 + 2)
    assert torch.get_num_threads() == threads
