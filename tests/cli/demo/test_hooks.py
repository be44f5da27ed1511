"""The demo's cases of the primitives: saved_tensors_hooks and register_multi_grad_hook."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row

from .conftest import rows_of


def test_identity_pack_then_write(rows: list[Row]) -> None:
    """On the identity-pack case torch's gradient is wrong; ours raises autograd's error."""
    (row,) = rows_of(rows, "saved_tensors_hooks")
    assert row.torch.result == "WRONG gradient", row
    assert row.ours.good, row
    assert row.ours.result == "raises"


def test_state_left_behind_by_multi_grad_hooks(rows: list[Row]) -> None:
    """Torch keeps a failed backward's gradient and loses calls under threads; ours does not."""
    failed, threads = rows_of(rows, "register_multi_grad_hook")
    assert failed.torch.result == "keeps 256.0 KiB"
    assert failed.ours.result == "keeps nothing"
    assert threads.ours.detail == "800 of 800 calls, 400 of 400 with every gradient"
