from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph
from hypothesis import given
from hypothesis import strategies as st

import tensorhooks
from tests.strategies import Program, Square, assert_same_grads, programs

PACKS: dict[str, Callable[[torch.Tensor], Any]] = {
    "as_is": lambda t: t,
    "detach": lambda t: t.detach(),
    "tuple": lambda t: (t.device, t.detach()),
    "clone": lambda t: t.detach().clone(),
    "copy": lambda t: t.detach().to(torch.float64, copy=True),
}
UNPACKS: dict[str, Callable[[Any], torch.Tensor]] = {
    "as_is": lambda p: p,
    "detach": lambda p: p,
    "tuple": lambda p: p[1],
    "clone": lambda p: p,
    "copy": lambda p: p,
}


class Holder:
    """An object that keeps the saved tensor in an attribute."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SlottedHolder:
    """An object that keeps the saved tensor in a slot."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# Packs that return the saved tensor (or a view of it) inside a container or an object.
CONTAINER_PACKS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "dict": (lambda t: {"t": t}, lambda p: p["t"]),
    "nested_tuple": (lambda t: ((t,),), lambda p: p[0][0]),
    "nested_list": (lambda t: [[t]], lambda p: p[0][0]),
    "tuple_of_dict": (lambda t: (t.device, {"data": t.detach()}), lambda p: p[1]["data"]),
    "object": (Holder, lambda p: p.tensor),
    "slots": (SlottedHolder, lambda p: p.tensor),
    "view_in_dict": (lambda t: {"a": [t.view(-1)]}, lambda p: p["a"][0].view(p["a"][0].shape)),
    "numpy": (lambda t: t.detach().numpy(), torch.from_numpy),
    "deque": (lambda t: collections.deque([t]), lambda p: p[0]),
    "closure": (lambda t: lambda: t, lambda p: p()),
    # a class made inside pack, holding the tensor on the class rather than on the instance
    "class_attribute": (lambda t: type("Box", (), {"t": t})(), lambda p: type(p).t),
    "class_itself": (lambda t: type("Box", (), {"t": t}), lambda p: p.t),
    "memoryview": (
        lambda t: memoryview(t.detach().numpy()),
        lambda p: torch.frombuffer(p, dtype=torch.float32),
    ),
    "untyped_storage": (
        lambda t: (t.untyped_storage(), t.shape),
        lambda p: torch.empty(0).set_(p[0]).view(p[1]),
    ),
    # past the walk's visit budget: what was not looked at is assumed to alias
    "over_budget": (lambda t: [[t], *[[] for _ in range(300)]], lambda p: p[0][0]),
}


def leaf_grads(program: Program, hooks: Any = None) -> list[torch.Tensor | None]:
    """Leaf gradients of ``program``, recorded under ``hooks`` (a context manager) if given."""
    leaves = program.leaves()
    if hooks is None:
        values = program.run(leaves)
    else:
        with hooks:
            values = program.run(leaves)
    program.loss(values).backward()
    return [leaf.grad for leaf in leaves]


class Recorder:
    """Pack/unpack hooks that log what they see and return a detached alias."""

    def __init__(self) -> None:
        self.packed: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.unpacked = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed.append((tuple(tensor.shape), tensor.dtype))
        return tensor.detach()

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return tensor


class TestSavedTensorsHooks:
    @given(program=programs(), pack=st.sampled_from(sorted(PACKS)))
    def test_identity_hooks_leave_gradients_unchanged(self, program: Program, pack: str) -> None:
        """Hooks that hand back the saved value give exactly plain autograd's gradients."""
        expected = leaf_grads(program)
        got = leaf_grads(program, tensorhooks.saved_tensors_hooks(PACKS[pack], UNPACKS[pack]))
        if pack in ("clone", "copy"):
            # A copy of a non-dense view (an expand) is contiguous, so backward kernels may sum
            # in another order: equal up to rounding, not bitwise.
            assert [g is None for g in expected] == [g is None for g in got]
            for want, have in zip(expected, got, strict=True):
                if want is not None:
                    assert torch.allclose(want, have, rtol=1e-12, atol=1e-12)
        else:
            assert_same_grads(expected, got)

    @given(program=programs())
    def test_same_hook_calls_as_torch(self, program: Program) -> None:
        """Pack and unpack run for the same tensors, in the same order, as under torch's hooks."""
        ours, theirs = Recorder(), Recorder()
        ours_grads = leaf_grads(program, tensorhooks.saved_tensors_hooks(ours.pack, ours.unpack))
        theirs_grads = leaf_grads(
            program, torch_graph.saved_tensors_hooks(theirs.pack, theirs.unpack)
        )
        assert ours.packed == theirs.packed
        assert ours.unpacked == theirs.unpacked
        assert_same_grads(theirs_grads, ours_grads)

    def test_is_an_instance_of_torchs_class(self) -> None:
        """isinstance(ctx, torch.autograd.graph.saved_tensors_hooks) is True, with torch's hooks."""
        pack, unpack = PACKS["detach"], UNPACKS["detach"]
        hooks = tensorhooks.saved_tensors_hooks(pack, unpack)
        assert isinstance(hooks, torch_graph.saved_tensors_hooks)
        assert (hooks.pack_hook, hooks.unpack_hook) == (pack, unpack)

    def test_innermost_pair_wins(self) -> None:
        """Only the innermost of nested pairs sees the saved tensors, as in torch."""
        outer, inner = Recorder(), Recorder()
        x = torch.ones(3, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(outer.pack, outer.unpack):
            with tensorhooks.saved_tensors_hooks(inner.pack, inner.unpack):
                y = x * x
            z = y.exp()
        z.sum().backward()
        assert inner.packed == [((3,), torch.float32)] * 2
        assert outer.packed == [((3,), torch.float32)]
        assert (inner.unpacked, outer.unpacked) == (2, 1)

    def test_custom_function_saved_tensors_go_through_hooks(self) -> None:
        """Tensors saved with save_for_backward are packed and unpacked by the hooks."""
        recorder = Recorder()
        x = torch.ones(2, 3, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(recorder.pack, recorder.unpack):
            y = Square.apply(x)  # type: ignore[no-untyped-call]
        y.sum().backward()
        assert recorder.packed == [((2, 3), torch.float32)]
        assert recorder.unpacked == 1
        assert torch.equal(x.grad, torch.full((2, 3), 2.0))  # type: ignore[arg-type]

    def test_subclass_defines_hooks_as_methods(self) -> None:
        """A subclass passing its own methods works like torch's save_on_cpu does."""

        class CountingHooks(tensorhooks.saved_tensors_hooks):
            def __init__(self) -> None:
                self.count = 0
                super().__init__(self.pack, self.unpack)

            def pack(self, tensor: torch.Tensor) -> torch.Tensor:
                self.count += 1
                return tensor.clone()

            def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
                return tensor

        hooks = CountingHooks()
        x = torch.ones(3, requires_grad=True)
        with hooks:
            (x * x).sum().backward()
        assert hooks.count == 2
        assert torch.equal(x.grad, torch.full((3,), 2.0))  # type: ignore[arg-type]

    def test_same_instance_reentered(self) -> None:
        """One instance can be entered nested and again after exit."""
        recorder = Recorder()
        hooks = tensorhooks.saved_tensors_hooks(recorder.pack, recorder.unpack)
        x = torch.ones(3, requires_grad=True)
        with hooks:
            with hooks:
                y = x * x
            w = y.cos()  # the inner exit left the outer entry in force
        assert len(recorder.packed) == 3
        with hooks:
            z = w.sin()
        assert len(recorder.packed) == 4
        (z.sum()).backward()
        assert recorder.unpacked == 4
        expected = -torch.sin(torch.ones(3)) * torch.cos(torch.cos(torch.ones(3))) * 2
        torch.testing.assert_close(x.grad, expected)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None

    def test_double_backward(self) -> None:
        """Gradients of gradients match plain autograd; hooks apply to saved tensors of both."""
        recorder = Recorder()

        def second_derivative(hooks: Any) -> torch.Tensor:
            x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
            with hooks:
                y = (x.sin() * x).sum()
                (g,) = torch.autograd.grad(y, x, create_graph=True)
                (g * g).sum().backward()
            assert x.grad is not None
            return x.grad

        expected = second_derivative(torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        got = second_derivative(tensorhooks.saved_tensors_hooks(recorder.pack, recorder.unpack))
        assert torch.allclose(expected, got)
        assert recorder.unpacked > 2

    def test_hooks_are_per_thread(self) -> None:
        """Hooks entered on one thread do not apply to forward passes on another."""
        recorder = Recorder()
        started, release = threading.Event(), threading.Event()

        def other_thread() -> None:
            started.wait()
            x = torch.ones(3, requires_grad=True)
            (x * x).sum().backward()
            release.set()

        thread = threading.Thread(target=other_thread)
        thread.start()
        with tensorhooks.saved_tensors_hooks(recorder.pack, recorder.unpack):
            started.set()
            release.wait()
        thread.join()
        assert recorder.packed == []

    @pytest.mark.parametrize("pack", ["as_is", "detach", "tuple"])
    @pytest.mark.parametrize("write", ["whole", "through_view", "leaf_like_input"])
    def test_inplace_change_of_tensor_packed_as_is_raises(self, pack: str, write: str) -> None:
        """A tensor that pack kept as-is and that changes before backward raises, never lies."""
        x = torch.linspace(0.5, 2, 4, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(PACKS[pack], UNPACKS[pack]):
            y = x * 2
            z = y * y  # saves y twice
        if write == "whole":
            y.mul_(2)
        elif write == "through_view":
            y[1:].add_(1)
        else:
            y.detach().zero_()  # detach shares the version counter, as in plain autograd
        with pytest.raises(
            tensorhooks.SavedTensorModifiedError,
            match=r"modified by an inplace operation: \[torch.FloatTensor \[4\]\] is at version "
            r"1; expected version 0 instead\. Hint: the pack hook returned a tensor that shares",
        ):
            z.sum().backward()

    @pytest.mark.parametrize("pack", sorted(CONTAINER_PACKS))
    def test_inplace_change_of_tensor_packed_inside_a_container_raises(self, pack: str) -> None:
        """The saved tensor anywhere inside what pack returned is caught, like a flat tuple."""
        if pack in ("numpy", "memoryview"):
            pytest.importorskip("numpy")
        x = torch.linspace(0.5, 2, 4, requires_grad=True)
        pack_hook, unpack_hook = CONTAINER_PACKS[pack]
        with tensorhooks.saved_tensors_hooks(pack_hook, unpack_hook):
            y = x * 2
            z = y * y
        with torch.no_grad():
            y.mul_(2)
        with pytest.raises(tensorhooks.SavedTensorModifiedError, match="is at version 1"):
            z.sum().backward()

    @pytest.mark.parametrize("pack", sorted(CONTAINER_PACKS))
    def test_container_packs_unchanged_give_plain_gradients(self, pack: str) -> None:
        """With no in-place change, container packs give plain autograd's gradient."""
        if pack in ("numpy", "memoryview"):
            pytest.importorskip("numpy")
        x = torch.linspace(0.5, 2, 4, requires_grad=True)
        pack_hook, unpack_hook = CONTAINER_PACKS[pack]
        with tensorhooks.saved_tensors_hooks(pack_hook, unpack_hook):
            z = (x * 2).sin()
        z.sum().backward()
        assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())  # type: ignore[arg-type]

    @pytest.mark.parametrize("moved", ["key", "nested_copy"])
    def test_a_pack_that_drops_the_tensor_keeps_nothing_alive(self, moved: str) -> None:
        """A pack that moves the data out (a key, copies in containers) frees the saved tensor."""
        shelf: dict[str, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> object:
            if moved == "key":
                shelf[str(len(shelf))] = t.detach().clone()
                return str(len(shelf) - 1)
            return {"copies": [(t.detach().clone(),)], "device": t.device}

        def unpack(packed: Any) -> torch.Tensor:
            return shelf[packed] if moved == "key" else packed["copies"][0][0]

        x = torch.linspace(0.5, 2, 4, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(pack, unpack):
            y = x * 2
            z = y.sin()
        alive = weakref.ref(y)
        del y
        assert alive() is None
        z.sum().backward()
        assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())  # type: ignore[arg-type]

    def test_inplace_error_matches_plain_autograd_and_torch_hooks_are_silently_wrong(
        self,
    ) -> None:
        """The case tensorhooks fixes: torch's identity hooks hand changed data to backward."""

        def gradient(hooks: Any) -> torch.Tensor:
            x = torch.linspace(0.5, 2, 4, requires_grad=True)
            with hooks:
                y = x * 2
                z = y * y
            y.mul_(2)
            z.sum().backward()
            assert x.grad is not None
            return x.grad

        # d/dx (2x)^2 = 8x; torch's identity hooks read y after the change and give 16x.
        wrong = gradient(torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        assert torch.allclose(wrong, 16 * torch.linspace(0.5, 2, 4))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gradient(contextlib.nullcontext())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gradient(tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t))

    def test_inplace_change_after_a_copying_pack_is_fine(self) -> None:
        """When pack made a copy, the save-time value is used and nothing raises."""
        x = torch.linspace(0.5, 2, 4, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(PACKS["clone"], UNPACKS["clone"]):
            y = x * 2
            z = y * y
        y.mul_(2)
        z.sum().backward()
        assert torch.allclose(x.grad, 8 * torch.linspace(0.5, 2, 4))  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", ["pack_hook", "unpack_hook"])
    def test_non_callable_hook_is_rejected(self, bad: str) -> None:
        """A hook that is not callable is refused at construction, naming which one."""
        hooks: dict[str, Any] = {"pack_hook": lambda t: t, "unpack_hook": lambda t: t}
        hooks[bad] = 3
        with pytest.raises(TypeError, match=f"{bad} must be callable, got 3 of type int"):
            tensorhooks.saved_tensors_hooks(**hooks)


class TestDisableSavedTensorsHooks:
    @pytest.mark.parametrize(
        "hooks",
        [tensorhooks.saved_tensors_hooks, torch_graph.saved_tensors_hooks],
        ids=["tensorhooks", "torch"],
    )
    def test_entering_hooks_raises_the_message(self, hooks: Any) -> None:
        """Entering any hooks, tensorhooks' or torch's, raises RuntimeError(error_message)."""
        with (
            tensorhooks.disable_saved_tensors_hooks("no hooks in region A"),
            pytest.raises(RuntimeError, match="no hooks in region A"),
            hooks(lambda t: t, lambda t: t),
        ):
            pass

    def test_nesting_restores_the_outer_message(self) -> None:
        """After an inner disable exits, the outer message applies again; then hooks work."""
        with tensorhooks.disable_saved_tensors_hooks("outer"):
            with tensorhooks.disable_saved_tensors_hooks("inner"):
                assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() == (
                    "inner"
                )
            assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() == "outer"
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()
        with tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t):
            pass

    def test_restores_state_when_the_body_raises(self) -> None:
        """An exception in the body leaves hooks enabled again, with no message left behind."""
        with (
            pytest.raises(KeyError),
            tensorhooks.disable_saved_tensors_hooks("temporarily off"),
        ):
            raise KeyError("body failed")
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()
        assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None

    def test_same_transitions_as_torch(self) -> None:
        """Interleaving tensorhooks' and torch's disable gives the states torch gives."""
        get = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
        seen = []
        for outer, inner in [
            (tensorhooks.disable_saved_tensors_hooks, torch_graph.disable_saved_tensors_hooks),
            (torch_graph.disable_saved_tensors_hooks, tensorhooks.disable_saved_tensors_hooks),
            (torch_graph.disable_saved_tensors_hooks, torch_graph.disable_saved_tensors_hooks),
        ]:
            trace = []
            with outer("a"):
                trace.append(get())
                with inner("b"):
                    trace.append(get())
                trace.append(get())
            trace.append(get())
            seen.append(trace)
        assert seen[0] == seen[1] == seen[2] == ["a", "b", "a", None]

    @pytest.mark.parametrize(
        "disable",
        [tensorhooks.disable_saved_tensors_hooks, torch_graph.disable_saved_tensors_hooks],
        ids=["tensorhooks", "torch"],
    )
    def test_entering_under_active_hooks_raises_and_restores(self, disable: Any) -> None:
        """Disabling while hooks are in force raises the message and changes nothing."""
        with tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t):
            with (
                pytest.raises(RuntimeError, match=r"^off while hooked$"),
                disable("off while hooked"),
            ):
                pass
            assert torch._C._autograd._saved_tensors_hooks_is_enabled()
            assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None

    def test_usable_as_decorator(self) -> None:
        """Like torch's, it decorates a function."""

        @tensorhooks.disable_saved_tensors_hooks("decorated")
        def body() -> str | None:
            return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()

        assert body() == "decorated"
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()

    def test_disabled_state_is_per_thread(self) -> None:
        """Disabling on one thread leaves another thread free to use hooks."""
        results: list[bool] = []
        with tensorhooks.disable_saved_tensors_hooks("off here"):
            thread = threading.Thread(
                target=lambda: results.append(torch._C._autograd._saved_tensors_hooks_is_enabled())
            )
            thread.start()
            thread.join()
        assert results == [True]

    def test_non_string_message_is_rejected(self) -> None:
        """A message that is not a str is refused before anything changes."""
        with (
            pytest.raises(TypeError, match="error_message must be a str, got 42 of type int"),
            tensorhooks.disable_saved_tensors_hooks(42),  # type: ignore[arg-type]
        ):
            pass
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()
