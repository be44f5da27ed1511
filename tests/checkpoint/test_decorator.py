"""checkpoint(...) with no function: torch 2.14's decorator (curried) form."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import tensorhooks
from tensorhooks.checkpointing import checkpoint
from tests.checkpoint.common import assert_same, block_of, input_tensor, weights

# torch 2.14 added the form; on earlier releases only tensorhooks' side is checked.
TORCH_HAS_IT = inspect.signature(torch_checkpoint.checkpoint).parameters["function"].default is None
needs_torchs = pytest.mark.skipif(not TORCH_HAS_IT, reason="torch's checkpoint has no such form")


def test_the_function_keeps_its_own_keywords() -> None:
    """Keywords of the decorated function named like checkpoint's options reach the function."""
    seen: dict[str, Any] = {}

    @checkpoint(use_reentrant=False, early_stop=False)
    def block(h: torch.Tensor, *, early_stop: int, use_reentrant: str) -> torch.Tensor:
        seen.update(early_stop=early_stop, use_reentrant=use_reentrant)
        return h.sin()

    x = input_tensor()
    block(x, early_stop=3, use_reentrant="mine").sum().backward()
    assert seen == {"early_stop": 3, "use_reentrant": "mine"}
    assert block.__name__ == "block"
    assert block.__wrapped__.__name__ == "block"  # type: ignore[attr-defined]


def test_as_a_method_decorator() -> None:
    """On a method it binds self, and gives plain autograd's gradients."""
    w1, w2 = weights()

    class Block(torch.nn.Module):
        @checkpoint(use_reentrant=False)
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return block_of(w1, w2)(h)

    x = input_tensor()
    got = torch.autograd.grad(Block()(x).sum(), [x, w1, w2])
    assert_same(got, torch.autograd.grad(block_of(w1, w2)(x).sum(), [x, w1, w2]))
    assert tensorhooks.live_graph_tasks() == 0


def test_use_reentrant_left_out_warns_at_each_call_not_at_decoration() -> None:
    """As torch 2.14: the decorator is made silently; every call of the function warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decorated = checkpoint()(torch.sin)
        assert caught == []
        for _ in range(2):
            decorated(input_tensor())
    assert [w.category for w in caught] == [UserWarning, UserWarning]
    assert all(w.filename == __file__ for w in caught)  # points at the caller
    assert "use_reentrant parameter should be passed explicitly" in str(caught[0].message)


def test_arguments_without_a_function_raise_a_value_error() -> None:
    """Keywords (or positional arguments) with no function are a ValueError, as in torch 2.14."""
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=r"keywords \['scale'\]"):
        checkpoint(use_reentrant=False, scale=2)  # type: ignore[call-overload]


@needs_torchs
def test_same_results_as_torchs_decorator() -> None:
    """Gradients, keyword handling and the ValueError as torch's own decorator form."""
    w1, w2 = weights()
    results = []
    for decorate in (checkpoint, torch_checkpoint.checkpoint):

        @decorate(use_reentrant=False)
        def block(h: torch.Tensor, *, debug: float) -> torch.Tensor:
            return block_of(w1, w2)(h) * debug

        x = input_tensor()
        results.append(torch.autograd.grad(block(x, debug=2.0).sum(), [x, w1, w2]))
        with pytest.raises(ValueError):  # noqa: PT011 (torch's message differs)
            decorate(use_reentrant=False, scale=2)
    assert_same(results[0], results[1])
