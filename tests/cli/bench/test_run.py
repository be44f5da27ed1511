"""The bench from start to end: what it prints, the report and chart it writes, what it skips."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from tensorhooks.cli._bench.results import BenchOptions
from tensorhooks.cli._bench.run import run_bench
from tensorhooks.cli._main import main

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
    assert re.search(r"^Targets: 0 met, 0 missed, 9 not decidable at this noise; ", output, re.M)
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
