"""Tests of ``python -m tensorhooks``: demo, bench, plain-text fallback, public names."""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorhooks
from tensorhooks._bench import BenchOptions, run_bench
from tensorhooks._cli import demo, main
from tensorhooks._console import PlainConsole, RichConsole, make_console, plain_table
from tensorhooks._demo import DemoConfig, TinyTransformer, census, make_batch, run_demo

ROOT = Path(__file__).resolve().parent.parent

# Small enough for a test to train it in well under a second.
SMALL = {"batch": 4, "seq": 16, "d_model": 32, "heads": 2, "layers": 2, "vocab": 64}
FEATURES = [
    "save_on_cpu",
    "allow_mutation_on_saved_tensors",
    "saved_tensors_hooks",
    "disable_saved_tensors_hooks",
    "register_multi_grad_hook",
]


def small_config(steps: int = 2) -> DemoConfig:
    return DemoConfig(steps=steps, **SMALL)


def rows_by_feature(output: str) -> dict[str, str]:
    """The lines of the plain-text demo table, by feature name."""
    return {
        line.split()[0]: line
        for line in output.splitlines()
        if line.split() and line.split()[0] in FEATURES
    }


class TestDemo:
    def test_every_feature_reproduces_plain_autograd_exactly(self) -> None:
        """On CPU each feature's gradients are bit-identical to plain autograd's, every step."""
        result = run_demo(small_config(steps=3), PlainConsole(io.StringIO()))
        assert result.all_matched
        for row in result.rows:
            assert row.error is None, row.error
            assert row.exact, f"{row.feature}: max |diff| {row.max_diff}"
            assert len(row.times) == 3

    def test_exit_status_zero_and_table_says_every_gradient_matched(self) -> None:
        """The printed table has one line per feature, each saying yes."""
        stream = io.StringIO()
        assert demo(PlainConsole(stream), steps=2, **SMALL) == 0
        output = stream.getvalue()
        assert "Every gradient matched plain autograd" in output
        rows = rows_by_feature(output)
        assert sorted(rows) == sorted(FEATURES)
        for name, line in rows.items():
            assert re.search(rf"^{name}\s+yes\s+0\s+\d+\.\d\dx\s", line), line

    def test_gradient_mismatch_exits_1(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An unpack hook that hands back wrong values makes the demo say NO and exit 1."""
        real = tensorhooks.saved_tensors_hooks

        class corrupting(real):
            def __init__(self, pack_hook: Any, unpack_hook: Any) -> None:
                def unpack(packed: Any) -> torch.Tensor:
                    tensor = unpack_hook(packed)
                    return tensor * 1.5 if tensor.is_floating_point() else tensor

                super().__init__(pack_hook, unpack)

        monkeypatch.setattr(tensorhooks, "saved_tensors_hooks", corrupting)
        stream = io.StringIO()
        assert demo(PlainConsole(stream), steps=1, **SMALL) == 1
        output = stream.getvalue()
        assert re.search(r"^saved_tensors_hooks\s+NO\s+\d\.\de[+-]\d\d\s", output, re.M), output
        assert "GRADIENT MISMATCH in: saved_tensors_hooks" in output

    def test_feature_that_raises_is_reported_and_exits_1(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A feature raising during its step is shown as FAILED with the error; the rest run."""

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("registration exploded")

        monkeypatch.setattr(tensorhooks, "register_multi_grad_hook", broken)
        result = run_demo(small_config(steps=2), PlainConsole(io.StringIO()))
        rows = {row.feature: row for row in result.rows}
        failed = rows["register_multi_grad_hook"]
        assert failed.what == "FAILED: RuntimeError: registration exploded"
        assert not failed.matched
        assert not result.all_matched
        assert rows["saved_tensors_hooks"].matched

    def test_multi_grad_hook_row_counts_every_bucket_completion(self) -> None:
        """Every bucket's "all" hook fires once per step, with no gradient missing."""
        result = run_demo(small_config(steps=3), PlainConsole(io.StringIO()))
        row = next(row for row in result.rows if row.feature == "register_multi_grad_hook")
        buckets = SMALL["layers"] + 1
        assert row.what == (
            f"{3 * buckets} of {3 * buckets} bucket completions ({buckets} buckets x 3 steps), "
            "no grad missing"
        )

    def test_disable_row_counts_one_refusal_per_block(self) -> None:
        """Each block's attempt to install hooks inside the disabled region is refused."""
        result = run_demo(small_config(steps=2), PlainConsole(io.StringIO()))
        row = next(row for row in result.rows if row.feature == "disable_saved_tensors_hooks")
        assert row.what.startswith(f"refused {SMALL['layers']} hook installs with its message")
        assert row.what.endswith("hooks usable again after")

    def test_census_counts_saved_tensors_changed_by_in_place_residuals(self) -> None:
        """In-place code changes two saved tensors per block (the inputs of both layer norms)."""
        config = small_config()
        torch.manual_seed(0)
        model = TinyTransformer(config)
        batch = make_batch(config, 0)
        assert census(model, batch, inplace=False).changed_in_place == 0
        changed = census(model, batch, inplace=True)
        assert changed.changed_in_place == 2 * config.layers
        assert (
            changed.changed_bytes
            == 2 * config.layers * 4 * config.batch * config.seq * config.d_model
        )

    def test_in_place_model_is_the_out_of_place_model(self) -> None:
        """The in-place variant computes the same loss, and plain autograd refuses its backward."""
        config = small_config()
        torch.manual_seed(0)
        model = TinyTransformer(config)
        batch = make_batch(config, 0)
        expected = model(*batch)
        got = model(*batch, inplace=True)
        assert torch.equal(expected, got)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            got.backward()


class TestBench:
    def test_writes_markdown_and_chart_with_script_output(self, tmp_path: Path) -> None:
        """The report holds every CPU mode, the scripts' output, and a PNG chart beside it."""
        pytest.importorskip("matplotlib")
        scripts = tmp_path / "benchmarks"
        scripts.mkdir()
        (scripts / "bench_ok.py").write_text(
            "from helper import RATIO\nif __name__ == '__main__':\n    print(RATIO)\n"
        )
        (scripts / "helper.py").write_text("RATIO = 'identity hooks: 1.01x torch'\n")
        out = tmp_path / "out"
        stream = io.StringIO()
        options = BenchOptions(out=out, rounds=1, steps=1, scripts=scripts, gpu=False)
        assert run_bench(options, PlainConsole(stream)) == 0
        markdown = (out / "benchmarks.md").read_text()
        for mode in (
            "saved_tensors_hooks (identity pair)",
            "register_multi_grad_hook (50 buckets)",
            "save_on_cpu (CPU tensors)",
            "allow_mutation_on_saved_tensors",
            "no-op TorchDispatchMode",
        ):
            assert re.search(rf"^\| {re.escape(mode)} \| \d+\.\d\dx \|", markdown, re.M), mode
        assert "### bench_ok.py" in markdown
        assert "### helper.py" not in markdown  # a module without a main guard is no script
        assert "identity hooks: 1.01x torch" in markdown
        assert "![benchmarks](benchmarks.png)" in markdown
        assert (out / "benchmarks.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert f"Wrote {out / 'benchmarks.md'} and {out / 'benchmarks.png'}." in stream.getvalue()

    def test_failing_script_is_reported_and_exits_1(self, tmp_path: Path) -> None:
        """A benchmark script exiting non-zero is marked FAILED, its output kept."""
        scripts = tmp_path / "benchmarks"
        scripts.mkdir()
        (scripts / "bench_bad.py").write_text(
            "import sys\nif __name__ == '__main__':\n    print('partial')\n    sys.exit(3)\n"
        )
        stream = io.StringIO()
        options = BenchOptions(out=tmp_path / "out", rounds=1, steps=1, scripts=scripts, gpu=False)
        assert run_bench(options, PlainConsole(stream)) == 1
        markdown = (tmp_path / "out" / "benchmarks.md").read_text()
        assert "`python benchmarks/bench_bad.py`: exit status 3" in markdown
        assert "partial" in markdown
        assert "bench_bad.py: FAILED" in stream.getvalue()

    def test_missing_scripts_directory_is_noted(self, tmp_path: Path) -> None:
        """Without a benchmarks/ directory the bench still runs and says why no script ran."""
        options = BenchOptions(
            out=tmp_path / "out", rounds=1, steps=1, scripts=tmp_path / "nowhere", gpu=False
        )
        assert run_bench(options, PlainConsole(io.StringIO())) == 0
        markdown = (tmp_path / "out" / "benchmarks.md").read_text()
        assert f"No benchmark scripts found: {tmp_path / 'nowhere'} is not a directory" in markdown

    def test_offload_benchmark_and_its_report_on_cpu(self, tmp_path: Path) -> None:
        """The offload benchmark's code path runs on CPU, and its table reaches the report."""
        from tensorhooks._bench import BenchReport, run_offload, write_chart, write_markdown

        options = BenchOptions(out=tmp_path, rounds=1, steps=1)
        advanced: list[str] = []
        rows = run_offload(options, advanced.append, DemoConfig(**SMALL))
        names = [row.mode for row in rows]
        assert names == [
            "plain autograd",
            "torch save_on_cpu(pin_memory=False)",
            "tensorhooks save_on_cpu(pin_memory=False)",
        ]
        assert all(row.step_ms > 0 and row.peak_bytes == 0 for row in rows)
        assert advanced == ["round 1/1 done"]
        report = BenchReport(gpu=rows)
        write_markdown(report, options, tmp_path / "benchmarks.md", DemoConfig(**SMALL))
        markdown = (tmp_path / "benchmarks.md").read_text()
        assert re.search(r"^\| plain autograd \| [\d.]+ ms \| 1\.00x \| 0 B \|", markdown, re.M)
        if importlib.util.find_spec("matplotlib") is not None:
            assert write_chart(report, tmp_path / "benchmarks.png") == ""
            assert (tmp_path / "benchmarks.png").stat().st_size > 0

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_gpu_offload_table(self, tmp_path: Path) -> None:
        """With CUDA, the report has the offload table with plain autograd first."""
        options = BenchOptions(out=tmp_path, rounds=1, steps=1, scripts=None)
        assert run_bench(options, PlainConsole(io.StringIO())) == 0
        markdown = (tmp_path / "benchmarks.md").read_text()
        assert re.search(r"^\| plain autograd \| [\d.]+ ms \| 1\.00x \|", markdown, re.M)
        assert "| torch save_on_cpu(pin_memory=True) |" in markdown


class TestPlainTextFallback:
    @pytest.fixture
    def without_extras(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make rich and matplotlib unimportable, as without the ``cli`` extra."""
        for name in list(sys.modules):
            if name.split(".")[0] in ("rich", "matplotlib"):
                monkeypatch.delitem(sys.modules, name)
        for name in ("rich", "rich.console", "matplotlib", "matplotlib.figure"):
            monkeypatch.setitem(sys.modules, name, None)

    @pytest.mark.usefixtures("without_extras")
    def test_console_falls_back_to_plain_text(self) -> None:
        """Without rich, make_console returns the plain-text console."""
        assert isinstance(make_console(io.StringIO()), PlainConsole)

    @pytest.mark.usefixtures("without_extras")
    def test_demo_runs_in_plain_text(self) -> None:
        """Without the extra the demo prints an aligned text table and log-style progress."""
        stream = io.StringIO()
        assert demo(make_console(stream), steps=1, **SMALL) == 0
        output = stream.getvalue()
        assert re.search(r"^  \[\d+/\d+\] +\d+\.\ds ", output, re.M)
        assert re.search(
            r"^feature +grads match +max \|diff\| +time vs plain +what it did", output, re.M
        )
        assert "━" not in output
        assert "┃" not in output

    @pytest.mark.usefixtures("without_extras")
    def test_bench_writes_markdown_and_says_why_no_chart(self, tmp_path: Path) -> None:
        """Without matplotlib the bench writes its Markdown and explains the missing chart."""
        stream = io.StringIO()
        argv = ["bench", "--out", str(tmp_path), "--rounds", "1", "--steps", "1", "--no-scripts"]
        assert main([*argv, "--no-gpu"], stream) == 0
        markdown = (tmp_path / "benchmarks.md").read_text()
        assert "matplotlib is not installed, so no chart was drawn" in markdown
        assert not (tmp_path / "benchmarks.png").exists()
        assert f"Wrote {tmp_path / 'benchmarks.md'}." in stream.getvalue()

    def test_plain_flag_forces_plain_text(self) -> None:
        """--plain gives plain text even where rich is installed."""
        assert isinstance(make_console(io.StringIO(), plain=True), PlainConsole)

    def test_plain_table_aligns_columns(self) -> None:
        """Every column starts at the same offset on every line."""
        text = plain_table(["a", "long header"], [["wide cell", "x"], ["b", "y"]])
        assert text.splitlines() == [
            "a          long header",
            "---------  -----------",
            "wide cell  x",
            "b          y",
        ]


class TestRichConsole:
    def test_rich_table_and_progress(self) -> None:
        """With rich installed, tables are drawn with box characters and progress completes."""
        pytest.importorskip("rich")
        stream = io.StringIO()
        console = make_console(stream)
        assert isinstance(console, RichConsole)
        with console.progress(2, "working") as progress:
            progress.advance("half")
            progress.advance("done")
        console.table("title", ["feature", "what"], [["hooks", "fired 3x"]])
        output = stream.getvalue()
        assert "2/2" in output
        assert re.search(r"│ hooks +│ fired 3x +│", output)


class TestCommandLine:
    def test_module_help(self) -> None:
        """`python -m tensorhooks --help` names both commands and exits 0."""
        done = subprocess.run(
            [sys.executable, "-m", "tensorhooks", "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "{demo,bench}" in done.stdout

    def test_no_command_prints_usage_and_exits_2(self) -> None:
        """Without a command the usage is printed and the status is 2."""
        stream = io.StringIO()
        assert main([], stream) == 2
        assert stream.getvalue().startswith("usage: python -m tensorhooks")

    def test_bad_steps_is_a_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--steps 0 is refused with a message naming the value."""
        with pytest.raises(SystemExit) as exit_info:
            main(["demo", "--steps", "0"], io.StringIO())
        assert exit_info.value.code == 2
        assert "demo: --steps must be at least 1, got 0" in capsys.readouterr().err


class TestPublicNames:
    def test_every_name_in_all_imports(self) -> None:
        """Every name in tensorhooks.__all__ imports, and __all__ is sorted."""
        assert tensorhooks.__all__ == sorted(tensorhooks.__all__)
        for name in tensorhooks.__all__:
            namespace: dict[str, object] = {}
            exec(f"from tensorhooks import {name}", namespace)  # the import statement is the test
            assert namespace[name] is getattr(tensorhooks, name)

    def test_every_documented_api_is_public(self) -> None:
        """Each API reference in docs/ (`::: tensorhooks.X`) names something in __all__."""
        documented = set()
        for page in (ROOT / "docs").glob("*.md"):
            documented |= set(re.findall(r"^::: tensorhooks\.(\w+)", page.read_text(), re.M))
        assert documented, "no API reference found in docs/"
        assert documented <= set(tensorhooks.__all__)
        for name in ("saved_tensors_hooks", "disable_saved_tensors_hooks"):
            assert name in documented
