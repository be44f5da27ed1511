"""How the checkers compare gradients: a reordered float sum passes, a wrong gradient fails."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from hypothesis import assume, given

import tensorhooks
from tensorhooks._testing.rounding import Perturbation, tolerances
from tensorhooks.testing import (
    GradientMismatchError,
    Program,
    assert_hooks_preserve_gradients,
    check_program,
    programs,
)

Factory = Any


def torch_cloning_pair() -> contextlib.AbstractContextManager[None]:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def docs_cloning_pair() -> contextlib.AbstractContextManager[None]:
    """The pair of docs/testing.md: saved tensors copied into a store outside autograd."""
    store: dict[int, torch.Tensor] = {}
    keys = itertools.count()

    def pack(tensor: torch.Tensor) -> int:
        key = next(keys)
        store[key] = tensor.detach().clone()
        return key

    return tensorhooks.saved_tensors_hooks(pack, store.__getitem__)


CORRECT: dict[str, Factory] = {
    "torch_cloning_pair": torch_cloning_pair,
    "docs_cloning_pair": docs_cloning_pair,
    "allow_mutation": tensorhooks.allow_mutation_on_saved_tensors,
}

# Shrunk by hypothesis from programs(checkpoint=True): the region's second argument is a
# non-dense view, so the cloning pair saves it dense and recomputation sums it in another order.
REORDERED = Program(
    """
import torch
from tensorhooks import checkpoint


def make_leaves():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()]


def program(leaves):
    leaf0, = leaves
    def region0(x, y):
        return x * y.sum()
    v1 = checkpoint(region0, leaf0, leaf0[0::2], use_reentrant=False)
    (v1.sum() * 1.25).backward()
    return [leaf0.grad]
""",
    n_leaves=1,
)


def _gradients(program: Program, context: Factory | None) -> list[torch.Tensor | None]:
    leaves = program.make_leaves()
    with context() if context is not None else contextlib.nullcontext():
        return program.run(leaves)


def test_recomputation_keeps_the_layout_of_the_call() -> None:
    """Cloned aliasing arguments are laid out as in the call again: the same sum, to the bit.

    (Recomputation once summed a contiguous clone of ``leaf0[0::2]``, one ulp away.)
    """
    (plain,), (cloned,) = _gradients(REORDERED, None), _gradients(REORDERED, torch_cloning_pair)
    assert plain is not None
    assert cloned is not None
    assert torch.equal(plain, cloned)


def _rounding_pair() -> contextlib.AbstractContextManager[None]:
    """A pair that rounds what it saves by up to one ulp: not a wrong gradient."""
    return tensorhooks.saved_tensors_hooks(lambda t: t.detach() * 0.1, lambda p: p / 0.1)


def test_one_ulp_of_rounding_is_no_false_alarm() -> None:
    """A pair whose round trip moves the last bit changes the gradient, and passes the check."""
    (plain,), (rounded,) = _gradients(REORDERED, None), _gradients(REORDERED, _rounding_pair)
    assert plain is not None
    assert rounded is not None
    difference = float((plain - rounded).abs().max())
    assert 0 < difference <= 4 * torch.finfo(torch.float64).eps * float(plain.abs().max())
    assert check_program(REORDERED, _rounding_pair)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_reordered_sum_is_no_false_alarm(name: str) -> None:
    """A correct context that only reorders a recomputed sum passes the check."""
    assert check_program(REORDERED, CORRECT[name])


def test_a_wrong_gradient_of_the_same_program_fails() -> None:
    """A pair off by one part in a million on the same program is still reported."""

    def slightly_wrong() -> contextlib.AbstractContextManager[None]:
        return tensorhooks.saved_tensors_hooks(lambda t: t.detach() * (1 + 1e-6), lambda t: t)

    with pytest.raises(GradientMismatchError, match=r"rounding allowed up to"):
        check_program(REORDERED, slightly_wrong)


@pytest.mark.parametrize("name", sorted(CORRECT))
@given(program=programs(checkpoint=True))
def test_correct_contexts_pass_on_checkpointed_programs(name: str, program: Program) -> None:
    """The cloning pairs (torch's, the docs') and allow_mutation pass on every kind of region."""
    assume(check_program(program, CORRECT[name]))


def test_perturbation_keeps_what_ops_write_and_alias() -> None:
    """The perturbed run changes values by a few ulps, never a write's target or a view's base."""
    x = torch.ones(4, dtype=torch.float64)
    with Perturbation(seed=1, precision=None):
        view = x[1:3]
        x.add_(1.0)  # an in-place op writes x itself
        total = (x * 1.0).sum()
    assert view._base is x
    assert x.tolist() == [2.0, 2.0, 2.0, 2.0]
    assert 0 < abs(float(total) - 8.0) < 8 * 64 * 3 * torch.finfo(torch.float64).eps


def test_tolerance_is_zero_where_rounding_moves_nothing() -> None:
    """Results that no perturbed run moved are compared bitwise."""
    exact = [torch.ones(3), None]
    assert tolerances(exact, [[torch.ones(3), None], None]) == [0.0, 0.0]
    moved = tolerances(exact, [[torch.tensor([1.0, 1.5, 1.0]), None]])
    assert moved[0] == pytest.approx(4 * 0.5)


def _pack_bf16(tensor: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
    return tensor.dtype, tensor.detach().to(torch.bfloat16)


def _unpack_bf16(packed: tuple[torch.dtype, torch.Tensor]) -> torch.Tensor:
    return packed[1].to(packed[0])


def test_a_bfloat16_pair_passes_with_its_precision() -> None:
    """precision=torch.bfloat16 accepts bfloat16 rounding however large the gradients grow."""
    assert_hooks_preserve_gradients(_pack_bf16, _unpack_bf16, precision=torch.bfloat16)


def test_a_broken_bfloat16_pair_fails_with_its_precision() -> None:
    """The bfloat16 tolerance still reports a pair that also loses the strides."""

    def pack(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.Tensor]:
        copy = tensor.detach().to(torch.bfloat16).clone()
        return tensor.shape, tensor.dtype, copy.as_strided((copy.numel(),), (1,))

    def unpack(packed: tuple[torch.Size, torch.dtype, torch.Tensor]) -> torch.Tensor:
        return packed[2].view(packed[0]).to(packed[1])

    with pytest.raises(GradientMismatchError, match=r"rounding allowed up to"):
        assert_hooks_preserve_gradients(pack, unpack, precision=torch.bfloat16, max_examples=200)
