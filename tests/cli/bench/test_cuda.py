"""The bench's CUDA part (save_on_cpu and offload_parameters), run on CPU."""

from __future__ import annotations

from pathlib import Path

from tensorhooks.cli._bench.cuda import run_offload, run_offload_parameters
from tensorhooks.cli._bench.results import BenchOptions
from tensorhooks.cli._models import ModelConfig
from tests.params_device import HostCloneTransfer

SMALL = ModelConfig(batch=2, seq=8, d_model=16, heads=2, layers=2, vocab=32)


def test_offload_benchmark_runs_on_cpu() -> None:
    """The offload benchmark's code path runs on CPU (peak memory reads 0 there)."""
    rows = run_offload(BenchOptions(Path("."), rounds=1, steps=1), SMALL)
    assert [row.mode for row in rows] == [
        "no offload",
        "torch save_on_cpu",
        "tensorhooks save_on_cpu",
    ]
    assert all(row.step.median > 0 and row.peak_bytes == 0 for row in rows)


def test_offload_parameters_benchmark_streams_every_step() -> None:
    """The offload_parameters part times a model whose blocks really are streamed."""
    transfer = HostCloneTransfer()
    rows = run_offload_parameters(BenchOptions(Path("."), rounds=2, steps=4), SMALL, transfer)
    assert [row.mode for row in rows] == ["resident", "tensorhooks offload_parameters"]
    assert all(row.step.median > 0 and row.peak_bytes == 0 for row in rows)
    # 2 layers + embedding, final norm and head: 5 blocks; each step loads every block at
    # least once (forward) and the warm-up and timed steps ran.
    assert len(set(transfer.loads)) > 0
    assert len(transfer.loads) >= 5 * (1 + 2 * 3)
    assert transfer.alive() == set(), "device copies left alive after the handle was removed"
