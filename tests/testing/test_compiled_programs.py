"""Compiled programs: a tensorhooks context entered inside torch.compile gives plain autograd's.

Programs drawn with ``compile=True`` run their steps in a function compiled with the aot_eager
backend, enter a tensorhooks context inside it, may write a saved value in place, and run
backward inside the context, after it, or outside the compiled function. Compiling costs
seconds per program, so these tests draw few.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings

from tensorhooks._testing.compiled import COMPILED_CONTEXTS
from tensorhooks.testing import CheckArgumentValueError, Program, check_compiled, programs

pytest.importorskip("torch._dynamo")

# Few examples: each compiles.
COMPILED = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@COMPILED
@given(programs(compile=True))
def test_compiled_programs_match_plain_autograd(program: Program) -> None:
    """Plain autograd's gradients, its in-place error, or the save-time gradient."""
    assume(check_compiled(program))


def test_the_generator_draws_every_variant() -> None:
    """Each context, each place of backward, the in-place write, steps before the context."""
    sources: list[str] = []

    @settings(
        max_examples=200, derandomize=True, database=None, phases=[Phase.generate], deadline=None
    )
    @given(programs(compile=True))
    def collect(program: Program) -> None:
        sources.append(program.source)

    collect()  # drawing only: nothing compiles
    text = "\n".join(sources)
    for context in COMPILED_CONTEXTS.values():
        assert f"return {context}" in text, context
    inside = r"with context\(\):\n(            .*\n)*            grads = list\(torch.autograd.grad"
    after = r"\n        grads = list\(torch.autograd.grad"
    outside = r"loss = compiled\(.*\)\n    grads = list\(torch.autograd.grad"
    written = r"with context\(\):\n(            .*\n)*            with torch.no_grad\(\):\n"
    before = r"terms = \[\]\n        v\d+ = .*\n(.*\n)*        with context\(\):"
    for pattern in (inside, after, outside, written, before):
        assert re.search(pattern, text), pattern
    assert all('torch.compile(function, backend="aot_eager")' in source for source in sources)


def test_compile_takes_no_checkpoint_arguments_it_ignores() -> None:
    """compile=True still refuses an unknown region kind."""
    with pytest.raises(CheckArgumentValueError, match="checkpoint"):
        programs(compile=True, checkpoint=["nope"])
