"""The graph-task store: state that lives exactly as long as one backward call.

Every ``backward()`` or ``autograd.grad()`` call runs as one *graph task* with its own id
(``current_graph_task_id()`` of `_torch_compat`; ``-1`` outside backward). Multi-grad hooks, offload
prefetching and gradient synchronisation all keep per-backward state here, keyed by that id.

See NOTE [Releasing graph-task state].
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .compile import runs_eagerly
from .errors import GraphTaskError
from .torch_compat import current_graph_task_id, queue_callback

__all__ = ["GraphTaskState", "GraphTaskStore", "graph_task_store", "live_graph_tasks"]

# NOTE [Releasing graph-task state]
#
# The engine offers one end-of-task signal to Python: a callback queued with
# the engine's ``queue_callback`` runs when the graph task *succeeds*, and never
# when backward raises. What the engine does on both paths is drop its reference to the callback
# when the graph task dies. So the first time a graph task touches the store we queue exactly one
# callback, and that callback is the only owner of a small sentinel object with a
# ``weakref.finalize`` attached:
#
#   success: engine runs the callback (end-of-task callbacks of the task run there), then drops
#            it; the sentinel dies; the finalizer removes the task's entry.
#   failure: engine drops the callback without running it; the sentinel dies; the finalizer
#            removes the task's entry and empties its state, so nothing a failed backward
#            buffered (grads after an OOM) survives it, even while the hook that raised keeps
#            the state referenced from its frame through the exception's traceback.
#
#   an end callback raises: the exception's traceback holds the callback's frame, and so the
#            sentinel, for as long as the exception is referenced (a log, a retry loop's
#            ``last_error``). The callback then releases the task itself (its state cleared, the
#            finalizer run) before the exception leaves it; what stays referenced is only the
#            failing callback and its own frames.
#
# One callback per graph task, not per hook, keeps the cost flat in the number of hooks. On CPU
# the engine drops the graph task on the thread that called backward, before backward returns,
# so the store is empty again by the time ``backward()`` returns. With device threads the drop
# can come from a worker thread a moment later; nothing depends on the exact moment.

_T = TypeVar("_T")


_MISSING = object()


class _Sentinel:
    """Owned only by a graph task's end callback; its death means the graph task is gone."""

    __slots__ = ("__weakref__",)


class GraphTaskState:
    """The state one graph task keeps in the store.

    Each feature stores its state under a key of its own (usually an object private to one
    hook). ``lock`` (reentrant, so a factory passed to `get` may call `on_end`) guards compound
    updates made by hooks that may run concurrently on the engine's device threads.
    """

    __slots__ = ("_end_callbacks", "_slots", "lock", "task_id")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self._slots: dict[object, Any] = {}
        self.lock = threading.RLock()
        self._end_callbacks: list[tuple[int, int, Callable[[], None]]] = []

    def get(self, key: object, factory: Callable[[], _T]) -> _T:
        """Return the state stored under ``key``, creating it with ``factory`` on first use."""
        value = self._slots.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[no-any-return]
        with self.lock:
            if key not in self._slots:
                self._slots[key] = factory()
            return self._slots[key]  # type: ignore[no-any-return]

    def peek(self, key: object) -> Any:
        """Return the state stored under ``key``, or None when there is none."""
        return self._slots.get(key)

    def claim(self, key: object, value: _T) -> _T:
        """Store ``value`` under ``key`` unless something is there; return what is stored.

        Atomic (one ``dict.setdefault``): when hooks on several threads race, exactly one value
        wins, and ``claim(key, mine) is mine`` tells each caller whether it was the one.
        """
        return self._slots.setdefault(key, value)  # type: ignore[no-any-return]

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
                self._end_callbacks[done:] = sorted(self._end_callbacks[done:])
                end = len(self._end_callbacks)
            # Read one at a time, so that a callback that raises holds no list of the others in
            # this frame (see NOTE [Releasing graph-task state]).
            while done < end:
                callback = self._end_callbacks[done][2]
                done += 1
                callback()

    def _release(self) -> None:
        """Drop everything the task holds, while a traceback may still hold this object."""
        with self.lock:
            self._slots.clear()
            self._end_callbacks.clear()


class GraphTaskStore:
    """Per-graph-task state, isolated between tasks, dropped when each task ends.

    Thread safety: tasks are created under a lock (so a task queues exactly one end callback even
    when hooks of one task run on several device threads); lookups are plain dict reads, atomic
    under the GIL.
    """

    def __init__(self) -> None:
        self._tasks: dict[int, GraphTaskState] = {}
        self._lock = threading.Lock()

    def current(self) -> GraphTaskState:
        """Return the state of the graph task running on this thread, creating it on first use.

        Raises:
            GraphTaskError: when called outside a backward call (a ``RuntimeError``).
        """
        task_id = current_graph_task_id()
        state = self._tasks.get(task_id)
        if state is None:
            state = self._open(task_id)
        return state

    def is_live(self, task_id: int) -> bool:
        """Whether the graph task ``task_id`` still holds state (it has not ended)."""
        return task_id in self._tasks

    def _open(self, task_id: int) -> GraphTaskState:
        if task_id == -1:
            raise GraphTaskError(
                "per-backward state was requested outside a backward call "
                "(the current graph task id is -1); this can only be used from hooks "
                "that autograd runs during backward() or autograd.grad()"
            )
        with self._lock:
            state = self._tasks.get(task_id)
            if state is not None:
                return state
            state = GraphTaskState(task_id)
            sentinel = _Sentinel()
            finalizer = weakref.finalize(sentinel, self._drop, task_id, state)
            finalizer.atexit = False

            @runs_eagerly  # See NOTE [Contexts under torch.compile]
            def end_of_task(sentinel: _Sentinel = sentinel) -> None:
                try:
                    state._run_end_callbacks()
                except BaseException:
                    # See NOTE [Releasing graph-task state]: the exception's traceback keeps
                    # this frame, and so the sentinel, alive; release the task now.
                    state._release()
                    finalizer()
                    raise

            # See NOTE [Releasing graph-task state]: the engine is the only owner of the
            # callback, and the callback the only owner of the sentinel.
            queue_callback(end_of_task)
            del sentinel
            self._tasks[task_id] = state
            return state

    @runs_eagerly  # a finalizer: it may run while a compiled function runs
    def _drop(self, task_id: int, state: GraphTaskState) -> None:
        """Forget a task that ended and empty its state.

        Emptied, not only forgotten: a hook that raised in backward keeps the state referenced
        from its frame for as long as the exception's traceback lives (see NOTE [Releasing
        graph-task state]).
        """
        self._tasks.pop(task_id, None)
        state._release()

    def __len__(self) -> int:
        return len(self._tasks)


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
