"""Parameters whose ``.grad`` is written at the end of the graph task, not by their accumulator.

`offload_parameters` copies each gradient to host memory as it is accumulated and writes the
host ``.grad`` only once backward has finished (see NOTE [Streaming parameters with hooks] in
_params.py), in an end-of-task callback of order `LANDING_ORDER`. A feature that reads ``.grad``
during backward (`sync_gradients`, see NOTE [What a bucket averages] in distributed.py) asks
`lands_late` and, for such a parameter, reads ``.grad`` in an end-of-task callback of a greater
order instead. This module imports nothing of tensorhooks: both sides depend on it, not on each
other.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

__all__ = ["LANDING_ORDER", "LateGrads", "generation", "lands_late"]

LANDING_ORDER = 1
"""The ``order`` (of `GraphTaskState.on_end`) of the end-of-task callback writing late grads."""


class _Registry:
    """The registered parameters, and a generation number bumped by every change."""

    __slots__ = ("generation", "late", "lock")

    def __init__(self) -> None:
        # id(param) -> (a weak reference telling a reused id apart, how many registrations)
        self.late: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.lock = threading.Lock()
        self.generation = 0


_registry = _Registry()


def lands_late(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is written at the end of the graph task, not when accumulated."""
    entry = _registry.late.get(id(param))
    return entry is not None and entry[0]() is param


def generation() -> int:
    """A number that changes whenever the answer of `lands_late` may have changed for some tensor.

    Lets a caller cache its answers: they stay valid while this number stays the same.
    """
    return _registry.generation


class LateGrads:
    """The registration of parameters whose ``.grad`` lands late; ``remove()`` ends it.

    Thread-safe; the parameters are held weakly. Each parameter may be registered by several
    holders at once and lands late until every one of them is removed.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params: list[tuple[int, weakref.ref[torch.Tensor]]] | None = []
        late = _registry.late
        with _registry.lock:
            for param in params:
                entry = late.get(id(param))
                count = entry[1] if entry is not None and entry[0]() is param else 0
                late[id(param)] = (weakref.ref(param), count + 1)
                self._params.append((id(param), weakref.ref(param)))
            _registry.generation += 1

    def remove(self) -> None:
        """Stop reporting these parameters as landing late. Calling it again does nothing."""
        refs, self._params = self._params, None
        if refs is None:
            return
        late = _registry.late
        with _registry.lock:
            for key, ref in refs:
                entry = late.get(key)
                if entry is None or entry[0]() is not ref():
                    continue  # the id was reused by another tensor since
                if entry[1] == 1 or ref() is None:
                    del late[key]
                else:
                    late[key] = (entry[0], entry[1] - 1)
            _registry.generation += 1
