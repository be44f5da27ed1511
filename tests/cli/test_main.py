"""``python -m tensorhooks``: help, usage errors, the missing extra, the version."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorhooks.cli import _main
from tensorhooks.cli._main import main

ROOT = Path(__file__).resolve().parents[2]


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
        """`python -m tensorhooks --help` names every command and exits 0."""
        done = self._run("--help")
        assert done.returncode == 0, done.stderr
        assert "{demo,bench,plan,explain}" in done.stdout

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


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_default_output_stays_out_of_git_status(command: str) -> None:
    """What a command writes by default goes to a directory the repository's .gitignore lists."""
    (subparsers,) = (
        action
        for action in _main._parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    out = subparsers.choices[command].get_default("out")
    assert not Path(out).is_absolute()
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert f"{Path(out).parts[0]}/" in ignored
