"""The dispatch mode: one per thread, shared by nested contexts, skipped by Dynamo."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks
from tensorhooks._mutation import dispatch_mode
from tensorhooks._mutation.context_state import MutationContext
from tests.mutation.programs import leaf_4x6

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def test_nested_contexts_share_one_dispatch_mode(monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_dispatch_mode_and_hooks_are_per_thread() -> None:
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
def test_write_during_backward(device: str) -> None:
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


def test_handler_is_not_wrapped_by_dynamo_disable() -> None:
    """Dynamo skips the handler's code, so the mode calls the plain function, unwrapped."""
    handler = dispatch_mode._CloneBeforeWriteMode.__dict__["__torch_dispatch__"]
    assert handler is dispatch_mode._torch_dispatch


# The warning that Dynamo compiles nothing here is warned once per process and pinned in
# tests/core/test_compile.py; which test meets it first depends on the order.
@pytest.mark.filterwarnings("ignore:torch.compile compiles nothing")
def test_compiled_function_inside_the_context() -> None:
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
