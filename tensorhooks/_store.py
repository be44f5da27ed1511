"""The graph-task store: state that lives exactly as long as one backward call.

Every ``backward()`` or ``autograd.grad()`` call runs as one *graph task* with its own id
(``torch._C._current_graph_task_id()``; ``-1`` outside backward). Multi-grad hooks, offload
prefetching and gradient synchronisation all keep per-backward state here, keyed by that id.

# NOTE [Releasing graph-task state]
#
# The engine offers one end-of-task signal to Python: a callback queued with
# ``Variable._execution_engine.queue_callback`` runs when the graph task *succeeds*, and never
# when backward raises. What the engine does on both paths is drop its reference to the callback
# when the graph task dies. So the first time a graph task touches the store we queue exactly one
# callback, and that callback is the only owner of a small sentinel object with a
# ``weakref.finalize`` attached:
#
#   success: engine runs the callback (end-of-task callbacks of the task run there), then drops
#            it; the sentinel dies; the finalizer removes the task's entry.
#   failure: engine drops the callback without running it; the sentinel dies; the finalizer
#            removes the task's entry, so nothing a failed backward buffered (grads after an OOM)
#            survives it.
#
# One callback per graph task, not per hook, keeps the cost flat in the number of hooks. On CPU
# the engine drops the graph task on the thread that called backward, before backward returns,
# so the store is empty again by the time ``backward()`` returns. With device threads the drop
# can come from a worker thread a moment later; nothing depends on the exact moment.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._errors import GraphTaskError

__all__ = ["GraphTaskState", "GraphTaskStore", "graph_task_store", "live_graph_tasks"]

_T = TypeVar("_T")

_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
_queue_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback
)


_MISSING = object()


class _Sentinel:
    """Owned only by a graph task's end callback; its death means the graph task is gone."""

    __slots__ = ("__weakref__",)


class GraphTaskState:
    """The state one graph task keeps in the store.

    ``slots`` maps a key chosen by each feature (usually an object private to one hook) to that
    feature's state. ``lock`` (reentrant, so a factory passed to
    `get` may call `on_end`) guards compound updates made by hooks that may run
    concurrently on the engine's device threads.
    """

    __slots__ = ("_end_callbacks", "lock", "slots", "task_id")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.slots: dict[object, Any] = {}
        self.lock = threading.RLock()
        self._end_callbacks: list[tuple[int, int, Callable[[], None]]] = []

    def get(self, key: object, factory: Callable[[], _T]) -> _T:
        """Return the state stored under ``key``, creating it with ``factory`` on first use."""
        value = self.slots.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[no-any-return]
        with self.lock:
            if key not in self.slots:
                self.slots[key] = factory()
            return self.slots[key]  # type: ignore[no-any-return]

    def on_end(self, callback: Callable[[], None], *, order: int = 0) -> None:
        """Run ``callback`` when this graph task finishes successfully.

        Callbacks run in increasing ``order``, then in registration order. They do not run when
        backward raises; the task's state is dropped either way. A callback registered while the
        end callbacks are running (by another end callback) still runs.
        """
        with self.lock:
            self._end_callbacks.append((order, len(self._end_callbacks), callback))

    def _run_end_callbacks(self) -> None:
        done = 0
        while True:
            with self.lock:
                if done == len(self._end_callbacks):
                    return
                batch = sorted(self._end_callbacks[done:])
                self._end_callbacks[done:] = batch
            for _, _, callback in batch:
                callback()
            done += len(batch)


class GraphTaskStore:
    """Per-graph-task state, isolated between tasks, dropped when each task ends.

    Thread safety: tasks are created under a lock (so a task queues exactly one end callback even
    when hooks of one task run on several device threads); lookups are plain dict reads, atomic
    under the GIL.
    """

    def __init__(self) -> None:
        # Read directly (``tasks_by_id.get(task_id)``) by hooks on hot paths, to save a call.
        self.tasks_by_id: dict[int, GraphTaskState] = {}
        self._lock = threading.Lock()

    def current(self) -> GraphTaskState:
        """Return the state of the graph task running on this thread, creating it on first use.

        Raises:
            GraphTaskError: when called outside a backward call.
        """
        task_id = _current_graph_task_id()
        state = self.tasks_by_id.get(task_id)
        if state is None:
            state = self._open(task_id)
        return state

    def _open(self, task_id: int) -> GraphTaskState:
        if task_id == -1:
            raise GraphTaskError(
                "per-backward state was requested outside a backward call "
                "(torch._C._current_graph_task_id() is -1); this can only be used from hooks "
                "that autograd runs during backward() or autograd.grad()"
            )
        with self._lock:
            state = self.tasks_by_id.get(task_id)
            if state is not None:
                return state
            state = GraphTaskState(task_id)
            sentinel = _Sentinel()
            finalizer = weakref.finalize(sentinel, self.tasks_by_id.pop, task_id, None)
            finalizer.atexit = False

            def end_of_task(sentinel: _Sentinel = sentinel) -> None:
                state._run_end_callbacks()

            # See NOTE [Releasing graph-task state]: the engine is the only owner of the
            # callback, and the callback the only owner of the sentinel.
            _queue_callback(end_of_task)
            del sentinel
            self.tasks_by_id[task_id] = state
            return state

    def __len__(self) -> int:
        return len(self.tasks_by_id)

    def task_ids(self) -> list[int]:
        """Return the ids of the graph tasks that currently hold state (for diagnostics)."""
        return list(self.tasks_by_id)


graph_task_store = GraphTaskStore()
"""The one store shared by every feature of tensorhooks."""


def live_graph_tasks() -> int:
    """Return how many graph tasks hold state in tensorhooks' store right now.

    Outside backward this is 0 whenever nothing leaked: every graph task's state is dropped when
    the task ends, whether backward succeeded or raised.

    Example:
        >>> import torch, tensorhooks
        >>> x = torch.ones(3, requires_grad=True)
        >>> handle = tensorhooks.register_multi_grad_hook([x], lambda grads: None)
        >>> (x * 2).sum().backward()
        >>> tensorhooks.live_graph_tasks()
        0
        >>> handle.remove()

    Returns:
        The number of graph tasks with live state.
    """
    return len(graph_task_store)
