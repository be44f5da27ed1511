"""The scripts in ``benchmarks/``, which time through the command line's harness and models."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


class TestBenchmarkScripts:
    def _run(self, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )

    @pytest.mark.parametrize(
        ("script", "args"),
        [
            ("hooks.py", ["--rounds", "1"]),
            ("mutation.py", ["--rounds", "1"]),
            ("checkpoint.py", ["--rounds", "1", "--quick"]),
            pytest.param(
                "sync_gradients.py",
                ["--rounds", "1", "--inner", "1", "--layers", "2", "--width", "32"],
                marks=pytest.mark.slow,
            ),
            pytest.param("fsdp2.py", ["--rounds", "1", "--quick"], marks=pytest.mark.slow),
        ],
    )
    def test_runs_with_tiny_settings(self, script: str, args: list[str]) -> None:
        """The script runs, prints medians with their range, and says whether targets were met."""
        done = self._run(script, *args)
        assert done.returncode == 0, done.stderr
        markers = "(target met|TARGET MISSED|target not decidable): "
        assert re.search(rf"^{markers}", done.stdout, re.M), done.stdout
        # Every table of step times gives the median and the range of the rounds.
        steps = re.findall(r"^\| [^|]+ \| (.+ ms .*) \| (.+x .*) \|$", done.stdout, re.M)
        assert steps, done.stdout
        for step, ratio in steps:
            assert re.fullmatch(r"\d+\.\d+ ms \(\d+\.\d+-\d+\.\d+\)", step), step
            assert re.fullmatch(r"\d+\.\d+x \(\d+\.\d+-\d+\.\d+\)", ratio), ratio

    def test_import_time_reads_a_share_of_torchs_import(self) -> None:
        """import_time.py reads tensorhooks' import as a share of torch's, round by round."""
        done = self._run("import_time.py", "--rounds", "3")
        assert done.returncode == 0, done.stderr
        assert re.search(
            r"^(target met|TARGET MISSED|target not decidable): import tensorhooks over import "
            r"torch, per round \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \(target <= 0\.15\)$",
            done.stdout,
            re.M,
        ), done.stdout
        assert "torch._dynamo imported by tensorhooks: False" in done.stdout

    @pytest.mark.slow
    def test_demo_cost_reads_cpu_seconds_against_the_target(self) -> None:
        """demo_cost.py runs the demo, prints each round, the spread, the load and the verdict."""
        done = self._run("demo_cost.py", "--rounds", "1", "--", "--no-processes")
        assert done.returncode == 0, done.stderr
        assert re.search(r"^before: .*load average \d", done.stdout, re.M), done.stdout
        assert re.search(r"^round 1: \d+\.\d CPU-s, \d+\.\d s wall$", done.stdout, re.M)
        assert re.search(
            r"^python -m tensorhooks demo --no-processes: \d+\.\d CPU-s \(\d+\.\d-\d+\.\d\), ",
            done.stdout,
            re.M,
        )
        # One round says nothing about the noise: never met or missed on it.
        assert "target not decidable: CPU-seconds of the demo" in done.stdout

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
    @pytest.mark.parametrize("script", ["offload_gpu.py", "offload_parameters.py"])
    def test_gpu_scripts_say_skipped_without_cuda(self, script: str) -> None:
        """A script that measured nothing prints the skipped: marker and exits 0."""
        done = self._run(script)
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(rf"skipped: {script} needs a CUDA device; .*\n", done.stdout)

    def test_harness_keeps_its_names(self) -> None:
        """benchmarks/harness.py re-exports the names scripts import from it."""
        sys.path.insert(0, str(ROOT / "benchmarks"))
        try:
            import harness
        finally:
            sys.path.remove(str(ROOT / "benchmarks"))
        for name in ("cuda_event_seconds", "print_table", "mlp", "interleaved", "skip"):
            assert callable(getattr(harness, name)), name
