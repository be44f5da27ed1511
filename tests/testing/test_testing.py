"""tensorhooks.testing on every context, nested and on threads; broken pairs make it fail."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tensorhooks
from tensorhooks.testing import (
    GradientMismatchError,
    Program,
    assert_context_preserves_gradients,
    assert_hooks_preserve_gradients,
    check_program,
    programs,
)

Factory = Callable[[], contextlib.AbstractContextManager[Any]]

PAIRS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "identity": (lambda t: t, lambda p: p),
    "detach": (lambda t: t.detach(), lambda p: p),
    "device_tuple": (lambda t: (t.device, t.detach()), lambda p: p[1]),
    "nested_dict": (lambda t: {"saved": [(t,)]}, lambda p: p["saved"][0][0]),
    "clone": (lambda t: t.detach().clone(), lambda p: p),
}

# Contexts that hypothesis nests at random; "disable" pushes no hooks, so it only goes innermost.
CONTEXTS: dict[str, Factory] = {
    **{
        f"hooks_{name}": (lambda pair=pair: tensorhooks.saved_tensors_hooks(*pair))
        for name, pair in PAIRS.items()
    },
    "save_on_cpu": tensorhooks.save_on_cpu,
    "save_on_cpu_copying": lambda: tensorhooks.save_on_cpu(min_offload_bytes=0),
    "allow_mutation": tensorhooks.allow_mutation_on_saved_tensors,
}
DISABLE: Factory = lambda: tensorhooks.disable_saved_tensors_hooks("no hooks in the program")  # noqa: E731

# Combinations the random programs found giving a silently wrong gradient, not fixed yet. Each
# entry is skipped by the nesting test; the single-context tests below have none.
KNOWN_LIMITATIONS: frozenset[tuple[str, ...]] = frozenset()


def _examples(divisor: int) -> int:
    """A share of the active profile's examples: the suite checks many contexts."""
    return max(5, (settings().max_examples or 100) // divisor)


def nested(names: tuple[str, ...], *, disable: bool) -> Factory:
    """Enter the named contexts outermost first; with ``disable``, first a disable around nothing.

    A ``disable_saved_tensors_hooks`` entered while hooks are in force raises at once (torch's
    semantics), so it goes around nothing, before the others: its exit must restore the state.
    """

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        if disable:
            with DISABLE():
                pass
        with contextlib.ExitStack() as stack:
            for name in names:
                stack.enter_context(CONTEXTS[name]())
            yield

    return enter


_WELL_CONDITIONED = """
import torch


def make_leaves():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, dtype=torch.float64, generator=generator).requires_grad_()
            for _ in range(2)]


def program(leaves):
    a, b = leaves
    loss = ((a @ b).sin() * a).sum()
    loss.backward()
    return [a.grad, b.grad]
"""


class TestEveryContext:
    @pytest.mark.parametrize("pair", sorted(PAIRS))
    def test_saved_tensors_hooks_pairs(self, pair: str) -> None:
        """Every pair pushed by tensorhooks.saved_tensors_hooks keeps gradients right."""
        assert_hooks_preserve_gradients(*PAIRS[pair], max_examples=_examples(4))

    @pytest.mark.parametrize("name", ["save_on_cpu", "save_on_cpu_copying", "allow_mutation"])
    def test_contexts(self, name: str) -> None:
        """save_on_cpu and allow_mutation_on_saved_tensors keep gradients right."""
        assert_context_preserves_gradients(CONTEXTS[name], max_examples=_examples(3))

    def test_disable_saved_tensors_hooks_around_the_program(self) -> None:
        """disable_saved_tensors_hooks with no hooks inside changes nothing."""
        assert_context_preserves_gradients(DISABLE, max_examples=_examples(6))

    def test_tolerance_accepts_a_lossy_pair_on_a_well_conditioned_program(self) -> None:
        """rtol/atol let a float32 round trip pass where the bitwise default reports it."""
        # A fixed program: on random ones (exp of exp) rounding is amplified past any tolerance.
        program = Program(_WELL_CONDITIONED, n_leaves=2)

        def lossy() -> contextlib.AbstractContextManager[object]:
            return tensorhooks.saved_tensors_hooks(
                lambda t: t.to(torch.float32), lambda p: p.to(torch.float64)
            )

        assert check_program(program, lossy, rtol=1e-5, atol=1e-6)
        with pytest.raises(GradientMismatchError, match="changed a gradient"):
            check_program(program, lossy)


@given(
    st.lists(st.sampled_from(sorted(CONTEXTS)), min_size=1, max_size=3).map(tuple),
    st.booleans(),
    programs(checkpoint=True),
)
def test_random_nestings(names: tuple[str, ...], disable: bool, program: Program) -> None:
    """Random nestings of every context, around programs with checkpoint regions, never lie."""
    assume(names not in KNOWN_LIMITATIONS)
    assume(check_program(program, nested(names, disable=disable)))


@settings(max_examples=_examples(3))
@given(st.sampled_from(sorted(CONTEXTS)), programs())
def test_on_several_threads(name: str, program: Program) -> None:
    """The same program checked on three threads at once, each in its own context."""
    errors: list[BaseException] = []

    def check() -> None:
        try:
            check_program(program, CONTEXTS[name])
        except BaseException as error:  # reported on the main thread
            errors.append(error)

    threads = [threading.Thread(target=check) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@given(programs(writes=False), st.data())
def test_multi_grad_hook_removed_during_backward(program: Program, data: st.DataObject) -> None:
    """A multi-grad hook removed during backward by a tensor hook: same calls as torch's."""
    remover = data.draw(st.integers(0, program.n_leaves - 1), label="remover")
    calls = {graph.__name__: _calls_with_removal(graph, program, remover) for graph in GRAPHS}
    assume(calls["torch.autograd.graph"] is not None)
    assert calls["tensorhooks"] == calls["torch.autograd.graph"]


GRAPHS = (torch_graph, tensorhooks)


def _calls_with_removal(graph: Any, program: Program, remover: int) -> list[list[bool]] | None:
    """Run ``program`` with a multi-grad hook on its leaves that leaf ``remover`` removes.

    None when the run raised (torch's hook raises under ``autograd.grad`` with leaf inputs, a
    documented difference).
    """
    leaves = program.make_leaves()
    seen: list[list[bool]] = []
    handle: Any = None
    leaves[remover].register_hook(lambda grad: handle.remove())
    handle = graph.register_multi_grad_hook(
        leaves, lambda grads: seen.append([g is not None for g in grads])
    )
    try:
        program.run(leaves)
    except RuntimeError:
        return None
    finally:
        handle.remove()
    return seen


def _raw_buffer(tensor: torch.Tensor) -> tuple[torch.Size, torch.Tensor]:
    """Copy the tensor's memory in storage order, as a flat buffer (a raw byte dump would)."""
    copy = tensor.detach().clone()  # keeps a dense tensor's strides
    return tensor.shape, copy.as_strided((copy.numel(),), (1,))


class TestBrokenPairsFail:
    @pytest.mark.parametrize(
        "context",
        [
            pytest.param(
                lambda: tensorhooks.saved_tensors_hooks(lambda t: t, torch.zeros_like),
                id="unpack_returns_zeros",
            ),
            pytest.param(
                lambda: torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                id="torch_identity_without_guard",
            ),
            pytest.param(
                lambda: tensorhooks.saved_tensors_hooks(
                    _raw_buffer, lambda packed: packed[1].view(packed[0])
                ),
                id="loses_strides",
            ),
        ],
    )
    def test_checker_fails(self, context: Factory) -> None:
        """A broken pair makes the checker fail, with the program as Python in the message."""
        with pytest.raises(GradientMismatchError, match=r"def program\(leaves\):"):
            assert_context_preserves_gradients(context, max_examples=200)
