"""Tests of ``python -m tensorhooks``: the demo's cases, the bench, the harness, errors, width."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorhooks.cli import _main
from tensorhooks.cli._bench import BenchOptions, run_bench
from tensorhooks.cli._demo import CASES, Demo, DemoConfig, Row, run_demo
from tensorhooks.cli._harness import (
    Spread,
    Timings,
    check_target,
    cuda_event_seconds,
    interleaved,
    verdict,
)
from tensorhooks.cli._main import main
from tensorhooks.cli._models import ModelConfig
from tensorhooks.cli._render import make_console, show_demo
from tensorhooks.cli._sync_bench import SyncConfig
from tests.params_device import HostCloneTransfer

ROOT = Path(__file__).resolve().parents[2]
SMALL = ModelConfig(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32)


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    """Every case but the two-process one, on a tiny model, timed once."""
    config = DemoConfig(SMALL, rounds=1, steps=1, processes=False)
    return run_demo(config)


class TestDemoCases:
    def test_tensorhooks_is_right_where_torch_is_wrong(self, rows: list[Row]) -> None:
        """On the identity-pack and view-write cases torch's gradient is wrong and ours is not."""
        by_feature = {row.feature: row for row in rows}
        for feature in ("saved_tensors_hooks", "allow_mutation_on_saved_tensors"):
            row = by_feature[feature]
            assert row.torch.result == "WRONG gradient", row
            assert row.ours.good, row
        assert by_feature["saved_tensors_hooks"].ours.result == "raises"
        assert by_feature["allow_mutation_on_saved_tensors"].ours.result == "right gradient"

    def test_state_left_behind(self, rows: list[Row]) -> None:
        """Torch keeps a dropped graph's tensors and a failed backward's gradient; ours does not."""
        save, failed, threads = (
            row for row in rows if row.feature in ("save_on_cpu", "register_multi_grad_hook")
        )
        assert save.torch.result.startswith("keeps "), save
        assert save.ours.result == "frees it at once"
        assert failed.torch.result == "keeps 256.0 KiB"
        assert failed.ours.result == "keeps nothing"
        assert threads.ours.detail == "800 of 800 calls, 400 of 400 with every gradient"

    def test_every_case_is_timed_against_torch(self, rows: list[Row]) -> None:
        """Each feature has a step-time ratio; only the threads case and skipped runs have none."""
        untimed = [row.case for row in rows if row.timing is None]
        # the threads case, the skipped two-process case, two of the three checkpoint cases
        assert len(untimed) == 4, untimed
        assert all(row.ours.good for row in rows)

    def test_checkpoint_rows(self, rows: list[Row]) -> None:
        """Torch's checkpoints: a wrong gradient, a refused .grad(), a recomputed offload."""
        write, grad, offload = (row for row in rows if row.feature == "checkpoint")
        assert write.torch.result == "WRONG gradient", write
        assert write.ours.result == "right gradient", write
        assert write.timing is not None
        assert grad.torch.result == "refuses", grad
        assert "use_reentrant=True" in grad.torch.detail
        assert not grad.torch.good
        assert grad.ours.result == "right gradient", grad
        assert offload.torch.result == "recomputes", offload
        assert offload.torch.detail.startswith("1 matmul run again")
        assert offload.ours.result == "offloads", offload

    def test_offload_parameters_row(self, rows: list[Row]) -> None:
        """.grad() works through offloaded blocks, which ran on copies and left none behind."""
        (row,) = (row for row in rows if row.feature == "offload_parameters")
        assert row.torch.result == "no counterpart"
        assert row.ours.result == "on the host", row
        assert row.ours.good, row
        assert re.search(r"the gradient; (\d+) of \1 blocks ran on device copies", row.ours.detail)
        assert "after it 0 B of " in row.ours.detail
        assert row.timing is not None

    def test_reads_at_80_columns(self, rows: list[Row]) -> None:
        """At 80 columns no line is wider, and every feature name is printed whole."""
        stream = io.StringIO()
        show_demo(make_console(stream, width=80), rows)
        output = stream.getvalue()
        assert max(len(line) for line in output.splitlines()) <= 80
        summary = output[output.index("Summary") :]
        for row in rows:
            assert re.search(rf"│ {re.escape(row.feature)} +│", summary), row.feature
        assert "…" not in output

    def test_a_wrong_tensorhooks_result_exits_1(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A case where tensorhooks does wrong makes the demo say so and exit 1."""
        bad = Row("feature", "case", *(_outcome(good=False),) * 2)
        monkeypatch.setattr("tensorhooks.cli._demo.CASES", [lambda demo: bad])
        stream = io.StringIO()
        assert _main.demo(stream, rounds=1, steps=1, processes=False, width=80) == 1
        assert "tensorhooks got a case wrong: feature" in stream.getvalue()

    @pytest.mark.slow
    def test_sync_gradients_case_on_two_processes(self) -> None:
        """Two gloo processes: DDP raises on the unused parameter, sync_gradients trains."""
        from tensorhooks.cli._demo import sync_gradients_case

        row = sync_gradients_case(Demo(DemoConfig(SMALL, rounds=1, steps=1)))
        assert row.torch.result == "raises at step 2"
        assert row.ours.good
        assert row.ours.result == "trains"
        assert row.timing is not None

    def test_adding_a_feature_is_one_function(self) -> None:
        """A case is a function of the shared Demo; run_demo takes any list of them."""
        extra = Row("extra", "case", _outcome(good=False), _outcome(good=True))
        got = run_demo(DemoConfig(SMALL, rounds=1, steps=1), cases=[lambda demo: [extra]])
        assert got == [extra]
        assert len(CASES) == 8


def _outcome(*, good: bool):  # type: ignore[no-untyped-def]
    from tensorhooks.cli._demo import Outcome

    return Outcome("ok" if good else "wrong", "detail", good)


class TestHarness:
    def test_spread_and_ratios_per_round(self) -> None:
        """Ratios are taken round by round; the spread is min, median, max."""
        timings = Timings({"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]})
        assert timings.ratio("a", "b") == Spread(0.5, 1.0, 2.0)
        assert timings.spread("a").format() == "2.00x (1.00-4.00)"

    def test_noise_is_not_a_win(self) -> None:
        """A ratio whose rounds straddle 1.00, or lie within the margin of it, reads as noise."""
        assert verdict(Spread(0.90, 0.96, 1.02)) == "same (within noise)"
        assert verdict(Spread(0.93, 0.95, 0.97)) == "same (within noise)"
        assert verdict(Spread(1.01, 1.02, 1.03)) == "same (within noise)"
        assert verdict(Spread(1.06, 1.08, 1.10)) == "slower"
        assert verdict(Spread(0.80, 0.85, 0.94)) == "faster"

    def test_interleaved_times_every_variant_every_round(self) -> None:
        """Each variant gets one sample per round, and progress is told each round."""
        calls = {"a": 0, "b": 0}
        done: list[int] = []

        def count(name: str) -> None:
            calls[name] += 1

        timings = interleaved(
            {"a": lambda: count("a"), "b": lambda: count("b")},
            rounds=3,
            inner=4,
            progress=done.append,
        )
        assert [len(timings.samples[name]) for name in ("a", "b")] == [3, 3]
        assert done == [1, 2, 3]
        assert calls["a"] == calls["b"] >= 12

    def test_warmup_and_before_each(self) -> None:
        """Warm-up calls run first, in order; before_each runs before every variant's timing."""
        log: list[str] = []
        interleaved(
            {"a": lambda: log.append("a"), "b": lambda: log.append("b")},
            rounds=2,
            inner=1,
            warmup=2,
            before_each=lambda: log.append("|"),
        )
        assert log[:4] == ["a", "b", "a", "b"]
        assert log.count("|") == 4
        # Every timing (warm-up calls of Timer included) comes after its own before_each.
        timed = "".join(log[4:]).split("|")[1:]
        assert [set(chunk) for chunk in timed] == [{"a"}, {"b"}, {"b"}, {"a"}]

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA device")
    def test_cuda_event_seconds_times_device_work(self) -> None:
        """A step that keeps the device busy longer reads as longer."""
        x = torch.randn(1024, 1024, device="cuda")
        short = cuda_event_seconds(lambda: x @ x, inner=3)
        long = cuda_event_seconds(lambda: [x @ x for _ in range(20)], inner=3)
        assert 0 < short < long

    def test_missed_target_says_so(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A missed target prints TARGET MISSED with the bound."""
        assert not check_target("ratio", 1.2, at_most=1.1)
        assert check_target("ratio", 1.0, at_most=1.1)
        assert capsys.readouterr().out.splitlines() == [
            "TARGET MISSED: ratio 1.20 (target <= 1.10)",
            "target met: ratio 1.00 (target <= 1.10)",
        ]


class TestBench:
    def test_report_chart_and_skipped_gpu(self, tmp_path: Path) -> None:
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
        assert re.search(
            r"^\| checkpoint \(non-reentrant\) .*\(at most 1\.05\) \|$", markdown, re.M
        )
        assert "| reference: no-op TorchDispatchMode |" in markdown
        assert (
            "Command: `python -m tensorhooks bench --rounds 1 --steps 1 --no-processes " in markdown
        )
        assert "sync_gradients against DDP: skipped: --no-processes." in markdown
        assert markdown.count("Skipped: --no-gpu.") == 2  # save_on_cpu and offload_parameters
        assert "Lower is better" in markdown
        assert (tmp_path / "benchmarks.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        output = stream.getvalue()
        assert max(len(line) for line in output.splitlines()) <= 80
        assert "…" not in output
        assert "│ allow_mutation_on_saved_tensors" in output
        assert "│ checkpoint (non-reentrant)" in output
        assert re.search(r"^(target met|TARGET MISSED): allow_mutation", output, re.M)
        assert re.search(r"^(target met|TARGET MISSED): checkpoint \(non-reentrant\)", output, re.M)
        for line in (
            "skipped: sync_gradients (--no-processes)",
            "skipped: CUDA save_on_cpu (--no-gpu)",
            "skipped: CUDA offload_parameters (--no-gpu)",
        ):
            assert re.search(rf"^{re.escape(line)}$", output, re.M), line

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
    def test_gpu_parts_say_no_cuda(self, tmp_path: Path) -> None:
        """Without CUDA (and without --no-gpu) both CUDA parts are skipped for that reason."""
        stream = io.StringIO()
        assert main(["bench", "--rounds", "1", "--steps", "1", "--no-processes", "--out",
                     str(tmp_path)], stream) == 0  # fmt: skip
        output = stream.getvalue()
        assert "skipped: CUDA save_on_cpu (no CUDA device)" in output
        assert "skipped: CUDA offload_parameters (no CUDA device)" in output
        assert (tmp_path / "benchmarks.md").read_text().count("Skipped: no CUDA device.") == 2

    def test_offload_benchmark_runs_on_cpu(self) -> None:
        """The offload benchmark's code path runs on CPU (peak memory reads 0 there)."""
        from tensorhooks.cli._bench import run_offload

        rows = run_offload(BenchOptions(Path("."), rounds=1, steps=1), SMALL)
        assert [row.mode for row in rows] == [
            "no offload",
            "torch save_on_cpu",
            "tensorhooks save_on_cpu",
        ]
        assert all(row.step.median > 0 and row.peak_bytes == 0 for row in rows)

    def test_offload_parameters_benchmark_streams_every_step(self) -> None:
        """The offload_parameters part times a model whose blocks really are streamed."""
        from tensorhooks.cli._bench import run_offload_parameters

        transfer = HostCloneTransfer()
        rows = run_offload_parameters(BenchOptions(Path("."), rounds=2, steps=4), SMALL, transfer)
        assert [row.mode for row in rows] == ["resident", "tensorhooks offload_parameters"]
        assert all(row.step.median > 0 and row.peak_bytes == 0 for row in rows)
        # 2 layers + embedding, final norm and head: 5 blocks; each step loads every block at
        # least once (forward) and the warm-up and timed steps ran.
        assert len(set(transfer.loads)) > 0
        assert len(transfer.loads) >= 5 * (1 + 2 * 3)
        assert transfer.alive() == set(), "device copies left alive after the handle was removed"

    @pytest.mark.slow
    def test_sync_gradients_part_on_two_processes(self) -> None:
        """Two gloo processes: a row against DDP over the unsynchronised step, equal gradients."""
        from tensorhooks.cli._bench import run_sync

        config = SyncConfig(layers=2, width=32, batch=4, warmup=1)
        row, described = run_sync(BenchOptions(Path("."), rounds=2, steps=2), config)
        assert row.mode == "sync_gradients vs DDP (2 processes)"
        for spread in (row.torch, row.ours, row.ours_over_torch):
            assert spread is not None
            assert 0 < spread.low <= spread.median <= spread.high
        ((label, median, met, bound),) = row.targets
        assert (label, bound) == ("x DDP", 1.10)
        assert met == (median <= 1.10)
        assert "2 rounds x 2 steps" in described
        difference = float(re.search(r"vs DDP (\S+)$", described).group(1))  # type: ignore[union-attr]
        assert difference < 1e-6


class TestCommandLine:
    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tensorhooks", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )

    def test_module_help(self) -> None:
        """`python -m tensorhooks --help` names both commands and exits 0."""
        done = self._run("--help")
        assert done.returncode == 0, done.stderr
        assert "{demo,bench}" in done.stdout

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
            (["demo", "--device", "nonsense"], "'nonsense' is not a torch device"),
            (["bench", "--rounds", "x"], "expected a whole number, got 'x'"),
        ],
    )
    def test_usage_errors_are_one_line_of_the_subcommand(
        self, args: list[str], message: str
    ) -> None:
        """A bad option gives one line naming the subcommand, status 2, no traceback."""
        done = self._run(*args)
        assert done.returncode == 2
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"python -m tensorhooks {args[0]}: error: ")
        assert message in lines[0]

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
    def test_cuda_without_cuda_is_one_line(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--device cuda on a machine without CUDA says so in one line."""
        with pytest.raises(SystemExit) as exit_info:
            main(["demo", "--device", "cuda"])
        assert exit_info.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "no CUDA device is available" in line
        assert line.endswith("use --device cpu")

    def test_missing_extra_is_one_line(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Without rich the command says which package is missing and how to install it."""
        monkeypatch.setattr(_main, "missing_extras", lambda: ["rich"])
        assert main(["demo"]) == 2
        assert capsys.readouterr().err == (
            "python -m tensorhooks demo: needs rich; install the cli extra: "
            "pip install 'tensorhooks[cli]'\n"
        )

    def test_version_from_package_metadata(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--version prints the installed distribution's version."""
        import importlib.metadata

        with pytest.raises(SystemExit):
            main(["--version"])
        assert capsys.readouterr().out.strip() == importlib.metadata.version("tensorhooks")

    def test_no_command_prints_usage_and_exits_2(self) -> None:
        """Without a command the usage is printed and the status is 2."""
        stream = io.StringIO()
        assert main([], stream) == 2
        assert stream.getvalue().startswith("usage: python -m tensorhooks")


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
        ],
    )
    def test_runs_with_tiny_settings(self, script: str, args: list[str]) -> None:
        """The script runs, prints medians with their range, and says whether targets were met."""
        done = self._run(script, *args)
        assert done.returncode == 0, done.stderr
        assert re.search(r"^(target met|TARGET MISSED): ", done.stdout, re.M), done.stdout
        # Every table of step times gives the median and the range of the rounds.
        steps = re.findall(r"^\| [^|]+ \| (.+ ms .*) \| (.+x .*) \|$", done.stdout, re.M)
        assert steps, done.stdout
        for step, ratio in steps:
            assert re.fullmatch(r"\d+\.\d+ ms \(\d+\.\d+-\d+\.\d+\)", step), step
            assert re.fullmatch(r"\d+\.\d+x \(\d+\.\d+-\d+\.\d+\)", ratio), ratio

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
