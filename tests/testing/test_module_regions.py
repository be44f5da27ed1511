"""Module regions: checkpoint_module with hooks gives plain autograd's results; torch's not.

Programs drawn with the region kind "module" run regions as modules checkpointed per module,
with forward hooks and pre-hooks registered around the checkpoint. tensorhooks'
checkpoint_module gives plain autograd's results or raises; torch's composable checkpoint
recomputes on arguments a pre-hook changed twice, which the generator finds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings

import tensorhooks
from tensorhooks._testing.hooked import FORWARD_HOOKS, PRE_HOOKS
from tensorhooks.testing import GradientMismatchError, Program, check_checkpoint, programs

composable = pytest.importorskip("torch.distributed._composable")
torch_checkpoint_module: Callable[..., Any] = composable.checkpoint

_SEARCH = settings(
    max_examples=300,
    derandomize=True,
    phases=[Phase.generate],
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _global_hooks() -> int:
    module = torch.nn.modules.module
    return len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)


@settings(max_examples=30, deadline=None)
@given(programs(checkpoint={"module", "outside"}))
def test_checkpoint_module_matches_plain_autograd(program: Program) -> None:
    """Plain autograd's results, its in-place error, or tensorhooks' refusal; no hook left."""
    hooks = _global_hooks()
    assume(check_checkpoint(program))
    assert _global_hooks() == hooks


@settings(max_examples=15, deadline=None)
@given(programs(checkpoint={"module"}))
def test_a_context_around_module_regions(program: Program) -> None:
    """A context around checkpointed modules with hooks changes no gradient."""
    assume(tensorhooks.testing.check_program(program, tensorhooks.allow_mutation_on_saved_tensors))


def test_the_generator_draws_every_hook_and_registration() -> None:
    """Each hook, each registration, keyword arguments, and global hooks, are drawn."""
    sources: list[str] = []

    @settings(_SEARCH, max_examples=400)
    @given(programs(checkpoint={"module"}, writes=False))
    def collect(program: Program) -> None:
        sources.append(program.source)

    collect()
    text = "\n".join(sources)
    for hook, _ in [*PRE_HOOKS.values(), *FORWARD_HOOKS.values()]:
        assert hook.split(": ", 1)[1] in text, hook
    for registration in [
        r"register_forward_pre_hook\(.*\)\n\s*checkpoint_module",  # before
        r"checkpoint_module\(module\d\)\n\s*module\d\.register_forward_pre_hook",  # after
        r"register_forward_pre_hook\(.*prepend=True\)",
        r"register_forward_hook\(.*prepend=True\)",
        r"register_module_forward_pre_hook\(lambda m, args: None if m is not",
        r"register_module_forward_hook\(lambda m, args, kwargs, out:.*with_kwargs=True\)",
        r"module\d\(\w+, [xyz]=",  # keyword arguments
        r"finally:\n\s*for handle in handles:",
    ]:
        assert re.search(registration, text), registration


def test_the_generator_finds_torchs_composable_checkpoint_wrong() -> None:
    """A pre-hook changing the arguments is applied twice in torch's recomputation.

    Registered before torch's composable checkpoint, or after it with ``prepend=True``, the
    hook runs again on arguments it already changed, and the gradient is silently wrong.

    One backward per graph: torch's composable checkpoint raises on a second one.
    """

    @_SEARCH
    @given(programs(checkpoint={"module"}, writes=False, backwards=["backward", "grad"]))
    def check(program: Program) -> None:
        assume(check_checkpoint(program, checkpoint_module=torch_checkpoint_module))

    with pytest.raises(GradientMismatchError, match="changed a gradient") as failure:
        check()
    changing = [PRE_HOOKS[kind][0].split(": ", 1)[1] for kind in ("args", "kwargs", "both")]
    assert any(hook in str(failure.value) for hook in changing)
