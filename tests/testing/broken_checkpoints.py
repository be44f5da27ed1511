"""Checkpoints that are wrong in one known way, to show that the checker catches each way.

Each wraps torch's non-reentrant checkpoint, which gives plain autograd's results on the region
kinds these are used on, and breaks it as real implementations have been broken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from tensorhooks._core.torch_compat import storage_key
from tensorhooks._testing.explained import _reached

# The words tensorhooks.checkpoint uses for a replaced tensor: the checker takes an error so
# worded for a right answer where the program changed what the region read.
REPLACED = "was replaced between the forward pass and backward"


def _snapshot(function: Callable[..., Any]) -> list[tuple[Any, ...]]:
    """What ``function`` reaches: each path with its tensor's identity, storage and version."""
    return [
        (path, id(item), storage_key(item), item._version)
        if isinstance(item, torch.Tensor)
        else (path, item)
        for path, item in _reached(function, None)
    ]


def watching(when: str) -> Callable[..., Any]:
    """A checkpoint that raises in recomputation if anything its function reaches changed.

    It watches everything the function's closure reaches, read or not, from the start of the
    call (``when="start"``: the region's own writes and rebuilt masks count too) or from its
    end (``when="end"``: a later region's writes to a layer this one never ran count).
    """

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        seen: list[list[tuple[Any, ...]]] = []

        def run(*inner: Any, **named: Any) -> Any:
            if when == "start" or seen:
                seen.append(_snapshot(function))
            if len(seen) > 1 and seen[-1] != seen[0]:
                raise RuntimeError(f"watching checkpoint: what the region reaches {REPLACED}")
            result = function(*inner, **named)
            if when == "end" and not seen:
                seen.append(_snapshot(function))
            return result

        return torch.utils.checkpoint.checkpoint(run, *args, **kwargs)

    return checkpoint


def thread_bound(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A checkpoint whose recomputation on another thread than the forward pass's goes wrong.

    As one keeping per-thread state (a generator, autocast) for recomputation would: run on a
    worker thread, recomputation sees the arguments halved.
    """
    owner = threading.get_ident()

    def run(*inner: Any, **named: Any) -> Any:
        if threading.get_ident() != owner:
            inner = tuple(a * 0.5 if isinstance(a, torch.Tensor) else a for a in inner)
        return function(*inner, **named)

    return torch.utils.checkpoint.checkpoint(run, *args, **kwargs)


def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The non-reentrant checkpoint of torch, as regions call it."""
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
