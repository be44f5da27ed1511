"""MutationContext: what a context tracks and clones, and what it releases on exit."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

import tensorhooks
from tensorhooks._mutation.context_state import MutationContext
from tests.mutation.programs import leaf_4x6

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def _live_handles(ctx: MutationContext) -> list[Any]:
    return [saved for saved in (ref() for ref in ctx._refs()) if saved is not None]


def test_yields_a_context_that_is_cleared_on_exit() -> None:
    """The yielded object tracks saved tensors and clones and is emptied on exit."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        assert isinstance(ctx, MutationContext)
        b = a * 1
        out = (b**2).sum() + b.sin().sum()
        assert (ctx.num_saved(), ctx.num_cloned()) == (2, 0)
        b.mul_(2.0)
        assert (ctx.num_saved(), ctx.num_cloned()) == (2, 2)
    assert (ctx.num_saved(), ctx.num_cloned()) == (0, 0)
    del out


def test_clones_only_saved_and_written_tensors() -> None:
    """Writes to tensors that nothing saved clone nothing; a tensor saved twice cloned once."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        b, c = a * 1, a * 2
        out = (b * b).sum()  # b saved twice
        c.mul_(2.0)
        (c * 1).add_(1.0)
        assert ctx.num_cloned() == 0
        b.mul_(2.0)
        assert ctx.num_cloned() == 2  # two handles ...
        clones = {id(saved.tensor) for saved in _live_handles(ctx)}
        assert len(clones) == 1  # ... sharing one clone
        out.backward()
        assert (ctx.num_saved(), ctx.num_cloned()) == (0, 0)


def test_state_cleared_releases_saved_tensors() -> None:
    """Exiting releases what a live graph saved; its storage is freed."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        b = a * 1
        out = (b**2).sum()
        b.mul_(2.0)
        (clone,) = [weakref.ref(saved.tensor) for saved in _live_handles(ctx)]
    assert clone() is None
    del out
