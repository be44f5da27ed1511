"""tensorhooks' dispatch modes run their handlers without torch's per-operator Dynamo wrapper."""

from __future__ import annotations

import pytest
import torch

import tensorhooks
from tensorhooks._checkpoint.arguments import _WindowGuard
from tensorhooks._checkpoint.policies import SelectiveForward, SelectiveRecompute
from tensorhooks._checkpoint.substitution import _Substitute
from tensorhooks._core.torch_compat import TorchDispatchMode, UnwrappedDispatchMode
from tensorhooks._mutation.dispatch_mode import _CloneBeforeWriteMode
from tensorhooks._planner.recording import _RecordingMode
from tensorhooks._planner.tracing import _TraceMode

MODES = [
    _CloneBeforeWriteMode,
    _Substitute,
    _WindowGuard,
    SelectiveForward,
    SelectiveRecompute,
    _RecordingMode,
    _TraceMode,
]


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.__name__)
def test_handler_is_the_function_the_class_defines(mode: type[UnwrappedDispatchMode]) -> None:
    """The class holds its own handler, not torch's ``_disable_dynamo`` wrapper of it."""
    handler = mode.__dict__["__torch_dispatch__"]
    assert handler.__code__.co_filename.startswith(tensorhooks.__path__[0])
    assert not hasattr(handler, "__wrapped__")
    assert mode.handler_skipped_by_dynamo


def test_a_plain_torch_mode_is_still_wrapped() -> None:
    """The control: torch wraps a TorchDispatchMode's handler where it asks to be skipped."""

    class Plain(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    assert hasattr(Plain.__dict__["__torch_dispatch__"], "__wrapped__")
    with Plain():
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


def test_a_subclass_handler_runs_ops() -> None:
    """A subclass defining a handler sees every op and returns what the op returns."""
    seen: list[str] = []

    class Counting(UnwrappedDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    assert Counting.handler_skipped_by_dynamo
    with Counting():
        out = torch.ones(2) * 3
    assert torch.equal(out, torch.full((2,), 3.0))
    assert "mul.Tensor" in seen
