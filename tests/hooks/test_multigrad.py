from __future__ import annotations

import gc
import pickle
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph
from hypothesis import given
from hypothesis import strategies as st

import tensorhooks
from tests.strategies import (
    Backward,
    BackwardFailedError,
    FailingBackward,
    Program,
    assert_same_grads,
    backwards,
    hook_sets,
    programs,
)

Grads = list[torch.Tensor | None]


def task_id() -> int:
    return torch._C._current_graph_task_id()


def unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def fail_midway(x: torch.Tensor) -> torch.Tensor:
    return FailingBackward.apply(x)  # type: ignore[no-any-return, no-untyped-call]


@dataclass
class HookedCase:
    """A random program, a random group of its values to hook, and a way to run backward."""

    program: Program
    values: list[torch.Tensor]
    tensors: list[torch.Tensor]
    backward: Backward

    @classmethod
    def draw(cls, data: st.DataObject) -> HookedCase:
        program = data.draw(programs(may_fail=True))
        positions = data.draw(hook_sets(program))
        backward = data.draw(backwards(program))
        values = program.run(program.leaves())
        return cls(program, values, [values[i] for i in positions], backward)

    def run_backward(self) -> bool:
        """Run backward; return whether it failed part-way (on purpose)."""
        try:
            self.backward.run(self.program.loss(self.values), self.values)
        except BackwardFailedError:
            return True
        return False


class TestAllMode:
    @given(data=st.data())
    def test_fires_once_per_backward_with_exactly_the_grads_plain_hooks_see(
        self, data: st.DataObject
    ) -> None:
        """Per backward: one call if any hook of its tensors fired, holding exactly those grads."""
        case = HookedCase.draw(data)
        tensors = case.tensors

        plain: dict[int, dict[int, torch.Tensor | None]] = defaultdict(dict)
        for tensor in unique(tensors):

            def record(grad: torch.Tensor | None, key: int = id(tensor)) -> None:
                plain[task_id()][key] = grad

            tensor.register_hook(record)
        calls: list[tuple[int, Grads]] = []
        handle = tensorhooks.register_multi_grad_hook(
            tensors, lambda grads: calls.append((task_id(), list(grads)))
        )
        failed = case.run_backward()
        handle.remove()

        assert len({task for task, _ in calls}) == len(calls), "fired twice in one backward"
        for task, grads in calls:
            assert_same_grads([plain[task].get(id(t)) for t in tensors], grads)
        if not failed:
            assert sorted(task for task, _ in calls) == sorted(plain)
        assert tensorhooks.live_graph_tasks() == 0

    @given(data=st.data())
    def test_same_calls_as_torch_where_torch_is_right(self, data: st.DataObject) -> None:
        """Single-threaded backward() and backward(inputs=): the same calls with the same grads."""
        program = data.draw(programs())
        positions = data.draw(hook_sets(program))
        backward = data.draw(backwards(program).filter(lambda b: b.kind != "grad"))
        seen: dict[str, list[Grads]] = {}
        for name, register in (
            ("torch", torch_graph.register_multi_grad_hook),
            ("tensorhooks", tensorhooks.register_multi_grad_hook),
        ):
            values = program.run(program.leaves())
            calls: list[Grads] = []
            register([values[i] for i in positions], lambda grads, c=calls: c.append(list(grads)))
            backward.run(program.loss(values), values)
            seen[name] = calls
        assert len(seen["torch"]) == len(seen["tensorhooks"])
        for want, got in zip(seen["torch"], seen["tensorhooks"], strict=True):
            assert_same_grads(want, got)

    def test_autograd_grad_on_leaves(self) -> None:
        """autograd.grad with leaf inputs fires with the leaves' grads (torch raises)."""
        a = torch.ones(3, requires_grad=True)
        b = torch.full((3,), 2.0, requires_grad=True)
        loss = (a * b).sum()
        handle = torch_graph.register_multi_grad_hook([a, b], lambda grads: None)
        with pytest.raises(RuntimeError, match="A leaf node was passed"):
            torch.autograd.grad(loss, (a,), retain_graph=True)
        handle.remove()
        calls: list[Grads] = []
        tensorhooks.register_multi_grad_hook([a, b], lambda grads: calls.append(list(grads)))
        (grad_a,) = torch.autograd.grad(loss, (a,))
        assert len(calls) == 1
        assert_same_grads([grad_a, None], calls[0])
        assert a.grad is None
        assert b.grad is None

    def test_autograd_grad_on_one_output_of_a_multi_output_node(self) -> None:
        """Capturing one output of split: one call, with what the plain tensor hooks see."""
        x = torch.arange(4.0, requires_grad=True)
        first, second = (x * 1).split(2)
        loss = (first * 2 + second * 3).sum()
        plain: dict[int, torch.Tensor] = {}
        for index, tensor in enumerate((first, second)):
            tensor.register_hook(lambda grad, i=index: plain.__setitem__(i, grad))
        calls: list[Grads] = []
        tensorhooks.register_multi_grad_hook(
            [first, second], lambda grads: calls.append(list(grads))
        )
        (grad_second,) = torch.autograd.grad(loss, (second,))
        assert len(calls) == 1
        assert torch.equal(plain[1], grad_second)
        assert_same_grads([plain.get(0), plain[1]], calls[0])

    def test_threads_lose_no_call(self) -> None:
        """Four threads running backward at once: every call fires, each with every grad."""
        params = [torch.randn(16, requires_grad=True) for _ in range(6)]
        calls: list[int] = []
        lock = threading.Lock()

        def on_all(grads: Sequence[torch.Tensor | None]) -> None:
            assert all(g is not None for g in grads)
            with lock:
                calls.append(task_id())

        handle = tensorhooks.register_multi_grad_hook(params, on_all)
        barrier = threading.Barrier(4)

        def worker() -> None:
            barrier.wait()
            for _ in range(100):
                sum((p.sin() * p).sum() for p in params).backward()  # type: ignore[union-attr]

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        handle.remove()
        assert len(calls) == 400
        assert len(set(calls)) == 400

    def test_failed_backward_keeps_no_grads(self) -> None:
        """Grads buffered by a backward that raised part-way are freed (torch keeps them)."""
        a = torch.ones(1000, requires_grad=True)
        b = torch.ones(1000, requires_grad=True)
        buffered: list[weakref.ref[torch.Tensor]] = []
        failing = fail_midway(b)  # created first, so the engine runs it after a_out's node
        a_out = a * 2
        a_out.register_hook(lambda grad: buffered.append(weakref.ref(grad)))
        calls: list[Grads] = []
        tensorhooks.register_multi_grad_hook([a_out, b], lambda grads: calls.append(list(grads)))
        with pytest.raises(BackwardFailedError):
            (a_out.sum() + failing.sum()).backward()
        gc.collect()
        assert calls == []
        assert len(buffered) == 1
        assert buffered[0]() is None
        assert tensorhooks.live_graph_tasks() == 0

    def test_hook_function_raising_releases_state(self) -> None:
        """An exception from ``fn`` propagates out of backward and leaves nothing behind."""
        x = torch.ones(3, requires_grad=True)

        def explode(grads: Sequence[torch.Tensor | None]) -> None:
            raise ValueError("fn failed")

        tensorhooks.register_multi_grad_hook([x], explode)
        with pytest.raises(ValueError, match="fn failed"):
            (x * 2).sum().backward()
        assert tensorhooks.live_graph_tasks() == 0

    def test_duplicates_fill_every_position(self) -> None:
        """A tensor listed twice is hooked once and its grad appears in both positions."""
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        calls: list[Grads] = []
        tensorhooks.register_multi_grad_hook([a, b, a], lambda grads: calls.append(list(grads)))
        (3 * a + b).sum().backward()
        assert len(calls) == 1
        assert_same_grads([torch.full((2,), 3.0), torch.ones(2), torch.full((2,), 3.0)], calls[0])

    def test_tensors_not_requiring_grad_get_none(self) -> None:
        """A tensor that does not require grad is accepted and always gets None (torch raises)."""
        a = torch.ones(2, requires_grad=True)
        constant = torch.ones(2)
        with pytest.raises(AssertionError):  # torch 2.8's assert has no message; 2.13's has one
            torch_graph.register_multi_grad_hook([a, constant], lambda grads: None)
        calls: list[Grads] = []
        tensorhooks.register_multi_grad_hook([a, constant], calls.append)
        (a * constant).sum().backward()
        assert_same_grads([torch.ones(2), None], calls[0])

    def test_retain_graph_fires_once_per_backward(self) -> None:
        """Two backward calls over a retained graph fire twice, once each."""
        a = torch.ones(2, requires_grad=True)
        out = (a * a).sum()
        calls: list[int] = []
        tensorhooks.register_multi_grad_hook([a], lambda grads: calls.append(task_id()))
        out.backward(retain_graph=True)
        out.backward()
        assert len(calls) == 2
        assert calls[0] != calls[1]


class TestAnyMode:
    @given(data=st.data())
    def test_fires_once_per_backward_with_the_first_grad(self, data: st.DataObject) -> None:
        """Per backward: one call if any hook of its tensors fired, with the first one's grad."""
        case = HookedCase.draw(data)
        tensors = case.tensors

        first: dict[int, torch.Tensor | None] = {}
        for tensor in unique(tensors):
            tensor.register_hook(lambda grad: first.setdefault(task_id(), grad))
        calls: list[tuple[int, torch.Tensor]] = []
        handle = tensorhooks.register_multi_grad_hook(
            tensors, lambda grad: calls.append((task_id(), grad)), mode="any"
        )
        failed = case.run_backward()
        handle.remove()

        assert len({task for task, _ in calls}) == len(calls), "fired twice in one backward"
        for task, grad in calls:
            assert grad is first[task]
        if not failed:
            assert sorted(task for task, _ in calls) == sorted(first)
        assert tensorhooks.live_graph_tasks() == 0

    def test_many_backward_calls_keep_no_state(self) -> None:
        """A thousand backward calls leave no per-call entry behind (torch keeps one each)."""
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        torch_calls: list[torch.Tensor] = []
        torch_graph.register_multi_grad_hook([a, b], torch_calls.append, mode="any")
        calls: list[torch.Tensor] = []
        tensorhooks.register_multi_grad_hook([a, b], calls.append, mode="any")
        for _ in range(1000):
            (a * b).sum().backward()
        assert len(calls) == len(torch_calls) == 1000
        assert tensorhooks.live_graph_tasks() == 0
        torch_state = [
            cell.cell_contents
            for hook in a._backward_hooks.values()  # type: ignore[union-attr]
            for cell in (hook.__closure__ or ())
            if isinstance(cell.cell_contents, dict)
        ]
        assert [len(d) for d in torch_state] == [1000]  # torch's leak; tensorhooks has no dict

    def test_threads_fire_once_per_backward(self) -> None:
        """Concurrent backward calls each fire exactly once."""
        params = [torch.randn(8, requires_grad=True) for _ in range(5)]
        calls: list[int] = []
        lock = threading.Lock()

        def on_any(grad: torch.Tensor) -> None:
            with lock:
                calls.append(task_id())

        tensorhooks.register_multi_grad_hook(params, on_any, mode="any")
        barrier = threading.Barrier(4)

        def worker() -> None:
            barrier.wait()
            for _ in range(100):
                sum((p * p).sum() for p in params).backward()  # type: ignore[union-attr]

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(calls) == len(set(calls)) == 400


class TestHandleAndArguments:
    @pytest.mark.parametrize("mode", ["all", "any"])
    def test_remove_stops_calls(self, mode: Any) -> None:
        """After remove(), the hook no longer fires; a second remove() is harmless."""
        a = torch.ones(2, requires_grad=True)
        calls: list[object] = []
        handle = tensorhooks.register_multi_grad_hook([a], calls.append, mode=mode)
        (a * 2).sum().backward()
        handle.remove()
        handle.remove()
        (a * 2).sum().backward()
        assert len(calls) == 1

    @pytest.mark.parametrize("graph", [torch_graph, tensorhooks], ids=["torch", "tensorhooks"])
    def test_remove_during_backward_after_a_gradient_stops_the_call(self, graph: Any) -> None:
        """remove() in backward after one of the group got its gradient: fn is never called."""
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        calls: list[object] = []
        handle: Any = None
        # Registered before the multi-grad hook, so it runs first on b (whose gradient comes
        # first): the multi-grad hook then has seen one of its two gradients.
        b.register_hook(lambda grad: handle.remove())
        handle = graph.register_multi_grad_hook([a, b], calls.append)
        ((a * 2).sum() + (b * 3).sum()).backward()
        assert calls == []
        ((a * 2).sum() + (b * 3).sum()).backward()
        assert calls == []

    def test_handle_pickles(self) -> None:
        """The handle pickles (torch's fails); the copy is inert and the original still works."""
        a = torch.ones(2, requires_grad=True)
        torch_handle = torch_graph.register_multi_grad_hook([a], lambda grads: None)
        with pytest.raises(AttributeError, match="Can't pickle local object"):
            pickle.dumps(torch_handle)
        torch_handle.remove()
        calls: list[object] = []
        handle = tensorhooks.register_multi_grad_hook([a, a * 2], calls.append)
        restored = pickle.loads(pickle.dumps(handle))
        assert type(restored) is type(handle)
        assert len(restored.handles) == 2
        restored.remove()
        (a * 3).sum().backward()
        assert len(calls) == 1
        handle.remove()
        assert not a._backward_hooks

    def test_usable_as_context_manager(self) -> None:
        """Like torch's RemovableHandle, leaving a with-block removes the hook."""
        a = torch.ones(2, requires_grad=True)
        calls: list[object] = []
        with tensorhooks.register_multi_grad_hook([a], calls.append):
            (a * 2).sum().backward()
        (a * 2).sum().backward()
        assert len(calls) == 1

    def test_invalid_mode(self) -> None:
        """An unknown mode is a ValueError naming the value and the choices."""
        a = torch.ones(2, requires_grad=True)
        # torch's own text: code matching torch's message keeps working.
        expected = r"Expects mode to be one of \('all', 'any'\) but got every"
        with pytest.raises(ValueError, match=expected):
            torch_graph.register_multi_grad_hook([a], print, mode="every")  # type: ignore[arg-type]
        with pytest.raises(tensorhooks.HookArgumentValueError, match=expected):
            tensorhooks.register_multi_grad_hook([a], print, mode="every")  # type: ignore[arg-type]

    @pytest.mark.parametrize("tensors", [None, 3, object()])
    def test_tensors_not_iterable(self, tensors: Any) -> None:
        """A non-iterable ``tensors`` is a TypeError naming the argument, not only Python's text."""
        with pytest.raises(
            tensorhooks.HookArgumentTypeError,
            match=r"tensors must be a sequence of tensors, got .* object is not iterable",
        ):
            tensorhooks.register_multi_grad_hook(tensors, print)

    @pytest.mark.parametrize("tensors", [[], (), iter([])], ids=["list", "tuple", "iterator"])
    @pytest.mark.parametrize("mode", ["all", "any"])
    def test_empty_tensors_is_refused(self, tensors: Any, mode: Any) -> None:
        """An empty group, which torch accepts and never fires, is a ValueError saying so."""
        calls: list[object] = []
        torch_graph.register_multi_grad_hook([], calls.append, mode=mode)  # accepted by torch
        with pytest.raises(
            tensorhooks.HookArgumentValueError,
            match=r"tensors is empty \(got .*\), so fn would never be called; pass the tensors",
        ):
            tensorhooks.register_multi_grad_hook(tensors, calls.append, mode=mode)
        a = torch.ones(2, requires_grad=True)
        (a * 2).sum().backward()
        assert calls == []

    def test_non_tensor_in_list(self) -> None:
        """A non-tensor is a TypeError naming its position and type."""
        a = torch.ones(2, requires_grad=True)
        with pytest.raises(TypeError, match=r"tensors\[1\] is 3.0 of type float, not a torch"):
            tensorhooks.register_multi_grad_hook([a, 3.0], print)  # type: ignore[list-item]

    def test_single_tensor_instead_of_a_list(self) -> None:
        """Passing one tensor is refused with the fix in the message."""
        a = torch.ones(2, requires_grad=True)
        with pytest.raises(TypeError, match=r"wrap it in a list"):
            tensorhooks.register_multi_grad_hook(a, print)

    def test_fn_not_callable(self) -> None:
        """A non-callable fn is a TypeError."""
        a = torch.ones(2, requires_grad=True)
        with pytest.raises(TypeError, match="fn must be callable, got 'x' of type str"):
            tensorhooks.register_multi_grad_hook([a], "x")  # type: ignore[arg-type]

    def test_tensors_are_released(self) -> None:
        """Non-leaf tensors are not kept alive by the hook; leaves are freed by remove()."""
        leaf = torch.ones(2, requires_grad=True)
        out = leaf * 2
        hook_fn: Callable[[Sequence[torch.Tensor | None]], None] = lambda grads: None  # noqa: E731
        handle = tensorhooks.register_multi_grad_hook([leaf, out], hook_fn)
        leaf_ref, out_ref = weakref.ref(leaf), weakref.ref(out)
        del leaf, out
        gc.collect()
        assert out_ref() is None
        assert leaf_ref() is not None  # held through its gradient accumulator, as in torch
        handle.remove()
        gc.collect()
        assert leaf_ref() is None
