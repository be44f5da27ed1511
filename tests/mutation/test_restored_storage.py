"""Saved tensors whose storage was freed and refilled (FSDP2's unsharded parameters)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

# Registers fsdp::split_with_sizes_copy, FSDP2's all-gather copy-out.
import torch.distributed.fsdp._fully_shard._fsdp_collectives

import tensorhooks

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def _freed_and_refilled(refill: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """x.grad of ``(x @ w).sum()`` where w's storage is freed and refilled before backward."""
    flat = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = flat.clone()
    weight = torch.nn.Parameter(flat.view(3, 4))
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = (x @ weight).pow(2).sum()
        flat.untyped_storage().resize_(0)  # as FSDP2 frees after forward: no operator sees it
        flat.untyped_storage().resize_(values.numel() * values.element_size())
        refill(flat, values)
        loss.backward()
    assert x.grad is not None
    return x.grad


def _expected() -> torch.Tensor:
    flat = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    (x @ flat.view(3, 4)).pow(2).sum().backward()
    assert x.grad is not None
    return x.grad


def _copy_preserving_version(flat: torch.Tensor, values: torch.Tensor) -> None:
    with torch.autograd._unsafe_preserve_version_counter(flat):
        flat.copy_(values)


def _fsdp2_copy_out(flat: torch.Tensor, values: torch.Tensor) -> None:
    out = [flat.view(1, -1)]
    with torch.autograd._unsafe_preserve_version_counter(tuple(out)):
        torch.ops.fsdp.split_with_sizes_copy(values.view(1, -1), [12], dim=1, out=out)


@pytest.mark.parametrize(
    "refill", [_copy_preserving_version, _fsdp2_copy_out], ids=["copy_", "fsdp2_copy_out"]
)
def test_refilled_weights_are_read_as_refilled(
    refill: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """A refill autograd does not count gives plain autograd's gradient, not freed memory."""
    torch.testing.assert_close(_freed_and_refilled(refill), _expected(), rtol=0, atol=0)


def test_counted_write_after_save_keeps_the_save_time_value() -> None:
    """The same write with the version counter moving is a mutation: the clone is used."""

    def scale(flat: torch.Tensor, values: torch.Tensor) -> None:
        flat.copy_(values * 2)

    flat = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weight = torch.nn.Parameter(flat.view(3, 4))
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = (x @ weight).pow(2).sum()
        scale(flat, flat.clone())
        loss.backward()
    torch.testing.assert_close(x.grad, _expected(), rtol=0, atol=0)


def test_write_through_data_keeps_the_save_time_value() -> None:
    """``.data`` has a counter of its own: its write moves it, so the clone is used."""
    a = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        loss = (b * b).sum()
        b.data.mul_(5.0)
        loss.backward()
    torch.testing.assert_close(a.grad, 2 * torch.ones(2, 3, dtype=torch.float64))


def test_shares_version_counter_asks_the_counters() -> None:
    """Views share the counter, ``.data`` and clones do not; the counters are left as found."""
    from tensorhooks._mutation.saved_tensor import shares_version_counter

    base = torch.ones(4)
    base.add_(1)
    with torch.inference_mode():
        inference = torch.ones(4)
    assert shares_version_counter(base, base[1:])
    assert shares_version_counter(base[1:], base.view(2, 2))
    assert not shares_version_counter(base, base.data)  # versions 1 and 0
    fresh = torch.ones(4)
    assert not shares_version_counter(fresh, fresh.data)  # both at 0: the probe tells
    assert fresh._version == 0
    assert not shares_version_counter(base, base.clone())
    assert not shares_version_counter(base, inference)
    assert base._version == 1


def test_write_after_refills_keeps_the_refilled_value() -> None:
    """Refilled twice, then written for real: backward reads the save-time (refilled) value."""

    def refill_then_write(flat: torch.Tensor, values: torch.Tensor) -> None:
        _copy_preserving_version(flat, values)
        n_bytes = values.numel() * values.element_size()
        flat.untyped_storage().resize_(0)
        flat.untyped_storage().resize_(n_bytes)
        _copy_preserving_version(flat, values)
        with torch.no_grad():
            flat.add_(-1.5)

    torch.testing.assert_close(_freed_and_refilled(refill_then_write), _expected(), rtol=0, atol=0)


def test_activations_are_not_kept_past_their_clone() -> None:
    """Only weights wait for the verdict: a written activation is released once cloned."""
    import weakref

    leaf = torch.ones(3, dtype=torch.float64, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        h = leaf * 2
        loss = (h * h).sum()
        watched = weakref.ref(h)
        h.mul_(3.0)
        del h
        assert watched() is None
        loss.backward()
    torch.testing.assert_close(leaf.grad, 8 * torch.ones(3, dtype=torch.float64))


def test_refilled_view_of_a_weight_held_detached_is_read_as_refilled() -> None:
    """A view of a weight saved while its node is the newest is held detached, still a weight.

    A checkpoint region's argument ``w[3]`` is saved right after the view is made: the context
    holds it through a detached alias, which must still wait for the refill's verdict.
    """
    flat = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = flat.clone()
    weight = torch.nn.Parameter(flat.view(4, 4))
    reference = torch.nn.Parameter(values.view(4, 4))

    def region(x: torch.Tensor) -> torch.Tensor:
        return x * x[1::2].sum()

    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = tensorhooks.checkpoint(region, weight[3], use_reentrant=False).pow(2).sum()
        n_bytes = flat.untyped_storage().nbytes()
        flat.untyped_storage().resize_(0)  # as FSDP2 frees after forward: no operator sees it
        flat.untyped_storage().resize_(n_bytes)
        flat.numpy().fill(float("nan"))  # what freed memory holds, written by no operator
        _copy_preserving_version(flat, values)
        (got,) = torch.autograd.grad(loss, [weight])
    (expected,) = torch.autograd.grad(region(reference[3]).pow(2).sum(), [reference])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
