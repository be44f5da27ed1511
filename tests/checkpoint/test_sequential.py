"""checkpoint_sequential: torch's segments and results, on tensorhooks' checkpoint."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorhooks
from tensorhooks.checkpointing import checkpoint_sequential
from tests.checkpoint.common import assert_same


class Counted(nn.Module):
    """A Linear then a tanh (or a dropout), counting its forward calls."""

    def __init__(self, seed: int, *, dropout: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(5, 5, generator=generator, dtype=torch.float64))
        self.dropout = dropout
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = (x @ self.weight).tanh()
        return nn.functional.dropout(h, 0.3) if self.dropout else h


def model(count: int, *, dropout: bool = False) -> nn.Sequential:
    return nn.Sequential(*(Counted(seed, dropout=dropout) for seed in range(count)))


def leaf(seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, generator=generator, dtype=torch.float64, requires_grad=True)


def gradients(
    run: Callable[[nn.Sequential, torch.Tensor], torch.Tensor], net: nn.Sequential
) -> tuple[list[torch.Tensor], list[int]]:
    """The gradients of input and weights, with torch.autograd.grad, and each module's calls."""
    torch.manual_seed(0)
    x = leaf()
    out = run(net, x)
    got = torch.autograd.grad(out.square().sum(), [x, *net.parameters()])
    return list(got), [module.calls for module in net]  # type: ignore[misc]


def ours(segments: int, **kwargs: Any) -> Callable[[nn.Sequential, torch.Tensor], torch.Tensor]:
    return lambda net, x: checkpoint_sequential(net, segments, x, use_reentrant=False, **kwargs)


def torchs(segments: int, **kwargs: Any) -> Callable[[nn.Sequential, torch.Tensor], torch.Tensor]:
    return lambda net, x: torch_checkpoint.checkpoint_sequential(
        net, segments, x, use_reentrant=False, **kwargs
    )


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 6), data=st.data(), dropout=st.booleans())
def test_matches_torch_and_plain_autograd(count: int, data: st.DataObject, dropout: bool) -> None:
    """Any segment count gives plain autograd's gradients and state, where torch counts twice."""
    segments = data.draw(st.integers(1, count), label="segments")
    plain, plain_calls = gradients(lambda net, x: net(x), model(count, dropout=dropout))
    got, our_calls = gradients(ours(segments), model(count, dropout=dropout))
    expected, torch_calls = gradients(torchs(segments), model(count, dropout=dropout))
    assert_same(got, plain)
    assert_same(got, expected)
    # `self.calls += 1` rebinds the counter: recomputation runs with the call's binding and the
    # forward pass's is put back, so each module counts one call, as plain autograd's do.
    assert our_calls == plain_calls == [1] * count
    size = count // segments
    checkpointed = size * (segments - 1)  # the last segment is run once, as in torch
    assert torch_calls == [2 if index < checkpointed else 1 for index in range(count)]


def test_a_list_of_modules_and_functions() -> None:
    """A list may mix modules and plain functions; nn.Sequential's children are run the same."""
    net = model(4)
    functions: list[Callable[[torch.Tensor], torch.Tensor]] = [net[0], torch.sin, net[1], net[2]]

    def run(checkpointed: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        x = leaf()
        return list(torch.autograd.grad(checkpointed(functions, 2, x).sum(), [x, net[0].weight]))

    def plain(fs: list[Any], segments: int, x: torch.Tensor) -> torch.Tensor:
        for function in fs:
            x = function(x)
        return x

    expected = run(plain)
    assert_same(run(lambda *a: checkpoint_sequential(*a, use_reentrant=False)), expected)
    assert_same(
        run(lambda *a: torch_checkpoint.checkpoint_sequential(*a, use_reentrant=False)), expected
    )


def test_preserve_rng_state_false_as_torch() -> None:
    """preserve_rng_state=False reaches each segment: torch's gradients, not plain autograd's."""
    plain, _ = gradients(lambda net, x: net(x), model(4, dropout=True))
    got, _ = gradients(ours(2, preserve_rng_state=False), model(4, dropout=True))
    expected, _ = gradients(torchs(2, preserve_rng_state=False), model(4, dropout=True))
    assert_same(got, expected)
    assert not all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


def test_grad_and_backward_inputs_work_where_torchs_default_refuses() -> None:
    """autograd.grad and backward(inputs=...) work; torch's reentrant default refuses .grad."""
    net = model(4)
    x = leaf()
    out = checkpoint_sequential(net, 2, x, use_reentrant=False)
    out.sum().backward(inputs=[x])
    assert x.grad is not None
    assert all(p.grad is None for p in net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about use_reentrant, checked below
        refused = torch_checkpoint.checkpoint_sequential(net, 2, x)
    with pytest.raises(RuntimeError, match=r"compatible with \.grad\(\)"):
        torch.autograd.grad(refused.sum(), [x])


def test_use_reentrant_left_out_warns_as_torch() -> None:
    """Left out, use_reentrant warns as in torch (a UserWarning), then runs non-reentrant."""
    x = leaf()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_checkpoint.checkpoint_sequential(model(4), 2, leaf())
        out = checkpoint_sequential(model(4), 2, x)
    theirs, mine = caught
    assert theirs.category is mine.category is UserWarning
    for caught_warning in (theirs, mine):
        assert "use_reentrant parameter should be passed explicitly" in str(caught_warning.message)
    assert "non-reentrant" in str(mine.message)
    assert mine.filename == __file__  # points at the caller, as torch's does
    (gx,) = torch.autograd.grad(out.sum(), [x])  # the non-reentrant variant ran
    assert gx.shape == x.shape


def test_use_reentrant_true_is_refused() -> None:
    """use_reentrant=True raises a ValueError naming the way out, even with one segment."""
    for segments in (1, 2):
        with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="use_reentrant=False"):
            checkpoint_sequential(model(4), segments, leaf(), use_reentrant=True)


def test_unexpected_keywords_raise_a_value_error_as_torch() -> None:
    """A keyword other than preserve_rng_state is a ValueError in both, naming it."""
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        torch_checkpoint.checkpoint_sequential(model(2), 1, leaf(), use_reentrant=False, scale=2)
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="scale"):
        checkpoint_sequential(model(2), 1, leaf(), use_reentrant=False, scale=2)


def test_a_second_input_is_a_type_error_as_in_torch() -> None:
    """A second input lands on use_reentrant: a TypeError in both, tensorhooks' naming it."""

    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    a, b = leaf(), leaf(8)
    for segments in (1, 2):
        with pytest.raises(TypeError, match="missing 1 required positional argument"):
            torch_checkpoint.checkpoint_sequential(nn.Sequential(Two(), Two()), 1, a, b)
        with pytest.raises(
            tensorhooks.CheckpointArgumentTypeError,
            match=r"use_reentrant must be None, True or False, got a Tensor .* a second input",
        ):
            checkpoint_sequential(nn.Sequential(Two(), Two()), segments, a, b)  # type: ignore[arg-type]
    out = checkpoint_sequential(model(2), 2, a, 0)  # torch's 0 and 1 pass as flags
    assert out.shape == a.shape


@pytest.mark.parametrize(
    ("segments", "error", "message"),
    [
        (0, tensorhooks.CheckpointArgumentValueError, r"from 1 to the number of functions \(3\)"),
        (4, tensorhooks.CheckpointArgumentValueError, r"got 4"),
        (-1, tensorhooks.CheckpointArgumentValueError, r"got -1"),
        (1.5, tensorhooks.CheckpointArgumentTypeError, r"must be an int, got 1\.5 of type float"),
    ],
)
def test_segment_counts_torch_misreads_are_refused(
    segments: Any, error: type[Exception], message: str
) -> None:
    """0, more than the functions, negative (torch then silently checkpoints nothing), not int."""
    with pytest.raises(error, match=message):
        checkpoint_sequential(model(3), segments, leaf(), use_reentrant=False)


def test_an_empty_sequence_returns_its_input() -> None:
    """No function: the input comes back, as from an empty nn.Sequential."""
    x = leaf()
    assert checkpoint_sequential(nn.Sequential(), 1, x, use_reentrant=False) is x


def test_nothing_outlives_backward() -> None:
    """Each segment's recomputation state is released when backward ends."""
    out = checkpoint_sequential(model(6), 3, leaf(), use_reentrant=False)
    out.sum().backward()
    assert tensorhooks.live_graph_tasks() == 0
