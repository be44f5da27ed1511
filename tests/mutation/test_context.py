"""allow_mutation_on_saved_tensors, the context manager: torch's semantics, nesting and threads."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph
from hypothesis import given

import tensorhooks
from tensorhooks._mutation import dispatch_mode
from tests.mutation.programs import (
    TORCH_IS_RIGHT,
    TORCH_IS_WRONG,
    Program,
    grad_under,
    leaf_4x6,
    reference,
)
from tests.strategies import MutationProgram, mutation_programs

pytestmark = pytest.mark.usefixtures("no_open_contexts")

# --- torch semantics, differential against torch where torch is right ---------------------------


@pytest.mark.parametrize("name", sorted(TORCH_IS_RIGHT))
def test_same_gradients_as_torch_where_torch_is_right(name: str) -> None:
    """Writes to the saved tensor itself, out=, foreach, many saves, several versions."""
    program = TORCH_IS_RIGHT[name]
    expected = grad_under(None, reference(program), leaf_4x6())
    got_torch = grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())
    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
    torch.testing.assert_close(got_torch, expected)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", sorted(TORCH_IS_RIGHT))
def test_plain_autograd_raises_on_the_same_programs(name: str) -> None:
    """The programs really change saved tensors: without the context backward raises."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad_under(None, TORCH_IS_RIGHT[name], leaf_4x6())


def test_double_backward_same_as_torch() -> None:
    """Tensors saved by a create_graph backward are protected too."""

    def run(context: Callable[[], Any] | None) -> torch.Tensor:
        a = leaf_4x6().requires_grad_()
        with context() if context is not None else contextlib.nullcontext():
            b = a * 1
            (g,) = torch.autograd.grad((b**3).sum(), a, create_graph=True)
            if context is None:  # the reference: the same values, nothing changed in place
                b = b * 2.0
                g2 = g * b
            else:
                b.mul_(2.0)
                g2 = g * b  # saves g and b again, at their new versions
                b.add_(1.0)
            g2.sum().backward()
        return a.grad  # type: ignore[return-value]

    expected = run(None)
    torch.testing.assert_close(run(torch_graph.allow_mutation_on_saved_tensors), expected)
    torch.testing.assert_close(run(tensorhooks.allow_mutation_on_saved_tensors), expected)


def test_retain_graph_then_write_then_backward_again() -> None:
    """A second backward through a retained graph still reads the save-time values."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        out = (b**2).sum()
        out.backward(retain_graph=True)
        b.mul_(3.0)
        out.backward()
    torch.testing.assert_close(a.grad, 4 * leaf_4x6())


def test_backward_outside_the_context_raises() -> None:
    """A RuntimeError subclass (torch raises AssertionError)."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = ((a * 1) ** 2).sum()
    with pytest.raises(tensorhooks.MutationContextExitedError, match="context has exited"):
        out.backward()
    with torch_graph.allow_mutation_on_saved_tensors():
        out = ((a * 1) ** 2).sum()
    with pytest.raises(AssertionError, match="outside of the 'allow_mutation"):
        out.backward()


def test_backward_in_a_later_context_raises() -> None:
    """Only the context that recorded the graph can run its backward."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = ((a * 1) ** 2).sum()
    with (
        tensorhooks.allow_mutation_on_saved_tensors(),
        pytest.raises(RuntimeError, match="Run backward inside the same"),
    ):
        out.backward()


def test_disabled_hooks_refuse_entry_like_torch() -> None:
    """Entering under disable_saved_tensors_hooks raises its message, as torch's does."""
    for allow in (
        tensorhooks.allow_mutation_on_saved_tensors,
        torch_graph.allow_mutation_on_saved_tensors,
    ):
        with (
            tensorhooks.disable_saved_tensors_hooks("no hooks here"),
            pytest.raises(RuntimeError, match="no hooks here"),
            allow(),
        ):
            pass
    assert dispatch_mode._open_contexts == ()


def test_state_is_restored_when_the_body_raises() -> None:
    """An exception in the body pops the hooks and the mode and closes the context."""
    with pytest.raises(KeyError), tensorhooks.allow_mutation_on_saved_tensors():
        raise KeyError("body")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_optimizer_step_between_forward_and_backward() -> None:
    """Parameters updated in place (foreach SGD) before backward give the old gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)
    for p, g in zip(model.parameters(), expected, strict=True):
        p.grad = g.clone()
    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = model(x).sum()
        opt.step()
        got = torch.autograd.grad(loss, list(model.parameters()))
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want)


@given(mutation_programs())
def test_random_programs_match_a_reference_without_mutation(program: MutationProgram) -> None:
    """Random saves and writes through random aliases: gradients equal the reference's."""
    expected_leaf = program.leaf()
    loss, _ = program.run(expected_leaf, isolated=True)
    loss.backward()
    leaf = program.leaf()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        loss, tensors = program.run(leaf, isolated=False)
        loss.backward()
        del loss, tensors
        assert ctx.num_saved() == 0  # nothing outlives the graph (no reference cycles)
    torch.testing.assert_close(leaf.grad, expected_leaf.grad, equal_nan=True)


# --- nesting and threads ------------------------------------------------------------------------


def test_nesting_is_harmless() -> None:
    """Inner and outer contexts each protect what they saved; torch refuses to nest."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as outer:
        b = a * 1
        out_outer = (b[1:] ** 2).sum()
        with tensorhooks.allow_mutation_on_saved_tensors() as inner:
            out_inner = (b[:2] ** 3).sum()
            b.mul_(2.0)  # written inside the inner context: both saves are cloned
            assert (outer.num_cloned(), inner.num_cloned()) == (1, 1)
            out_inner.backward(retain_graph=True)
            out_outer.backward()
    expected = leaf_4x6().requires_grad_()
    ((expected[1:] ** 2).sum() + (expected[:2] ** 3).sum()).backward()
    torch.testing.assert_close(a.grad, expected.grad)
    with (
        torch_graph.allow_mutation_on_saved_tensors(),
        pytest.raises(RuntimeError, match="cannot be nested"),
        torch_graph.allow_mutation_on_saved_tensors(),
    ):
        pass


def test_inner_graph_after_inner_exit_raises() -> None:
    """A graph recorded in the inner context needs its backward before the inner exits."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        with tensorhooks.allow_mutation_on_saved_tensors():
            out = ((a * 1) ** 2).sum()
        with pytest.raises(tensorhooks.MutationContextExitedError, match="has exited"):
            out.backward()


def test_threads_each_in_their_own_context() -> None:
    """Several threads run forward, writes and backward in their own contexts at once."""
    programs = sorted({**TORCH_IS_RIGHT, **TORCH_IS_WRONG}.items())
    expected = {name: grad_under(None, reference(p), leaf_4x6()) for name, p in programs}
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(programs))

    def worker(name: str, program: Program) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                got[name] = grad_under(
                    tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6()
                )
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=item) for item in programs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for name, _ in programs:
        torch.testing.assert_close(got[name], expected[name])


def test_torch_fails_with_two_threads() -> None:
    """Case 10: torch's global flag makes a second thread's context raise."""
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        with torch_graph.allow_mutation_on_saved_tensors():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    entered.wait(10)
    try:
        with torch_graph.allow_mutation_on_saved_tensors():
            pass
    except RuntimeError as error:
        errors.append(error)
    finally:
        release.set()
        thread.join()
    assert len(errors) == 1
    assert "cannot be nested" in str(errors[0])


def test_write_on_another_thread_protects_this_threads_saves() -> None:
    """A write made under another thread's context clones tensors saved here."""
    a = leaf_4x6().requires_grad_()
    shared = (a * 1).detach()  # shared buffer, written by the other thread
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        out = ((a * shared) ** 2).sum()  # saves a and shared

        def write() -> None:
            with tensorhooks.allow_mutation_on_saved_tensors():
                shared[1:].mul_(10.0)

        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        assert ctx.num_cloned() == 1
        out.backward()
    x = leaf_4x6()
    torch.testing.assert_close(a.grad, 2 * (x * x) * x)
