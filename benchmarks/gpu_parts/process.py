"""A command under a time limit, its output appended to a log; stopped as a whole group when late.

The command gets a process group of its own (``start_new_session``), so that at the limit every
process it started is stopped with it: first SIGINT (Python raises KeyboardInterrupt, so a part
records where it was and pytest prints what ran so far), then SIGKILL after a grace period for
a process stuck in a call that does not return (a hung CUDA synchronisation). The command starts
with SIGINT at its default action even where this process ignores it (a shell's background job
does), or Python in it would not raise KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 5.0
"""Seconds between SIGINT and SIGKILL at the time limit."""


@dataclass(frozen=True)
class Finished:
    """How a command ended: its exit status (None when stopped at its limit) and how long it ran."""

    returncode: int | None
    seconds: float

    @property
    def timed_out(self) -> bool:
        """Whether the command was stopped at its time limit."""
        return self.returncode is None


def run_logged(
    argv: Sequence[str],
    *,
    log: Path,
    limit_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    grace_s: float = GRACE_S,
) -> Finished:
    """Run ``argv`` with stdout and stderr appended to ``log``, stopped after ``limit_s`` seconds.

    Example:
        >>> import sys, tempfile, pathlib
        >>> log = pathlib.Path(tempfile.mkdtemp()) / "log"
        >>> run_logged([sys.executable, "-c", "print('hi')"], log=log, limit_s=30).returncode
        0
        >>> log.read_text()
        'hi\\n'
    """
    start = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(  # our own argv
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_interrupt_by_default,  # noqa: PLW1509  # one thread runs parts
        )
        timed_out = not _wait_unreaped(process.pid, start + max(limit_s, 0.0))
        if timed_out:
            _signal_group(process.pid, signal.SIGINT)
            _wait_unreaped(process.pid, time.monotonic() + grace_s)
        # The leader has exited (or is killed now) but is not reaped yet, so its pid is still
        # the id of its group: whatever it left running in the group is stopped, and nothing else.
        _signal_group(process.pid, signal.SIGKILL)
        returncode = process.wait()
    return Finished(None if timed_out else returncode, time.monotonic() - start)


def _interrupt_by_default() -> None:
    """In the child before exec: SIGINT back to its default action (an ignored one stays so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_unreaped(pid: int, until: float) -> bool:
    """Wait until ``pid`` exits or the clock reaches ``until``, without reaping it."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.05)


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
