"""A region's arguments: tensors taken out, saved as inputs, and put back with their aliasing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

import tensorhooks
from tensorhooks import checkpoint
from tests.checkpoint.common import assert_same

# Arguments that alias each other, made from one base: (what is passed, how the region writes).
ALIASES: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "tensor and its view": lambda base: (base, base[1:3]),
    "overlapping slices": lambda base: (base[0:3], base[2:5]),
    "view and the tensor": lambda base: (base[::2], base),
    "transposed view": lambda base: (base.view(2, 3), base.view(2, 3).t()),
}


@pytest.mark.parametrize("kind", sorted(ALIASES))
def test_aliasing_arguments_written_in_the_region(kind: str) -> None:
    """Arguments sharing a storage, written in place in the region: plain autograd's gradient."""
    generator = torch.Generator().manual_seed(0)
    leaf = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)

    def region(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b.mul_(2)
        return (a.reshape(-1).sin() * w[: a.numel()]).sum() + b.exp().sum()

    with tensorhooks.allow_mutation_on_saved_tensors():
        got = torch.autograd.grad(
            checkpoint(region, *ALIASES[kind](leaf * 1), use_reentrant=False), [leaf, w]
        )
        expected = torch.autograd.grad(region(*ALIASES[kind](leaf * 1)), [leaf, w])
    assert_same(got, expected)


@pytest.mark.parametrize("reads_it_too", [False, True], ids=["argument", "argument and closure"])
def test_an_argument_whose_data_was_swapped_raises(reads_it_too: bool) -> None:
    """``x.data = ...`` after the call moves no version: backward raises, never recomputes."""
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    other = torch.randn(4, 4, dtype=torch.float64)

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight if reads_it_too else other)

    out = checkpoint(region, weight, use_reentrant=False)
    weight.data = weight.detach() * 0.5 + 0.25
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match="was replaced between"):
        out.sum().backward()


def _cloning_pair() -> tensorhooks.saved_tensors_hooks:
    """A pair keeping a copy of each saved tensor: the region's inputs are saved as copies."""
    return tensorhooks.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)


@pytest.mark.parametrize("pair", [False, True], ids=["no pair", "cloning pair"])
@pytest.mark.parametrize("swapped", [False, True], ids=["kept", "data swapped after"])
def test_state_written_through_an_argument_raises(pair: bool, swapped: bool) -> None:
    """State the region writes and also gets as an argument (a view made for the call) raises.

    The forward pass read the argument after the region's write and the state before it:
    recomputation cannot give both. Decided when the forward pass ends, so neither an argument
    saved as a copy (whose view died after the call) nor ``state.data = ...`` after the call
    hides it (each gave a silently wrong gradient).
    """
    x = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    state = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)

    def region(a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = a + state.sum()
        with torch.no_grad():
            state.add_(-1.5)
        return torch.nn.functional.linear(a, z) + h

    context = _cloning_pair() if pair else contextlib.nullcontext()
    with context:
        out = checkpoint(region, x, state[0:1], use_reentrant=False)
    if swapped:
        state.data = state.detach() * 0.5 + 0.25
    # Without a pair the argument's own version check speaks first; with one, the write.
    words = "through an argument" if pair else "changed this argument in place"
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match=words):
        out.sum().backward()
