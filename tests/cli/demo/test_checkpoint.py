"""The demo's checkpoint cases."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_checkpoint_rows(rows: list[Row]) -> None:
    """Torch's checkpoints: two wrong gradients, a refused .grad(), a recomputed offload."""
    write, state, grad, offload = rows_of(rows, "checkpoint")
    assert write.torch.result == "WRONG gradient", write
    assert write.ours.result == "right gradient", write
    assert write.timing is not None
    assert state.torch.result == "WRONG gradient", state
    assert state.ours.result == "right gradient", state
    assert "spectral_norm" in state.situation
    assert grad.torch.result == "refuses", grad
    assert "use_reentrant=True" in grad.torch.detail
    assert grad.torch.detail == (
        "RuntimeError: When use_reentrant=True, torch.utils.checkpoint is incompatible with "
        ".grad() or passing an `inputs` parameter to .backward()."
    )
    assert not grad.torch.good
    assert grad.ours.result == "right gradient", grad
    assert offload.torch.result == "recomputes", offload
    assert offload.torch.detail.startswith("1 matmul run again")
    assert offload.ours.result == "offloads", offload
