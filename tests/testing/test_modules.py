"""check_module: a real model's forward and backward with and without a context."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tensorhooks
from tensorhooks.testing import CheckArgumentValueError, GradientMismatchError, check_module

Factory = Callable[[], contextlib.AbstractContextManager[Any]]


class Block(torch.nn.Module):
    """A small transformer block: attention, dropout, batch norm (buffers), an in-place scale."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.norm = torch.nn.BatchNorm1d(16)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attention(x, x, x, need_weights=False)
        h = torch.nn.functional.dropout(h + x, 0.1)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.mlp(h)
        return h.mul_(0.5)  # an in-place op on an activation


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block().double(), torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)


def freeing_pair() -> contextlib.AbstractContextManager[None]:
    """Saved tensors in a store that unpack pops: fine for one backward."""
    store: dict[int, torch.Tensor] = {}
    keys = itertools.count()

    def pack(tensor: torch.Tensor) -> int:
        key = next(keys)
        store[key] = tensor.detach().clone()
        return key

    return tensorhooks.saved_tensors_hooks(pack, store.pop)


def bfloat16_pair() -> contextlib.AbstractContextManager[None]:
    return tensorhooks.saved_tensors_hooks(
        lambda t: (t.dtype, t.detach().to(torch.bfloat16)), lambda p: p[1].to(p[0])
    )


CORRECT: dict[str, Factory] = {
    "allow_mutation": tensorhooks.allow_mutation_on_saved_tensors,
    "save_on_cpu": lambda: tensorhooks.save_on_cpu(min_offload_bytes=0),
    "torch_cloning_pair": lambda: torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.clone(), lambda t: t
    ),
    "freeing_pair": freeing_pair,
    "tensorhooks_cloning_pair": lambda: tensorhooks.saved_tensors_hooks(
        lambda t: t.detach().clone(), lambda t: t
    ),
}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_contexts_pass(name: str) -> None:
    """Correct contexts, a pair that frees on unpack among them, pass on a real block."""
    model, batch = model_and_batch()
    check_module(model, batch, CORRECT[name])


def test_a_checkpointed_model_passes_under_allow_mutation() -> None:
    """A model that checkpoints its block inside passes, compared with itself unwrapped."""
    model, batch = model_and_batch()

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return tensorhooks.checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]

    check_module(Checkpointed(), batch, tensorhooks.allow_mutation_on_saved_tensors)


@pytest.mark.parametrize(
    ("pair", "match"),
    [
        pytest.param(
            lambda: tensorhooks.saved_tensors_hooks(lambda t: t, torch.zeros_like),
            r"changed a gradient \(parameter ",
            id="unpack_returns_zeros",
        ),
        pytest.param(
            lambda: tensorhooks.saved_tensors_hooks(lambda t: t.detach(), torch.Tensor.t),
            r"the context raised where plain autograd does not",
            id="unpack_transposes",
        ),
    ],
)
def test_broken_pairs_fail_naming_what_differs(pair: Factory, match: str) -> None:
    """A broken pair raises GradientMismatchError naming the module and what differs."""
    model, batch = model_and_batch()
    with pytest.raises(GradientMismatchError, match=match) as failure:
        check_module(model, batch, pair)
    assert "The module: Block, called on tensors of shapes (3, 5, 16)" in str(failure.value)


def test_a_bfloat16_pair_passes_with_its_precision_only() -> None:
    """Rounding saved tensors to bfloat16 passes with precision=torch.bfloat16, not bitwise."""
    model, batch = model_and_batch()
    check_module(model, batch, bfloat16_pair, precision=torch.bfloat16)
    with pytest.raises(GradientMismatchError, match=r"rounding allowed up to"):
        check_module(model, batch, bfloat16_pair)


def test_the_module_and_random_state_are_left_as_found() -> None:
    """Parameters, buffers and the random-number state are what they were before the check."""
    model, batch = model_and_batch()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    check_module(model, batch, tensorhooks.allow_mutation_on_saved_tensors)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_a_custom_loss_and_several_inputs() -> None:
    """loss= says what backward starts from; every input that requires grad is compared."""
    bilinear = torch.nn.Bilinear(4, 3, 2).double()
    left = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    right = torch.randn(5, 3, dtype=torch.float64)
    check_module(
        bilinear,
        (left, right),
        tensorhooks.save_on_cpu,
        loss=lambda out: out.pow(2).mean(),
    )


def test_nothing_to_compare_is_refused() -> None:
    """A module and inputs with nothing requiring grad raise CheckArgumentValueError."""
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(CheckArgumentValueError, match=r"no parameter .* requires grad"):
        check_module(frozen, torch.randn(2, 4), tensorhooks.save_on_cpu)


def test_the_models_own_error_is_raised_as_is() -> None:
    """A model that fails without the context raises its own error, not a mismatch."""
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
        check_module(torch.nn.Linear(4, 4), torch.randn(2, 3), tensorhooks.save_on_cpu)
