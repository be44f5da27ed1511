"""Placeholder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._console import Console


@dataclass(frozen=True)
class BenchOptions:
    out: Path
    rounds: int = 7
    steps: int = 20
    scripts: Path | None = None
    script_timeout: float = 600.0
    gpu: bool = True


def run_bench(options: BenchOptions, console: Console) -> int:
    return 0
