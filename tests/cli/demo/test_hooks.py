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
    assert row.ours.detail == (
        "SavedTensorModifiedError: one of the variables needed for gradient computation has "
        "been modified by an inplace operation: [torch.FloatTensor [3]] is at version 1; "
        "expected version 0 instead."
    )


def test_bad_message_errors_say_what_went_wrong(rows: list[Row]) -> None:
    """Both errors for a message that is not a string are shown up to the end of a sentence."""
    (row,) = rows_of(rows, "disable_saved_tensors_hooks")
    assert (
        row.torch.detail
        == "TypeError: _saved_tensors_hooks_disable(): incompatible function arguments."
    )
    assert row.ours.detail == (
        "HookArgumentTypeError: disable_saved_tensors_hooks: error_message must be a str, got "
        "123 of type int"
    )


def test_state_left_behind_by_multi_grad_hooks(rows: list[Row]) -> None:
    """Torch keeps a failed backward's gradient and loses calls under threads; ours does not."""
    failed, threads = rows_of(rows, "register_multi_grad_hook")
    assert failed.torch.result == "keeps 256.0 KiB"
    assert failed.ours.result == "keeps nothing"
    assert threads.ours.detail == "800 of 800 calls, 400 of 400 with every gradient"
