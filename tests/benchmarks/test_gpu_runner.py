"""Tests of the GPU runner, benchmarks/gpu.py, on the CPU: schedule, limits, records, report.

The runner runs where a GPU is at hand only rarely, so everything it does around the GPU is
pinned here: without CUDA it skips every part quickly; a dry run takes every measuring part
through its code on the CPU; stand-in parts show that a part past its limit, a crash or a part
that records nothing is reported and the next part still runs.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    from gpu_parts import cuda_tests, planner, process, record, report, runner
finally:
    sys.path.remove(str(BENCHMARKS))

MEASURING = ("save-on-cpu", "checkpoint", "offload-parameters", "sync-gradients", "fsdp2")


def gpu_py(*args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python benchmarks/gpu.py ARGS`` from the repository root; its result and seconds."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    return done, time.monotonic() - start


def fake(name: str, code: str, *, limit_s: float = 30, needs_cuda: bool = True) -> runner.Part:
    """A stand-in part: ``code`` run by ``python -c`` (``gpu_parts`` importable in it)."""
    return runner.Part(
        name, name.title(), limit_s, needs_cuda=needs_cuda, argv=(sys.executable, "-c", code)
    )


def recording(body: str) -> str:
    """Code for a stand-in part with ``rec``, its `Recorder`, in scope."""
    head = "from gpu_parts.record import *\nrec = Recorder.from_environment('x')\n"
    return head + textwrap.dedent(body)


def probe(cuda: bool) -> runner.Part:
    """A stand-in environment probe that says whether CUDA is there."""
    body = f"rec.put('cuda_available', {cuda}); rec.put('gpu', 'Fake GPU'); rec.finish(OK, 'p')"
    return fake("environment", recording(body), needs_cuda=False)


def run_fakes(tmp_path: Path, *parts: runner.Part, budget_s: float = 120) -> dict[str, Any]:
    lines: list[str] = []
    run = runner.run_all(parts, out=tmp_path, budget_s=budget_s, echo=lines.append)
    run["echoed"] = lines
    return run


def by_name(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {part["name"]: part for part in run["parts"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run on a machine without CUDA")
def test_without_cuda_every_part_says_skipped_within_a_minute(tmp_path: Path) -> None:
    """Without CUDA the command ends quickly, printing and reporting `skipped: no CUDA` per part."""
    done, seconds = gpu_py("--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < 60, f"took {seconds:.0f} s"
    names = [part.name for part in runner.PARTS if part.name != "environment"]
    for name in names:
        assert f"[{name}] skipped: no CUDA\n" in done.stdout, done.stdout
    results = json.loads((tmp_path / "gpu-results.json").read_text())
    statuses = {part["name"]: (part["status"], part["reason"]) for part in results["parts"]}
    assert statuses.pop("environment")[0] == "ok"
    assert statuses == dict.fromkeys(names, ("skipped", "no CUDA"))
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert markdown.count("skipped: no CUDA") == 2 * len(names)  # summary table and sections
    assert "**GPU**: none (no CUDA device" in markdown
    assert f"torch {torch.__version__}" in markdown


@pytest.mark.slow
def test_dry_run_takes_every_measuring_part_through_its_code(tmp_path: Path) -> None:
    """--dry-run runs the measuring parts on the CPU: each ends ok with its tables and targets."""
    done, _ = gpu_py("--out", str(tmp_path), "--dry-run", "--skip", "sanitizer")
    assert done.returncode == 0, done.stdout + (tmp_path / "gpu-log.txt").read_text()[-5000:]
    parts = by_name(json.loads((tmp_path / "gpu-results.json").read_text()))
    for name in (*MEASURING, "cuda-tests"):
        assert parts[name]["status"] == "ok", (name, parts[name]["reason"])
        assert parts[name]["tables"], name
    for name in MEASURING:
        assert parts[name]["targets"], name
        # Every target is judged, or says why it could not be (no device memory on the CPU).
        for target in parts[name]["targets"]:
            assert target["verdict"] in ("met", "MISSED", "not measured"), target
    gradients = [
        row
        for name in MEASURING
        for table in parts[name]["tables"]
        if "radients" in table["title"]
        for row in table["rows"]
    ]
    assert gradients, "no gradient comparison recorded"
    assert all("DIFFERENT" not in row and row[1] == "yes" for row in gradients), gradients
    assert parts["cuda-tests"]["summary"].endswith("skipped")  # collected, none runs on a CPU
    assert parts["planner"]["status"] == "skipped"
    assert "Dry run on the CPU" in (tmp_path / "gpu-report.md").read_text()


class TestSchedule:
    def test_a_part_past_its_limit_is_stopped_and_the_next_runs(self, tmp_path: Path) -> None:
        """A hanging part is stopped at its limit, keeps its records, and the next part runs."""
        hang = recording(
            """
            rec.table("before the hang", ["a"], [["1"]])
            import time; time.sleep(120)
            """
        )
        start = time.monotonic()
        run = run_fakes(
            tmp_path,
            probe(cuda=True),
            fake("hang", hang, limit_s=3),
            fake("after", recording("rec.finish(OK, 'fine')")),
        )
        assert time.monotonic() - start < 30
        parts = by_name(run)
        assert parts["hang"]["status"] == "timeout"
        assert parts["hang"]["tables"][0]["title"] == "before the hang"
        assert parts["hang"]["seconds"] < 3 + process.GRACE_S + 5
        assert parts["after"]["status"] == "ok"
        assert any(line.startswith("[hang] timeout in ") for line in run["echoed"])

    def test_a_crash_is_reported_with_the_end_of_its_output(self, tmp_path: Path) -> None:
        """A part that dies is a failure with its exit status and last lines; the rest go on."""
        crash = "import sys; print('about to fail: boom'); sys.exit(7)"
        run = run_fakes(
            tmp_path,
            probe(cuda=True),
            fake("crash", crash),
            fake("after", recording("rec.finish(OK, 'fine')")),
        )
        parts = by_name(run)
        assert parts["crash"]["status"] == "failed"
        assert parts["crash"]["reason"] == "exited with status 7"
        assert "about to fail: boom" in parts["crash"]["log_tail"]
        assert parts["after"]["status"] == "ok"
        markdown = (tmp_path / "gpu-report.md").read_text()
        assert "**failed**" in markdown
        assert "about to fail: boom" in markdown

    def test_a_part_that_records_nothing_is_a_failure(self, tmp_path: Path) -> None:
        """Exiting 0 without a result is not taken for success."""
        run = run_fakes(tmp_path, probe(cuda=True), fake("silent", "pass"))
        assert by_name(run)["silent"]["status"] == "failed"
        assert by_name(run)["silent"]["reason"] == "exited without recording a result"

    def test_parts_that_need_cuda_are_not_started_without_it(self, tmp_path: Path) -> None:
        """Without CUDA a CUDA part is skipped unstarted; a part that needs none still runs."""
        marker = tmp_path / "started"
        run = run_fakes(
            tmp_path,
            probe(cuda=False),
            fake("gpu", f"open({str(marker)!r}, 'w')"),
            fake("cpu", recording("rec.finish(OK, 'ran')"), needs_cuda=False),
        )
        parts = by_name(run)
        assert (parts["gpu"]["status"], parts["gpu"]["reason"]) == ("skipped", "no CUDA")
        assert not marker.exists()
        assert parts["cpu"]["status"] == "ok"
        assert "[gpu] skipped: no CUDA" in run["echoed"]

    def test_the_budget_clips_limits_and_skips_what_cannot_start(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A part gets at most what is left of the budget; with too little left it is skipped."""
        monkeypatch.setattr(runner, "MIN_START_S", 2.0)
        sleep = recording("import time; time.sleep(120)")
        run = run_fakes(
            tmp_path,
            probe(cuda=True),
            fake("long", sleep, limit_s=300),
            fake("later", recording("rec.finish(OK, 'ran')")),
            budget_s=6,
        )
        parts = by_name(run)
        assert parts["long"]["status"] == "timeout"
        assert parts["long"]["limit_s"] < 6
        assert parts["later"]["status"] == "skipped"
        assert parts["later"]["reason"].startswith("out of time")

    def test_the_results_are_written_before_the_next_part_starts(self, tmp_path: Path) -> None:
        """After every part the results file is rewritten, so a run cut short keeps its report."""
        peek = recording(
            f"""
            import json
            seen = json.load(open({str(tmp_path / "gpu-results.json")!r}))
            rec.finish(OK, str(len(seen["parts"])))
            """
        )
        run = run_fakes(tmp_path, probe(cuda=True), fake("first", peek), fake("second", peek))
        assert [by_name(run)[name]["summary"] for name in ("first", "second")] == ["1", "2"]
        assert (tmp_path / "gpu-report.md").read_text().startswith("# GPU run: Fake GPU")

    def test_the_limits_fit_eight_minutes(self) -> None:
        """The parts' limits and the budget, plus a last grace period, end within 8 minutes."""
        total = sum(part.limit_s for part in runner.PARTS)
        assert total <= runner.DEFAULT_BUDGET_S
        assert runner.DEFAULT_BUDGET_S + process.GRACE_S + 10 < 8 * 60
        assert runner.PARTS[0].name == "environment"

    def test_unknown_part_names_are_refused(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--only and --skip name parts that exist, or the command stops and lists them."""
        with pytest.raises(SystemExit):
            runner.parse_args(["--out", "x", "--only", "save-on-gpu"])
        assert "unknown part save-on-gpu; the parts are " in capsys.readouterr().err

    def test_list_gives_every_part_with_its_limit(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--list names each part, its limit and the total."""
        assert runner.main(["--list"]) == 0
        out = capsys.readouterr().out
        for part in runner.PARTS:
            assert re.search(rf"^{part.name} +{part.limit_s:.0f} s", out, re.M), part.name
        assert re.search(r"^total +\d+ s", out, re.M)


class TestPartProcess:
    @pytest.fixture
    def module(self, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
        """A stand-in part module, ``gpu_parts.stand_in``, importable by `runner.run_child`."""
        stand_in = types.ModuleType("gpu_parts.stand_in")
        monkeypatch.setitem(sys.modules, "gpu_parts.stand_in", stand_in)
        return stand_in

    def _run(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str) -> Any:
        result = tmp_path / "result.json"
        monkeypatch.setenv(record.RESULT_ENV, str(result))
        parts = [runner.Part("stand-in", "Stand-in", 10, entry)]
        code = runner.run_child("stand-in", dry_run=True, parts=parts)
        return code, json.loads(result.read_text())

    def test_an_exception_is_recorded_as_a_failure(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: types.ModuleType
    ) -> None:
        """A part that raises leaves status failed, the error's first line, and exit status 1."""

        def boom(rec: record.Recorder, ctx: runner.Context) -> None:
            rec.table("kept", ["a"], [["1"]])
            raise ValueError("no such kernel\nsecond line")

        module.boom = boom  # type: ignore[attr-defined]
        code, result = self._run(tmp_path, monkeypatch, "stand_in:boom")
        assert code == 1
        assert (result["status"], result["reason"]) == ("failed", "ValueError: no such kernel")
        assert result["tables"][0]["title"] == "kept"

    def test_an_interrupt_is_recorded_as_the_time_limit(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: types.ModuleType
    ) -> None:
        """The runner's SIGINT (KeyboardInterrupt) leaves status timeout and where it was."""

        def stuck(rec: record.Recorder, ctx: runner.Context) -> None:
            raise KeyboardInterrupt

        module.stuck = stuck  # type: ignore[attr-defined]
        code, result = self._run(tmp_path, monkeypatch, "stand_in:stuck")
        assert code == 3
        assert result["status"] == "timeout"
        reason = result["reason"]
        assert re.fullmatch(
            r"stopped at its time limit at test_gpu_runner\.py:\d+ \(stuck\)", reason
        )

    def test_a_part_that_returns_is_ok(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: types.ModuleType
    ) -> None:
        """A part that returns without setting a status is ok; the context says dry run."""
        seen: list[str] = []
        module.quiet = lambda rec, ctx: seen.append(ctx.device)  # type: ignore[attr-defined]
        code, result = self._run(tmp_path, monkeypatch, "stand_in:quiet")
        assert (code, result["status"], seen) == (0, "ok", ["cpu"])


class TestProcess:
    def test_a_late_command_and_its_children_are_stopped(self, tmp_path: Path) -> None:
        """At the limit the whole process group goes: a child the command started goes too."""
        log = tmp_path / "log"
        code = (
            "import subprocess, sys, time\n"
            "child = subprocess.Popen(['sleep', '300'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(300)\n"
        )
        finished = process.run_logged([sys.executable, "-c", code], log=log, limit_s=2)
        assert finished.timed_out
        assert finished.seconds < 2 + process.GRACE_S + 3
        child = int(log.read_text().split()[0])
        time.sleep(0.2)
        status = Path(f"/proc/{child}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()

    def test_an_interrupt_comes_before_the_kill(self, tmp_path: Path) -> None:
        """The command first gets SIGINT, so Python code can record where it was stopped."""
        log = tmp_path / "log"
        code = (
            "import time\n"
            "try:\n    time.sleep(300)\n"
            "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n"
        )
        finished = process.run_logged([sys.executable, "-c", code], log=log, limit_s=2)
        assert finished.timed_out
        assert log.read_text() == "interrupted\n"

    def test_a_command_that_ends_gives_its_status(self, tmp_path: Path) -> None:
        """A command within its limit returns its own exit status, its output appended."""
        log = tmp_path / "log"
        log.write_text("before\n")
        code = "import sys; print('out'); sys.exit(4)"
        finished = process.run_logged([sys.executable, "-c", code], log=log, limit_s=30)
        assert (finished.returncode, finished.timed_out) == (4, False)
        assert log.read_text() == "before\nout\n"


class TestTargets:
    def test_bounds_from_above_and_below(self) -> None:
        """A value is met against at_most when no larger, against at_least when no smaller."""
        assert record.evaluate("p", "t", 1.10, at_most=1.10).met is True
        assert record.evaluate("p", "t", 1.11, at_most=1.10).met is False
        target = record.evaluate("p", "t", 0.69, at_least=0.70, fmt="{:.0%}", detail="why")
        assert (target.met, target.shown, target.bound, target.detail) == (
            False,
            "69%",
            ">= 70%",
            "why",
        )
        assert target.verdict == "MISSED"

    def test_a_value_not_measured_is_neither_met_nor_missed(self) -> None:
        """Without a value the target says so, with the reason, never met."""
        target = record.evaluate("p", "t", None, at_most=1.0, detail="x", missing="no GPU")
        assert (target.met, target.verdict, target.detail, target.shown) == (
            None,
            "not measured",
            "no GPU",
            "-",
        )

    def test_exactly_one_bound(self) -> None:
        """A target has one bound: none or both is a mistake in the part."""
        with pytest.raises(ValueError, match="exactly one of at_most and at_least"):
            record.evaluate("p", "t", 1.0)
        with pytest.raises(ValueError, match="exactly one of at_most and at_least"):
            record.evaluate("p", "t", 1.0, at_most=2.0, at_least=0.5)


RUN: dict[str, Any] = {
    "command": "python benchmarks/gpu.py --out out",
    "started": "2026-01-01 00:00 UTC",
    "seconds": 300.0,
    "budget_s": 400.0,
    "dry_run": False,
    "environment": {
        "cuda_available": True,
        "gpu": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "memory_gib": 79.2,
        "pcie": "gen 5 x16 (now gen 5 x16)",
        "driver": "550.54.15",
        "torch": "2.11.0+cu128",
        "cuda": "12.8",
        "cudnn": 91002,
        "nccl": "2.27.3",
        "python": "3.12.3",
        "tensorhooks": "0.1.0",
        "commit": None,
        "source_sha256": "abc",
        "cpus": 16,
        "platform": "Linux x86_64",
    },
    "parts": [
        {
            "name": "save-on-cpu",
            "title": "save_on_cpu",
            "limit_s": 70,
            "seconds": 40.0,
            "status": "ok",
            "summary": "86% less activation memory",
            "reason": None,
            "notes": ["12 blocks"],
            "tables": [
                {
                    "title": "Peak",
                    "columns": ["setting", "MiB", "note"],
                    "rows": [["none", "7,000", "a | b"], ["tensorhooks", "-", ""]],
                    "notes": [],
                }
            ],
            "targets": [
                {
                    "part": "save_on_cpu",
                    "name": "less memory",
                    "shown": "86%",
                    "bound": ">= 70%",
                    "met": True,
                    "verdict": "met",
                    "detail": "",
                },
                {
                    "part": "save_on_cpu",
                    "name": "step over its bound",
                    "shown": "1.25x",
                    "bound": "<= 1.10x",
                    "met": False,
                    "verdict": "MISSED",
                    "detail": "bound by the copies (the link)",
                },
            ],
            "data": {},
        },
        {
            "name": "checkpoint",
            "title": "checkpoint",
            "limit_s": 45,
            "seconds": 45.2,
            "status": "timeout",
            "summary": "",
            "reason": "stopped at its time limit (45 s)",
            "notes": [],
            "tables": [],
            "targets": [],
            "data": {},
            "log_tail": "Traceback ...\nKeyboardInterrupt",
        },
    ],
}


class TestReport:
    def test_the_machine_and_software_come_first(self) -> None:
        """The report opens with the GPU, its driver, and the torch, CUDA and NCCL versions."""
        markdown = report.render(RUN)
        head = markdown.split("| part |")[0]
        assert head.startswith("# GPU run: NVIDIA H100 80GB HBM3\n")
        for text in ("driver 550.54.15", "torch 2.11.0+cu128", "CUDA 12.8", "NCCL 2.27.3"):
            assert text in head, text
        assert "PCIe gen 5 x16" in head

    def test_targets_and_trouble_stand_out(self) -> None:
        """Targets are one table with MISSED in bold; a part out of time shows its last lines."""
        markdown = report.render(RUN)
        assert (
            "| save_on_cpu | step over its bound | 1.25x | <= 1.10x | **MISSED** | bound by the "
            "copies (the link) |" in markdown
        )
        assert "| save_on_cpu | less memory | 86% | >= 70% | met |  |" in markdown
        assert "| checkpoint | **timeout** | 45 s (45 s) | stopped at its time limit" in markdown
        assert "```text\nTraceback ...\nKeyboardInterrupt\n```" in markdown

    def test_tables_are_markdown_with_numbers_to_the_right(self) -> None:
        """Cells are escaped; a column of numbers (dashes for gaps) is right-aligned."""
        lines = report.markdown_table(["setting", "MiB", "note"], [["none", "7,000", "a | b"]])
        assert lines == [
            "| setting | MiB | note |",
            "|---|---:|---|",
            "| none | 7,000 | a \\| b |",
        ]
        assert report.markdown_table(["a", "b"], [["x", "-"]])[1] == "|---|---|"

    def test_one_line_per_part(self) -> None:
        """The line printed per part gives its status, time, limit, summary and targets."""
        line = report.summary_line(RUN["parts"][0])
        assert line == (
            "[save-on-cpu] ok in 40.0 s (limit 70 s): 86% less activation memory; "
            "1 of 2 targets met"
        )


PYTEST_LOG = """\
tests/a.py::TestX::test_one PASSED                                       [ 25%]
tests/a.py::TestX::test_two[cuda-1] FAILED                               [ 50%]
tests/b.py::test_skip SKIPPED (needs a CUDA device)                      [ 75%]
tests/b.py::test_hangs
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
=========================== short test summary info ============================
FAILED tests/a.py::TestX::test_two[cuda-1] - AssertionError: grads differ
========================= 1 failed, 1 passed, 1 skipped in 12.34s =========================
"""

VERBOSE_FAILURES = """\
tests/a.py::TestX::test_race_is_caught FAILED                            [ 50%]
tests/a.py::test_other[cuda] FAILED                                      [100%]
=================================== FAILURES ===================================
_______________________ TestX.test_race_is_caught _______________________
tests/a.py:3: in test_race_is_caught
    x.exp()
E   torch.cuda._sanitizer.CUDASanitizerErrors: detected 1 errors
E   more
___________________________ test_other[cuda] ____________________________
E   AssertionError: no
=========================== short test summary info ============================
FAILED tests/a.py::TestX::test_race_is_caught
FAILED tests/a.py::test_other[cuda]
============================== 2 failed in 1.00s ===============================
"""


class TestParsers:
    def test_a_pytest_log_cut_short(self) -> None:
        """Outcomes, failure messages, the closing line and the test left running are read."""
        run = cuda_tests.parse_log(PYTEST_LOG)
        assert run.outcomes == {
            "tests/a.py::TestX::test_one": "PASSED",
            "tests/a.py::TestX::test_two[cuda-1]": "FAILED",
            "tests/b.py::test_skip": "SKIPPED",
        }
        assert run.messages["tests/a.py::TestX::test_two[cuda-1]"] == "AssertionError: grads differ"
        assert run.messages["tests/b.py::test_skip"] == "needs a CUDA device"
        assert run.running == "tests/b.py::test_hangs"
        assert run.final == "1 failed, 1 passed, 1 skipped"
        assert run.describe() == "1 passed, 1 failed, 1 skipped"

    def test_a_verbose_log_gives_each_failure_its_first_error_line(self) -> None:
        """Verbose pytest leaves messages out of its summary: the sections' E lines give them."""
        run = cuda_tests.parse_log(VERBOSE_FAILURES)
        assert run.messages == {
            "tests/a.py::TestX::test_race_is_caught": (
                "torch.cuda._sanitizer.CUDASanitizerErrors: detected 1 errors"
            ),
            "tests/a.py::test_other[cuda]": "AssertionError: no",
        }

    def test_controls_the_sanitizer_cannot_see_are_not_counted(self) -> None:
        """A control CSAN cannot model is listed with the reason, and not expected caught."""
        run = cuda_tests.parse_log(VERBOSE_FAILURES)
        blind = next(iter(cuda_tests.CSAN_BLIND))
        run.outcomes[f"tests/a.py::TestX::{blind}"] = "PASSED"
        rec = record.Recorder(None, "sanitizer")
        assert cuda_tests._controls(rec, run) == (1, 2)
        rows = {row[0]: row[2] for row in rec.result["tables"][0]["rows"]}
        assert rows["test_race_is_caught"] == "yes"
        assert rows["test_other[cuda]"] == "no"
        assert rows[blind].startswith("not a race CSAN models")

    def test_a_script_output_gives_tables_and_targets(self) -> None:
        """Markdown tables (titled by the line above) and target lines become the part's own."""
        text = (
            "planner, GPU rows\n| budget | peak |\n|---|---:|\n| 1 GiB | 0.98 GiB |\n\n"
            "target met: peak within budget 0.98 (target <= 1.00)\n"
            "TARGET MISSED: prediction error 0.07 (target <= 0.05)\n"
        )
        tables, targets = planner.parse_output(text)
        assert tables == [("planner, GPU rows", ["budget", "peak"], [["1 GiB", "0.98 GiB"]])]
        assert [(t.name, t.shown, t.bound, t.met) for t in targets] == [
            ("peak within budget", "0.98", "<= 1.00", True),
            ("prediction error", "0.07", "<= 0.05", False),
        ]

    def test_the_planner_part_runs_the_planner_script(self, tmp_path: Path) -> None:
        """With benchmarks/plan.py present, its --gpu output is taken into the part's record."""
        script = tmp_path / "benchmarks" / "plan.py"
        script.parent.mkdir()
        script.write_text(
            "import sys\n"
            f"assert sys.argv[1:] == ['--gpu', '--rounds', '2', '--out', {str(tmp_path)!r}]\n"
            "print('rows')\nprint('| a | b |')\nprint('|---|---|')\nprint('| 1 | 2 |')\n"
            "print('target met: fits 0.90 (target <= 1.00)')\n"
        )
        rec = record.Recorder(None, "planner")
        planner.run(rec, runner.Context(dry_run=False, root=tmp_path, scratch=tmp_path))
        assert rec.result["status"] == "ok"
        assert rec.result["tables"][0]["rows"] == [["1", "2"]]
        assert rec.result["targets"][0]["verdict"] == "met"

    def test_the_planner_part_without_the_script_is_skipped(self, tmp_path: Path) -> None:
        """Until benchmarks/plan.py exists the part says the planner is not present."""
        rec = record.Recorder(None, "planner")
        planner.run(rec, runner.Context(dry_run=False, root=tmp_path, scratch=tmp_path))
        assert rec.result["status"] == "skipped"
        assert rec.result["reason"].startswith("planner not present")


@pytest.mark.parametrize("module", [cuda_tests, planner, process, record, report])
def test_the_examples_in_the_docstrings_run(module: types.ModuleType) -> None:
    """The runner's torch-free modules' docstring examples pass (benchmarks/ is not collected)."""
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0


def test_the_runner_itself_imports_no_torch() -> None:
    """The runner's own process imports no torch: a CUDA hang can only stop a part's process."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import gpu_parts.runner; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.strip() == "False"
