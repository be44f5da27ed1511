from __future__ import annotations

import collections
import contextlib
import gc
import re
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph
from hypothesis import given
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks
from tensorhooks._core import guards as _guards
from tensorhooks._core import torch_compat as _torch_compat
from tensorhooks._core.torch_compat import TORCH_VERSION
from tensorhooks._mutation import aliasing, dispatch_mode, foreign_hooks, op_writes
from tensorhooks._mutation.context_state import MutationContext
from tests.strategies import MutationProgram, Square, mutation_programs

Program = Callable[[torch.Tensor], torch.Tensor]


def grad_under(context: Callable[[], Any] | None, program: Program, leaf: torch.Tensor) -> Any:
    """The gradient of ``program(leaf)`` with forward and backward run inside ``context()``."""
    leaf = leaf.detach().clone().requires_grad_()
    with context() if context is not None else contextlib.nullcontext():
        program(leaf).backward()
    return leaf.grad


def leaf_4x6() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


# Programs that save a tensor, then change it in place, then return the loss. ``reference``
# computes the same function with the saving op reading a clone, so nothing it saved is changed.


def save_then_write_same_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b.sin_()
    return out


def save_then_write_out_same_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    with torch.no_grad():
        torch.mul(torch.ones_like(b), 3.0, out=b)
    return out


def save_then_foreach(a: torch.Tensor) -> torch.Tensor:
    b, c = a * 1, a * 2
    out = (b**2).sum() + c.sin().sum()
    torch._foreach_mul_([b, c], 2.0)
    return out


def saved_many_times(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b * b).sum() + (b**3).sum() + b.sin().sum()
    b.mul_(5.0)
    return out


def saved_at_several_versions(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b.mul_(2.0)
    out = out + (b**3).sum()
    b.add_(1.0)
    out = out + b.sin().sum()
    b.zero_()
    return out


def saved_output_written(a: torch.Tensor) -> torch.Tensor:
    b = torch.tanh(a)  # saves its output
    out = b.sum()
    b.mul_(3.0)
    return out


def transposed_view_at_same_address(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b.t() ** 2).sum()
    b.mul_(2.0)
    return out


def custom_function_saved(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = Square.apply(b).sum()
    b.add_(3.0)
    return out  # type: ignore[no-any-return]


TORCH_IS_RIGHT: dict[str, Program] = {
    "same_tensor": save_then_write_same_tensor,
    "out_same_tensor": save_then_write_out_same_tensor,
    "foreach": save_then_foreach,
    "saved_many_times": saved_many_times,
    "saved_at_several_versions": saved_at_several_versions,
    "saved_output": saved_output_written,
    "transposed_view_same_address": transposed_view_at_same_address,
    "custom_function": custom_function_saved,
}


def write_through_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b**2).sum()
    b[1:].mul_(2.0)
    return out


def save_view_write_base(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    b.mul_(2.0)
    return out


def strided_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[:, 1::2] ** 2).sum()
    b.t()[3].zero_()  # column 3, inside the saved strided view
    return out


def overlapping_slices(a: torch.Tensor) -> torch.Tensor:
    flat = (a * 1).view(-1)
    out = (flat[0:10] ** 2).sum()
    flat[8:16].mul_(-1.0)
    return out


def out_into_view(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    with torch.no_grad():
        torch.add(torch.zeros(2, 6, dtype=a.dtype), 1.0, out=b[2:])
    return out


def write_after_unrelated_write(a: torch.Tensor) -> torch.Tensor:
    # The first write bumps the version counter the saved view shares; torch then keys the
    # second write by the new version and misses the saved entry.
    b = a * 1
    out = (b[1:] ** 2).sum()
    b[0].zero_()
    b[1:].mul_(2.0)
    return out


def dtype_view_write(a: torch.Tensor) -> torch.Tensor:
    b = a * 1
    out = (b[1:] ** 2).sum()
    with torch.no_grad():
        b.view(torch.int64)[2].bitwise_xor_(1 << 51)
    return out


TORCH_IS_WRONG: dict[str, Program] = {
    "write_through_view": write_through_view,
    "save_view_write_base": save_view_write_base,
    "strided_view": strided_view,
    "overlapping_slices": overlapping_slices,
    "out_into_view": out_into_view,
    "write_after_unrelated_write": write_after_unrelated_write,
    "dtype_view": dtype_view_write,
}


def reference(program: Program) -> Program:
    """``program`` with every saved tensor cloned at save time, so no write can reach it."""

    def run(a: torch.Tensor) -> torch.Tensor:
        with torch_graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
            return program(a)

    return run


def program_id(name: str) -> str:
    return name


@pytest.fixture
def no_open_contexts() -> Iterator[None]:
    """Each test starts and ends with no open context."""
    assert dispatch_mode._open_contexts == ()
    yield
    assert dispatch_mode._open_contexts == ()


@pytest.mark.usefixtures("no_open_contexts")
class TestAllowMutationOnSavedTensors:
    # --- torch semantics, differential against torch where torch is right ---------------------

    @pytest.mark.parametrize("name", sorted(TORCH_IS_RIGHT))
    def test_same_gradients_as_torch_where_torch_is_right(self, name: str) -> None:
        """Writes to the saved tensor itself, out=, foreach, many saves, several versions."""
        program = TORCH_IS_RIGHT[name]
        expected = grad_under(None, reference(program), leaf_4x6())
        got_torch = grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())
        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
        torch.testing.assert_close(got_torch, expected)
        torch.testing.assert_close(got, expected)

    @pytest.mark.parametrize("name", sorted(TORCH_IS_RIGHT))
    def test_plain_autograd_raises_on_the_same_programs(self, name: str) -> None:
        """The programs really change saved tensors: without the context backward raises."""
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            grad_under(None, TORCH_IS_RIGHT[name], leaf_4x6())

    def test_double_backward_same_as_torch(self) -> None:
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

    def test_retain_graph_then_write_then_backward_again(self) -> None:
        """A second backward through a retained graph still reads the save-time values."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            b = a * 1
            out = (b**2).sum()
            out.backward(retain_graph=True)
            b.mul_(3.0)
            out.backward()
        torch.testing.assert_close(a.grad, 4 * leaf_4x6())

    def test_yields_a_context_that_is_cleared_on_exit(self) -> None:
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

    def test_backward_outside_the_context_raises(self) -> None:
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

    def test_backward_in_a_later_context_raises(self) -> None:
        """Only the context that recorded the graph can run its backward."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            out = ((a * 1) ** 2).sum()
        with (
            tensorhooks.allow_mutation_on_saved_tensors(),
            pytest.raises(RuntimeError, match="Run backward inside the same"),
        ):
            out.backward()

    def test_disabled_hooks_refuse_entry_like_torch(self) -> None:
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

    def test_state_is_restored_when_the_body_raises(self) -> None:
        """An exception in the body pops the hooks and the mode and closes the context."""
        with pytest.raises(KeyError), tensorhooks.allow_mutation_on_saved_tensors():
            raise KeyError("body")
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert torch._C._len_torch_dispatch_stack() == 0

    # --- aliases: where torch 2.13 is silently wrong --------------------------------------------

    @pytest.mark.parametrize("name", sorted(TORCH_IS_WRONG))
    def test_writes_through_any_alias_are_caught_where_torch_is_wrong(self, name: str) -> None:
        """Views, bases, strided and overlapping slices, out= into a view, dtype views."""
        program = TORCH_IS_WRONG[name]
        expected = grad_under(None, reference(program), leaf_4x6())
        got_torch = grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())
        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
        assert not torch.allclose(got_torch, expected), "torch got this one right"
        torch.testing.assert_close(got, expected)

    def test_disjoint_write_clones_nothing(self) -> None:
        """A write next to a saved slice, not over it, leaves the slice uncloned."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = a * 1
            out = (b[2:] ** 2).sum()
            b[:2].mul_(2.0)
            b[:, 0:0].zero_()
            assert ctx.num_cloned() == 0
            b[1:3].mul_(2.0)
            assert ctx.num_cloned() == 1
            out.backward()
        torch.testing.assert_close(a.grad[2:], 2 * leaf_4x6()[2:])

    def test_multi_output_out_variant(self) -> None:
        """out=(values, indices) writes are caught; torch fails with KeyError('out')."""

        def program(a: torch.Tensor) -> torch.Tensor:
            b = a * 1
            out = (b[0] ** 2).sum()
            with torch.no_grad():
                torch.max(torch.ones(4, 6, dtype=a.dtype), 0, out=(b[0], torch.empty(0).long()))
            return out

        expected = grad_under(None, reference(program), leaf_4x6())
        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
        torch.testing.assert_close(got, expected)
        with pytest.raises(KeyError, match="out"):
            grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf_4x6())

    def test_optimizer_step_between_forward_and_backward(self) -> None:
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
    def test_random_programs_match_a_reference_without_mutation(
        self, program: MutationProgram
    ) -> None:
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

    # --- hooks pushed inside the context --------------------------------------------------------

    @pytest.mark.parametrize(
        ("pack", "unpack", "tracked"),
        [
            pytest.param(lambda t: t, lambda t: t, True, id="identity"),
            pytest.param(lambda t: t.view(-1), lambda p: p, True, id="view"),
            pytest.param(lambda t: [t.detach(), 3], lambda p: p[0], True, id="list_alias"),
            pytest.param(lambda t: {"t": t}, lambda p: p["t"], True, id="unknown_object"),
            pytest.param(lambda t: t.detach().clone(), lambda p: p, False, id="copy"),
            pytest.param(
                lambda t: (t.to(torch.float32), t.dtype),
                lambda p: p[0].to(p[1]),
                False,
                id="cast",
            ),
        ],
    )
    def test_tensorhooks_hooks_inside_keep_the_protection(
        self,
        pack: Callable[[torch.Tensor], Any],
        unpack: Callable[[Any], torch.Tensor],
        tracked: bool,
    ) -> None:
        """saved_tensors_hooks pushed inside are guarded: aliases packed as-is are cloned."""
        calls = []

        def counting_unpack(packed: Any) -> torch.Tensor:
            calls.append(1)
            return unpack(packed)

        def program(a: torch.Tensor) -> torch.Tensor:
            b = a * 1
            with tensorhooks.saved_tensors_hooks(pack, counting_unpack):
                out = (b[1:] ** 2).sum()
            b.mul_(2.0)
            return out

        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
        expected = grad_under(None, lambda a: (a[1:] ** 2).sum(), leaf_4x6())
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        assert calls == ([] if tracked else [1])  # not run when the clone is handed back

    def test_copying_hooks_inside_track_nothing(self) -> None:
        """A pack that returns a real copy needs no protection: nothing is tracked or cloned."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            tracked: list[torch.Tensor] = []
            track = ctx._guard._track

            def counting_track(tensor: torch.Tensor, is_output: bool) -> Any:
                tracked.append(tensor)
                return track(tensor, is_output)

            ctx._guard._track = counting_track
            b = a * 1
            with tensorhooks.saved_tensors_hooks(lambda t: t.detach().clone(), lambda p: p):
                out = (b**2).sum()
            assert tracked == []  # not even a handle made and dropped
            assert ctx.num_saved() == 0
            b.mul_(2.0)
            assert ctx.num_cloned() == 0
            out.backward()
        torch.testing.assert_close(a.grad, 2 * leaf_4x6())

    def test_guarded_hooks_free_dropped_graphs(self) -> None:
        """Saved outputs packed as aliases by guarded user hooks do not keep their graph alive."""
        a = leaf_4x6().requires_grad_()
        with (
            tensorhooks.allow_mutation_on_saved_tensors() as ctx,
            tensorhooks.saved_tensors_hooks(lambda t: t.detach(), lambda p: p),
        ):
            b = torch.tanh(a * 1)  # saves its output
            b.mul_(2.0)
            watched = weakref.ref(b)
            del b
            assert watched() is None
            assert ctx.num_saved() == 0

    @pytest.mark.parametrize("pin_memory", [False, True])
    def test_save_on_cpu_inside_keeps_offloading_and_protection(self, pin_memory: bool) -> None:
        """save_on_cpu inside: host copies untracked (device memory freed), kept tensors cloned."""
        from tests.simdevice import simulated_device

        expected = 2 * leaf_4x6()
        with simulated_device() as sim:  # CPU tensors offloaded as device ones
            a = leaf_4x6().requires_grad_()
            with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
                b = a * 1
                with tensorhooks.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
                    out = (b**2).sum()
                assert ctx.num_saved() == 0
                b.mul_(2.0)
                out.backward()
            torch.testing.assert_close(a.grad, expected)
            assert sim.live_sources() == 0
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = a * 1
            with tensorhooks.save_on_cpu(pin_memory=pin_memory):
                out = (b**2).sum()  # a CPU tensor: save_on_cpu keeps it as it is
            assert ctx.num_saved() == 1
            b.mul_(2.0)
            assert ctx.num_cloned() == 1
            out.backward()
        torch.testing.assert_close(a.grad, expected)

    def test_torch_is_wrong_with_hooks_pushed_inside(self) -> None:
        """Case 7: torch's tracker is replaced by inner hooks and the gradient is wrong."""

        def program(hooks: Any) -> Program:
            def run(a: torch.Tensor) -> torch.Tensor:
                b = a * 1
                with hooks(lambda t: t, lambda t: t):
                    out = (b**2).sum()
                b.mul_(2.0)
                return out

            return run

        expected = 2 * leaf_4x6()
        got_torch = grad_under(
            torch_graph.allow_mutation_on_saved_tensors,
            program(torch_graph.saved_tensors_hooks),
            leaf_4x6(),
        )
        got = grad_under(
            tensorhooks.allow_mutation_on_saved_tensors,
            program(tensorhooks.saved_tensors_hooks),
            leaf_4x6(),
        )
        assert not torch.allclose(got_torch, expected)
        torch.testing.assert_close(got, expected)

    def test_guarded_unpack_after_exit_raises(self) -> None:
        """A graph saved through guarded user hooks cannot be used after the context exits."""
        a = leaf_4x6().requires_grad_()
        with (
            tensorhooks.allow_mutation_on_saved_tensors(),
            tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            out = ((a * 1) ** 2).sum()
        with pytest.raises(tensorhooks.MutationContextExitedError, match="has exited"):
            out.backward()

    def test_torch_hooks_inside_make_writes_raise(self) -> None:
        """What torch's hooks saved before the takeover: a write to it raises, not a wrong grad."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            b = a * 1
            with torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = (b**2).sum()
                with pytest.raises(
                    tensorhooks.UnguardedHooksError,
                    match=r"in-place operator aten\.mul_\.Tensor writes a tensor that "
                    r"saved-tensor hooks not pushed by tensorhooks \(pack hook '.*<lambda>'\)",
                ):
                    b.mul_(2.0)
            with torch_graph.save_on_cpu(), pytest.raises(RuntimeError, match="save_on_cpu"):
                b.add_(1.0)
            out.backward()
        torch.testing.assert_close(a.grad, 2 * leaf_4x6())

    def test_trust_comes_from_the_registry_not_the_code(self) -> None:
        """A pack hook is trusted once registered; a copy of a trusted one's code is not."""
        guarded_pack, _ = _guards.VersionGuard().wrap(lambda t: t, lambda t: t)
        assert _guards.is_protected_pack_hook(guarded_pack)
        same_code = types.FunctionType(
            guarded_pack.__code__,
            guarded_pack.__globals__,  # type: ignore[attr-defined]
            "pack",
            None,
            guarded_pack.__closure__,  # type: ignore[attr-defined]
        )
        assert not _guards.is_protected_pack_hook(same_code)

        def stores_nothing(tensor: torch.Tensor) -> None:
            return None

        _guards.register_protected_pack_hook(stores_nothing)
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            b = a * 1
            with torch_graph.saved_tensors_hooks(stores_nothing, lambda p: p):
                b.mul_(2.0)  # trusted: no raise
            with torch_graph.saved_tensors_hooks(same_code, lambda p: p):
                _ = b * b  # saved by the copy before the context sees it
                with pytest.raises(
                    tensorhooks.UnguardedHooksError, match=r"pack hook 'VersionGuard\.wrap\."
                ):
                    b.mul_(2.0)
        torch.testing.assert_close(b.detach(), 2 * leaf_4x6())  # the refused write never ran

    def test_registry_keeps_no_hook_alive(self) -> None:
        """A registered pack hook that is dropped leaves the registry."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.clone()

        gc.collect()
        before = len(_guards._protected_pack_hooks)
        _guards.register_protected_pack_hook(pack)
        assert len(_guards._protected_pack_hooks) == before + 1
        del pack
        assert len(_guards._protected_pack_hooks) == before

    def test_without_the_innermost_hooks_reader_it_warns_once(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Before torch 2.8 the UnguardedHooksError check is off, and entering says so once."""
        monkeypatch.setattr(foreign_hooks, "top_saved_tensors_hooks", None)
        monkeypatch.setattr(_torch_compat, "_warned", set())
        a = leaf_4x6().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with tensorhooks.allow_mutation_on_saved_tensors():
                    b = a * 1
                    with torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                        b.mul_(2.0)  # not caught on such a torch
        assert [warning.category for warning in caught] == [RuntimeWarning]
        assert re.search(
            r"UnguardedHooksError protection is off.*torch 2\.8", str(caught[0].message)
        )

    def test_checkpoint_inside_is_allowed(self) -> None:
        """torch.utils.checkpoint (non-reentrant) stores no tensor data: writes are fine."""

        def block(x: torch.Tensor) -> torch.Tensor:
            y = x.sin()
            y.mul_(2.0)  # in-place inside the checkpointed region, also during recomputation
            return y.cos()

        def program(a: torch.Tensor) -> torch.Tensor:
            b = a * 1
            out = torch.utils.checkpoint.checkpoint(block, b, use_reentrant=False).sum()
            b.mul_(3.0)  # the checkpoint's saved input, changed before backward
            return out  # type: ignore[no-any-return]

        expected = grad_under(None, lambda a: block(a * 1).sum(), leaf_4x6())
        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
        torch.testing.assert_close(got, expected)

    @pytest.mark.parametrize(
        "device",
        [
            "cpu",
            pytest.param(
                "cuda",
                marks=[
                    pytest.mark.cuda,
                    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
                ],
            ),
        ],
    )
    def test_write_during_backward(self, device: str) -> None:
        """A hook that writes a saved tensor during backward (CUDA: on a device thread)."""
        a = leaf_4x6().to(device).requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            b = a * 1
            squared = b**2  # PowBackward saves b; it runs after the hook below

            def write(grad: torch.Tensor) -> None:
                b.mul_(3.0)

            squared.register_hook(write)
            squared.sum().backward()
        torch.testing.assert_close(a.grad, 2 * leaf_4x6().to(device))

    # --- nesting and threads ------------------------------------------------------------------

    def test_nesting_is_harmless(self) -> None:
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

    def test_nested_contexts_share_one_dispatch_mode(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A nested context pushes no second mode: a write protects each context once."""
        protected: list[MutationContext] = []
        protect = MutationContext._protect

        def counting(self: MutationContext, *args: Any) -> None:
            protected.append(self)
            protect(self, *args)

        monkeypatch.setattr(MutationContext, "_protect", counting)
        stack_len = torch._C._len_torch_dispatch_stack
        with tensorhooks.allow_mutation_on_saved_tensors() as outer:
            assert stack_len() == 1
            with tensorhooks.allow_mutation_on_saved_tensors() as inner:
                assert stack_len() == 1
                torch.ones(3).mul_(2.0)
                assert protected == [outer, inner]
                with TorchDispatchMode(), tensorhooks.allow_mutation_on_saved_tensors():
                    assert stack_len() == 3  # under another mode: its own, on top
                assert stack_len() == 1
            assert stack_len() == 1
        assert stack_len() == 0

    def test_inner_graph_after_inner_exit_raises(self) -> None:
        """A graph recorded in the inner context needs its backward before the inner exits."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            with tensorhooks.allow_mutation_on_saved_tensors():
                out = ((a * 1) ** 2).sum()
            with pytest.raises(tensorhooks.MutationContextExitedError, match="has exited"):
                out.backward()

    def test_threads_each_in_their_own_context(self) -> None:
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

    def test_torch_fails_with_two_threads(self) -> None:
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

    def test_dispatch_mode_and_hooks_are_per_thread(self) -> None:
        """Entering on one thread pushes nothing on another."""
        seen: list[object] = []

        def look() -> None:
            seen.append(torch._C._len_torch_dispatch_stack())
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))

        with tensorhooks.allow_mutation_on_saved_tensors():
            assert torch._C._len_torch_dispatch_stack() == 1
            thread = threading.Thread(target=look)
            thread.start()
            thread.join()
        assert seen == [0, None]

    def test_write_on_another_thread_protects_this_threads_saves(self) -> None:
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

    # --- tensors without real storage -----------------------------------------------------------

    def test_fake_tensors_do_not_crash(self) -> None:
        """FakeTensorMode: saves, writes through a view and backward run through."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            a = torch.randn(4, 6, requires_grad=True)
            with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
                b = a * 1
                out = (b[1:] ** 2).sum()
                b.mul_(2.0)
                assert ctx.num_cloned() == 1
                out.backward()
            assert a.grad is not None
            assert a.grad.shape == (4, 6)

    def test_functional_tensors_do_not_crash(self) -> None:
        """FunctionalTensorMode inside or outside the context."""
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        with FunctionalTensorMode(), tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.randn(4, 6, requires_grad=True)
            b = a * 1
            out = (b[1:] ** 2).sum()
            b.mul_(2.0)
            assert ctx.num_cloned() == 1
            out.backward()
            expected = torch.cat([torch.zeros(1, 6), 2 * a[1:].detach()])
            assert a.grad is not None
            assert torch.equal(a.grad, expected)  # the save-time values, not the doubled ones
        with tensorhooks.allow_mutation_on_saved_tensors(), FunctionalTensorMode():
            c = torch.randn(3)
            before = c.clone()
            c.add_(1.0)
            assert torch.equal(c, before + 1.0)

    def test_sparse_tensors_without_storage(self) -> None:
        """A saved sparse tensor changed in place is cloned (storage-less: always)."""
        dense = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        sparse = torch.eye(3, dtype=torch.float64).to_sparse()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            out = torch.sparse.mm(sparse, dense).sum()
            sparse.mul_(5.0)
            assert ctx.num_cloned() == 1
            out.backward()
        torch.testing.assert_close(dense.grad, torch.ones(3, 4, dtype=torch.float64))

    # --- memory ---------------------------------------------------------------------------------

    def test_clones_only_saved_and_written_tensors(self) -> None:
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

    @pytest.mark.parametrize(
        ("complex_leaf", "view"),
        [
            pytest.param(True, torch.conj, id="conj"),
            pytest.param(False, torch._neg_view, id="neg"),
        ],
    )
    def test_conj_and_neg_views_get_their_own_clone(
        self, complex_leaf: bool, view: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """A tensor and its conj or neg view, saved and then written, do not share one clone."""

        def program(a: torch.Tensor) -> torch.Tensor:
            b = a * 1
            product = b * view(b)  # saves b and its view: same elements, other values
            b.mul_(10.0)
            return (torch.view_as_real(product) if complex_leaf else product).sum()

        leaf = torch.complex(leaf_4x6(), leaf_4x6().flip(0)) if complex_leaf else leaf_4x6()
        expected = grad_under(None, reference(program), leaf)
        got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf)
        torch.testing.assert_close(got, expected)
        assert torch.allclose(
            grad_under(torch_graph.allow_mutation_on_saved_tensors, program, leaf), expected
        )

    def test_dropped_graph_frees_everything(self) -> None:
        """A graph dropped without backward frees saved outputs and clones (no cycles)."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = torch.tanh(a * 1)  # saves its output
            out = b.exp().sum()  # saves its output too
            b.mul_(2.0)
            watched = weakref.ref(b)
            del b, out
            assert watched() is None
            assert ctx.num_saved() == 0

    def test_state_cleared_releases_saved_tensors(self) -> None:
        """Exiting releases what a live graph saved; its storage is freed."""
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = a * 1
            out = (b**2).sum()
            b.mul_(2.0)
            (clone,) = [weakref.ref(saved.tensor) for saved in _live_handles(ctx)]
        assert clone() is None
        del out

    # --- the dispatch mode ----------------------------------------------------------------------

    def test_written_arguments_read_from_the_schema(self) -> None:
        """In-place self, out= (resizable), foreach lists, multi-output out, resize_."""
        aten = torch.ops.aten
        written = op_writes.written_arguments
        assert written(aten.add.Tensor) == ()
        assert written(aten.add_.Tensor) == ((0, "self", False),)
        assert written(aten.add.out) == ((-1, "out", True),)
        assert written(aten._foreach_mul_.Scalar) == ((0, "self", False),)
        assert written(aten.max.dim_max) == ((-1, "max", True), (-1, "max_values", True))
        assert written(aten.resize_.default) == ((0, "self", True),)
        # Its schema says it writes self; it only tells the allocator which stream uses it.
        assert written(aten.record_stream.default) == ()

    def test_read_only_ops_take_the_fast_path(self) -> None:
        """After its first call an op that writes nothing is a single dict lookup."""
        with tensorhooks.allow_mutation_on_saved_tensors():
            torch.randn(3).cos().mul_(2.0)
        assert op_writes.READ_ONLY_OPS[id(torch.ops.aten.cos.default)] is (
            torch.ops.aten.cos.default._op
        )
        assert id(torch.ops.aten.mul_.Tensor) not in op_writes.READ_ONLY_OPS
        writing = op_writes.WRITING_OPS[id(torch.ops.aten.mul_.Tensor)]
        assert writing.written == ((0, "self", False),)

    @pytest.mark.parametrize(
        ("make", "resizes", "span"),
        [
            (lambda x: x, False, (0, 192)),
            (lambda x: x[1:3], False, (48, 144)),
            (lambda x: x[:, 2], False, (16, 168)),
            (lambda x: x.t()[1:], False, (8, 192)),
            (lambda x: x[:, 0:0], False, None),
            (lambda x: x[:, 0:0], True, (0, float("inf"))),
            (lambda x: x[2:], True, (96, float("inf"))),
            (lambda x: x.view(torch.int32)[1], False, (48, 96)),
        ],
    )
    def test_byte_spans(
        self, make: Callable[[torch.Tensor], torch.Tensor], resizes: bool, span: Any
    ) -> None:
        """Spans cover exactly the bytes an alias can reach (4 x 6 float64 storage)."""
        assert aliasing.byte_span(make(leaf_4x6()), resizes) == span

    def test_handler_is_not_wrapped_by_dynamo_disable(self) -> None:
        """From torch 2.7 Dynamo skips the handler's code, so the mode calls the plain function."""
        handler = dispatch_mode._CloneBeforeWriteMode.__dict__["__torch_dispatch__"]
        if TORCH_VERSION < (2, 7):  # no per-code skip (skip_code_in_dynamo): torch's wrapper stays
            assert handler is not dispatch_mode._torch_dispatch
            return
        assert dispatch_mode._HANDLER_SKIPPED_BY_DYNAMO, (
            "Dynamo could not be told to skip the handler"
        )
        assert handler is dispatch_mode._torch_dispatch

    # The warning that Dynamo compiles nothing here is warned once per process and pinned in
    # tests/core/test_compile.py; which test meets it first depends on the order.
    @pytest.mark.filterwarnings("ignore:torch.compile compiles nothing")
    def test_compiled_function_inside_the_context(self) -> None:
        """torch.compile'd code called inside the context runs (eagerly) with the protection."""

        def f(x: torch.Tensor) -> torch.Tensor:
            return (x**2).sum()

        compiled = torch.compile(f, backend="eager")
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors():
            b = a * 1
            out = compiled(b)
            b.mul_(2.0)
            out.backward()
        torch.testing.assert_close(a.grad, 2 * leaf_4x6())


def _live_handles(ctx: MutationContext) -> list[Any]:
    return [saved for saved in (ref() for ref in ctx._refs()) if saved is not None]


class _CopyRecord:
    """A pack record that keeps a copy of the saved tensor in an attribute."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.copy = tensor.clone()


@pytest.mark.parametrize(
    ("pack", "unpack"),
    [
        (_CopyRecord, lambda record: record.copy),
        (lambda t: {"copy": t.clone()}, lambda record: record["copy"]),
        (lambda t: collections.deque([t.clone()]), lambda record: record[0]),
    ],
    ids=["object", "dict", "deque"],
)
def test_pack_returning_a_record_of_a_copy_keeps_nothing_alive(pack: Any, unpack: Any) -> None:
    """A user pack returning an object or dict holding a copy frees the saved tensor."""
    x = torch.randn(8, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors() as context:
        with tensorhooks.saved_tensors_hooks(pack, unpack):
            h = x * 2
            alive = weakref.ref(h)
            y = h.sin()
            del h
        gc.collect()
        assert alive() is None
        assert context.num_saved() == 0
        y.sum().backward()
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pack", "unpack"),
    [
        (lambda t: lambda: t, lambda p: p()),
        (lambda t: [[t], *[[] for _ in range(300)]], lambda p: p[0][0]),
    ],
    ids=["closure", "over_budget"],
)
def test_pack_hiding_the_tensor_from_the_walk_still_gets_the_save_time_value(
    pack: Any, unpack: Any
) -> None:
    """A pack whose alias the walk cannot rule out is tracked: a write does not reach backward."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        with tensorhooks.saved_tensors_hooks(pack, unpack):
            b = x * 1
            y = (b * b).sum()
        b.mul_(10)
        y.backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0, 6.0]))  # type: ignore[arg-type]
