"""Which saved tensors a write reaches: aliases torch misses, byte spans, clones per alias."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph

import tensorhooks
from tensorhooks._mutation import aliasing
from tests.mutation.programs import TORCH_IS_WRONG, grad_under, leaf_4x6, reference

pytestmark = pytest.mark.usefixtures("no_open_contexts")

# --- aliases: where torch 2.13 is silently wrong --------------------------------------------------


@pytest.mark.parametrize("name", sorted(TORCH_IS_WRONG))
def test_writes_through_any_alias_are_caught_where_torch_is_wrong(name: str) -> None:
    """Views, bases, strided and overlapping slices, out= into a view, dtype views."""
    program = TORCH_IS_WRONG[name]
    expected = grad_under(None, reference(program), leaf_4x6())
    got_torch = grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())
    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
    assert not torch.allclose(got_torch, expected), "torch got this one right"
    torch.testing.assert_close(got, expected)


def test_disjoint_write_clones_nothing() -> None:
    """A write next to a saved slice, not over it, leaves the slice uncloned."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        b = a * 1
        out = (b[2:] ** 2).sum()
        b[:2].mul_(2.0)
        b[:, 0:0].zero_()
        assert ctx.num_cloned() == 0
        b[1:3].mul_(2.0)
        assert ctx.num_cloned() == 1
        out.backward()
    torch.testing.assert_close(a.grad[2:], 2 * leaf_4x6()[2:])


def test_multi_output_out_variant() -> None:
    """out=(values, indices) writes are caught; torch fails with KeyError('out')."""

    def program(a: torch.Tensor) -> torch.Tensor:
        b = a * 1
        out = (b[0] ** 2).sum()
        with torch.no_grad():
            torch.max(torch.ones(4, 6, dtype=a.dtype), 0, out=(b[0], torch.empty(0).long()))
        return out

    expected = grad_under(None, reference(program), leaf_4x6())
    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
    torch.testing.assert_close(got, expected)
    with pytest.raises(KeyError, match="out"):
        grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())


@pytest.mark.parametrize(
    ("complex_leaf", "view"),
    [
        pytest.param(True, torch.conj, id="conj"),
        pytest.param(False, torch._neg_view, id="neg"),
    ],
)
def test_conj_and_neg_views_get_their_own_clone(
    complex_leaf: bool, view: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """A tensor and its conj or neg view, saved and then written, do not share one clone."""

    def program(a: torch.Tensor) -> torch.Tensor:
        b = a * 1
        product = b * view(b)  # saves b and its view: same elements, other values
        b.mul_(10.0)
        return (torch.view_as_real(product) if complex_leaf else product).sum()

    leaf = torch.complex(leaf_4x6(), leaf_4x6().flip(0)) if complex_leaf else leaf_4x6()
    expected = grad_under(None, reference(program), leaf)
    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf)
    torch.testing.assert_close(got, expected)
    assert torch.allclose(
        grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf), expected
    )


@pytest.mark.parametrize(
    ("make", "resizes", "span"),
    [
        (lambda x: x, False, (0, 192)),
        (lambda x: x[1:3], False, (48, 144)),
        (lambda x: x[:, 2], False, (16, 168)),
        (lambda x: x.t()[1:], False, (8, 192)),
        (lambda x: x[:, 0:0], False, None),
        (lambda x: x[:, 0:0], True, (0, float("inf"))),
        (lambda x: x[2:], True, (96, float("inf"))),
        (lambda x: x.view(torch.int32)[1], False, (48, 96)),
    ],
)
def test_byte_spans(make: Callable[[torch.Tensor], torch.Tensor], resizes: bool, span: Any) -> None:
    """Spans cover exactly the bytes an alias can reach (4 x 6 float64 storage)."""
    assert aliasing.byte_span(make(leaf_4x6()), resizes) == span


# --- tensors without real storage -----------------------------------------------------------------


def test_fake_tensors_do_not_crash() -> None:
    """FakeTensorMode: saves, writes through a view and backward run through."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.randn(4, 6, requires_grad=True)
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = a * 1
            out = (b[1:] ** 2).sum()
            b.mul_(2.0)
            assert ctx.num_cloned() == 1
            out.backward()
        assert a.grad is not None
        assert a.grad.shape == (4, 6)


def test_functional_tensors_do_not_crash() -> None:
    """FunctionalTensorMode inside or outside the context."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    with FunctionalTensorMode(), tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        a = torch.randn(4, 6, requires_grad=True)
        b = a * 1
        out = (b[1:] ** 2).sum()
        b.mul_(2.0)
        assert ctx.num_cloned() == 1
        out.backward()
        expected = torch.cat([torch.zeros(1, 6), 2 * a[1:].detach()])
        assert a.grad is not None
        assert torch.equal(a.grad, expected)  # the save-time values, not the doubled ones
    with tensorhooks.allow_mutation_on_saved_tensors(), FunctionalTensorMode():
        c = torch.randn(3)
        before = c.clone()
        c.add_(1.0)
        assert torch.equal(c, before + 1.0)


def test_sparse_tensors_without_storage() -> None:
    """A saved sparse tensor changed in place is cloned (storage-less: always)."""
    dense = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    sparse = torch.eye(3, dtype=torch.float64).to_sparse()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        out = torch.sparse.mm(sparse, dense).sum()
        sparse.mul_(5.0)
        assert ctx.num_cloned() == 1
        out.backward()
    torch.testing.assert_close(dense.grad, torch.ones(3, 4, dtype=torch.float64))
