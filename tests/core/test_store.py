from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch

import tensorhooks
from tensorhooks._core import store as _store
from tensorhooks._core.store import GraphTaskState, graph_task_store
from tests.strategies import BackwardFailedError, FailingBackward


def run_backward_with(hook: Callable[[torch.Tensor], None], *, fail: bool = False) -> None:
    """Run a small backward whose middle tensor carries ``hook``; optionally make it raise."""
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    z = FailingBackward.apply(x) * y if fail else y * 3  # type: ignore[no-untyped-call]
    z.sum().backward()


class TestGraphTaskStore:
    def test_outside_backward_raises(self) -> None:
        """Asking for per-backward state outside backward names the problem."""
        with pytest.raises(tensorhooks.GraphTaskError, match="outside a backward call"):
            graph_task_store.current()

    def test_state_released_after_successful_backward(self) -> None:
        """State created during a backward is gone when backward returns."""
        seen: list[GraphTaskState] = []

        def hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            state.get("payload", lambda: torch.zeros(1000))
            seen.append(state)
            assert tensorhooks.live_graph_tasks() == 1

        run_backward_with(hook)
        assert len(seen) == 1
        assert tensorhooks.live_graph_tasks() == 0

    def test_state_released_after_failed_backward(self) -> None:
        """State created during a backward that raises is dropped too, with no callback run."""
        ended: list[int] = []

        def hook(grad: torch.Tensor) -> None:
            graph_task_store.current().on_end(lambda: ended.append(1))

        with pytest.raises(BackwardFailedError):
            run_backward_with(hook, fail=True)
        assert tensorhooks.live_graph_tasks() == 0
        assert ended == []

    def test_state_released_while_an_end_callback_error_is_referenced(self) -> None:
        """An end callback's exception, kept referenced, keeps neither the task nor its state."""
        payloads: list[weakref.ref[torch.Tensor]] = []
        later: list[int] = []

        def fail() -> None:
            raise BackwardFailedError("end callback failed on purpose")

        def hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            payload = state.get("payload", lambda: torch.zeros(1000))
            payloads.append(weakref.ref(payload))
            state.on_end(fail)
            state.on_end(lambda: later.append(1), order=1)

        with pytest.raises(BackwardFailedError) as caught:
            run_backward_with(hook)
        gc.collect()
        assert caught.value.__traceback__ is not None  # the exception and its frames live on
        assert tensorhooks.live_graph_tasks() == 0
        assert payloads[0]() is None
        assert later == []

    def test_state_released_while_a_hook_error_is_referenced(self) -> None:
        """A hook that raised in backward keeps the task's state in its frame: emptied anyway."""
        payloads: list[weakref.ref[torch.Tensor]] = []

        def hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            payload = state.get("payload", lambda: torch.zeros(1000))
            payloads.append(weakref.ref(payload))
            del payload
            raise BackwardFailedError("hook failed on purpose")

        with pytest.raises(BackwardFailedError) as caught:
            run_backward_with(hook)
        gc.collect()
        assert caught.value.__traceback__ is not None  # the hook's frame, holding `state`, lives
        assert tensorhooks.live_graph_tasks() == 0
        assert payloads[0]() is None

    def test_buffered_grads_released_while_a_multi_grad_error_is_referenced(self) -> None:
        """One multi-grad hook raising frees what another buffered, exception kept or not."""
        a = torch.ones(1000, requires_grad=True)
        b = torch.ones(1000, requires_grad=True)
        c = torch.ones(1, requires_grad=True)
        b_out, c_out, a_out = b * 2, c * 1, a * 2  # backward runs a_out's node first, b_out's last
        grads: list[weakref.ref[torch.Tensor]] = []
        a_out.register_hook(lambda g: grads.append(weakref.ref(g)))

        def boom(_: object) -> None:
            raise BackwardFailedError("multi-grad hook failed on purpose")

        handles = [
            tensorhooks.register_multi_grad_hook([a_out, b_out], lambda _: None),
            tensorhooks.register_multi_grad_hook([c_out], boom),
        ]
        with pytest.raises(BackwardFailedError) as caught:
            (a_out.sum() + b_out.sum() + c_out.sum()).backward()
        gc.collect()
        assert caught.value.__traceback__ is not None
        assert grads, "a_out's gradient was never computed"
        assert grads[0]() is None, "a buffered gradient outlived the failed backward"
        for handle in handles:
            handle.remove()

    def test_end_callbacks_run_in_order_then_registration_order(self) -> None:
        """End callbacks run after the graph task, sorted by order, stable within an order."""
        calls: list[str] = []

        def hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            state.on_end(lambda: calls.append("late"), order=1)
            state.on_end(lambda: calls.append("first"))
            state.on_end(lambda: calls.append("second"))
            assert calls == []

        run_backward_with(hook)
        assert calls == ["first", "second", "late"]

    def test_callback_added_by_a_callback_runs(self) -> None:
        """A callback registered while end callbacks run still runs in the same task."""
        calls: list[str] = []

        def hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            state.on_end(lambda: state.on_end(lambda: calls.append("added")))

        run_backward_with(hook)
        assert calls == ["added"]

    def test_end_callbacks_see_the_finished_grads(self) -> None:
        """End callbacks run after every gradient was accumulated into .grad."""
        x = torch.ones(3, requires_grad=True)
        seen: list[torch.Tensor | None] = []

        def hook(grad: torch.Tensor) -> None:
            graph_task_store.current().on_end(lambda: seen.append(x.grad))

        y = x * 2
        y.register_hook(hook)
        (y * 3).sum().backward()
        assert seen[0] is not None
        assert torch.equal(seen[0], torch.full((3,), 6.0))

    def test_one_engine_callback_per_task(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """However many hooks use the store, each graph task queues exactly one engine callback."""
        queued: list[int] = []
        real = _store.queue_callback

        def counting(callback: Callable[[], None]) -> None:
            queued.append(1)  # not the callback itself: holding it would keep the task alive
            real(callback)

        monkeypatch.setattr(_store, "queue_callback", counting)
        x = torch.ones(3, requires_grad=True)
        ys = [x * i for i in range(10)]

        def make_hook(i: int) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                graph_task_store.current().get(i, object)

            return hook

        for i, y in enumerate(ys):
            y.register_hook(make_hook(i))
        sum(y.sum() for y in ys).backward()  # type: ignore[union-attr]
        assert len(queued) == 1
        queued.clear()
        sum(y.sum() for y in (x * 5, x * 6)).backward()  # type: ignore[union-attr]
        assert queued == []  # no hook, no state, no callback

    def test_tasks_are_isolated_when_backward_is_reentrant(self) -> None:
        """A backward run inside a hook is its own graph task with its own state."""
        outer_ids: list[int] = []
        inner_ids: list[int] = []

        def inner_hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            inner_ids.append(state.task_id)
            assert state.get("who", lambda: "inner") == "inner"

        def outer_hook(grad: torch.Tensor) -> None:
            state = graph_task_store.current()
            assert state.get("who", lambda: "outer") == "outer"
            outer_ids.append(state.task_id)
            with torch.enable_grad():
                a = torch.ones(2, requires_grad=True)
                b = a * 2
                b.register_hook(inner_hook)
                b.sum().backward()
            assert graph_task_store.current() is state
            assert state.peek("who") == "outer"

        run_backward_with(outer_hook)
        assert len(outer_ids) == len(inner_ids) == 1
        assert outer_ids[0] != inner_ids[0]

    def test_tasks_are_isolated_across_threads(self) -> None:
        """Concurrent backward calls on many threads never see each other's state."""
        errors: list[str] = []
        barrier = threading.Barrier(4)

        def worker(tag: int) -> None:
            barrier.wait()
            for step in range(50):
                token = (tag, step)

                def hook(grad: torch.Tensor, token: tuple[int, int] = token) -> None:
                    state = graph_task_store.current()
                    got = state.get("token", lambda: token)
                    if got != token:
                        errors.append(f"{token} saw {got}")

                run_backward_with(hook)

        threads = [threading.Thread(target=worker, args=(tag,)) for tag in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert tensorhooks.live_graph_tasks() == 0

    def test_get_creates_once_under_concurrency(self) -> None:
        """``get`` calls its factory once per key even when many threads race for it."""
        state = GraphTaskState(task_id=123)
        made: list[int] = []
        barrier = threading.Barrier(8)

        def factory() -> int:
            made.append(1)
            return len(made)

        def worker() -> None:
            barrier.wait()
            state.get("key", factory)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert made == [1]
        assert state.peek("key") == 1
