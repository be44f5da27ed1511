"""What the ported tests share: the two implementations, and the marks that tell them apart."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from tensorhooks import checkpointing

IMPLEMENTATIONS: dict[str, ModuleType] = {
    "torch": torch_checkpoint,
    "tensorhooks": checkpointing,
}

both = pytest.mark.parametrize(
    "ckpt", [pytest.param(module, id=name) for name, module in IMPLEMENTATIONS.items()]
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def torch_release_fails(reason: str) -> pytest.MarkDecorator:
    """Run with both, where the installed torch fails what the source commit's torch passes.

    Not strict: the floor and the newest torch releases CI runs may pass it.
    """
    return pytest.mark.parametrize(
        "ckpt",
        [
            pytest.param(
                torch_checkpoint, id="torch", marks=pytest.mark.xfail(strict=False, reason=reason)
            ),
            pytest.param(checkpointing, id="tensorhooks"),
        ],
    )


@contextlib.contextmanager
def debug_logger_restored() -> Iterator[None]:
    """The debug logger of torch's checkpoint as a fresh process has it, then as it was.

    ``debug=True`` sets the "LoggingTensor" logger not to propagate and adds a filter each time;
    pytest's capture handlers, which cannot format its records, are found attached to it after
    other tests. Each case starts from the untouched logger.
    """
    logger = logging.getLogger("LoggingTensor")
    state = (logger.propagate, logger.level, list(logger.filters), list(logger.handlers))
    logger.propagate, logger.filters, logger.handlers = True, [], []
    logger.setLevel(logging.NOTSET)
    try:
        yield
    finally:
        logger.propagate, level, logger.filters, logger.handlers = state
        logger.setLevel(level)


def is_tensorhooks(ckpt: ModuleType) -> bool:
    """Whether ``ckpt`` is tensorhooks' module (for a documented difference)."""
    return ckpt is checkpointing


@contextlib.contextmanager
def gc_disabled() -> Iterator[None]:
    """The garbage collector off: what dies here dies by reference counting alone."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
