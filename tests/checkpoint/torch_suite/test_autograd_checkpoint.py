"""The non-reentrant and selective checkpoint tests of PyTorch's test/test_autograd.py.

Source: pytorch/pytorch, test/test_autograd.py at commit 5c322af10e52e4d236104ceefd542f34e6dcf20a
(the newest stored; no v2.13.0 tag was reachable): the checkpoint tests of TestAutograd, all of
TestNestedCheckpoint and TestSelectiveActivationCheckpoint. Each test keeps its source test's
name, program and assertions, rewritten as plain pytest (TestCase helpers became asserts and
torch.testing.assert_close, ``disable_gc`` a local context, the subTest and parametrize loops
pytest parametrization). Every test runs with ``torch.utils.checkpoint`` and with
``tensorhooks.checkpointing`` as ``ckpt``; where tensorhooks differs on purpose the test asserts
tensorhooks' behaviour and names the entry of docs/differences.md. Where the installed torch
(2.13) does not do what the source commit expects, the assertion is the one both releases meet,
and the test says so. The GPU tests are marked ``cuda``.

Not ported: test_checkpointing, test_checkpoint_valid_reset_on_error and
test_cross_device_reentrant_autograd, which test the reentrant variant only (refused by
tensorhooks by design: docs/differences.md, "use_reentrant=True is refused").
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import unittest.mock
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tensorhooks import CheckpointArgumentValueError
from tests.checkpoint.torch_suite.common import (
    IMPLEMENTATIONS,
    both,
    debug_logger_restored,
    gc_disabled,
    is_tensorhooks,
    requires_cuda,
    torch_release_fails,
)

TORCH_CHECKPOINT_SOURCE = inspect.getsource(torch.utils.checkpoint)


# Calls are counted by appending to a list, where the source rebinds ``counter[0] += 1``:
# tensorhooks runs recomputation with the bindings the call found (docs/differences.md, "A
# binding the region read, replaced before backward, is read as it was"), so a number the
# function rebinds counts forward passes only there; a list it appends to counts every run in
# both. test_a_rebound_counter_counts_forward_passes pins the difference.


def once_then(first: Callable[..., Any], then: Callable[..., Any]) -> Callable[..., Any]:
    """A function running ``first`` on its first call and ``then`` on every later one."""
    calls: list[None] = []

    def fn(*args: Any) -> Any:
        calls.append(None)
        return first(*args) if len(calls) == 1 else then(*args)

    return fn


# --- TestAutograd --------------------------------------------------------------------------------


@torch_release_fails(
    "torch 2.13 can keep the forward pass's saved tensor alive until a garbage collection "
    "(seen when the test runs first in its process)"
)
def test_custom_autograd_ac_early_stop(ckpt: ModuleType) -> None:
    """A custom Function's saved tensor recomputed with early stop dies after backward."""
    refs: list[weakref.ref[torch.Tensor]] = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            ctx.save_for_backward(y)
            refs.append(weakref.ref(y))
            return y

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> None:
            _ = ctx.saved_tensors

    inp = torch.randn(5, 5, requires_grad=True)

    def scope() -> None:
        out = ckpt.checkpoint(Test.apply, inp, use_reentrant=False)  # early stop by default
        out.sum().backward()

    with gc_disabled():
        scope()
        assert len(refs) == 2  # the forward pass and the recomputation
        assert all(ref() is None for ref in refs)


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpoint_compile_no_recompile(ckpt: ModuleType) -> None:
    """A compiled function checkpointed eagerly compiles again after a reset, never recompiles."""
    expect_fail = len(torch.overrides._get_current_function_mode_stack()) > 0

    @torch.compile(backend="aot_eager")
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos()

    x = torch.rand(10, 10, requires_grad=True)

    def run() -> None:
        ckpt.checkpoint(fn, x, use_reentrant=False).sum().backward()
        torch._dynamo.reset()
        previous = torch.get_default_device()
        try:
            torch.set_default_device("cuda")
            ckpt.checkpoint(fn, x, use_reentrant=False).sum().backward()
        finally:
            torch.set_default_device(previous)

    with unittest.mock.patch("torch._dynamo.config.error_on_recompile", True):
        if expect_fail:
            with pytest.raises(RuntimeError):
                run()
        else:
            run()


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpoint_device_context_fn(ckpt: ModuleType) -> None:
    """A recompute context that sets the default device runs around the recomputation."""

    @contextlib.contextmanager
    def apply_device(device: str) -> Iterator[None]:
        previous = torch.get_default_device()
        try:
            torch.set_default_device(device)
            yield
        finally:
            torch.set_default_device(previous)

    def context_fn() -> tuple[Any, Any]:
        return contextlib.nullcontext(), apply_device("cuda")

    with apply_device("cuda"):
        a = torch.tensor(1.0, requires_grad=True)
        out = ckpt.checkpoint(
            lambda x: x.sin().cos(), a, context_fn=context_fn, use_reentrant=False
        )
        out.backward()
    assert a.grad is not None


@pytest.mark.cuda
@requires_cuda
@both
def test_forward_traceback_preserves_exception_with_checkpoint(ckpt: ModuleType) -> None:
    """Early stop inside a custom op's forward, with CUDA memory history on, backwards cleanly."""
    with torch.library._scoped_library("_torch_suite_ckpt", "FRAGMENT"):

        @torch.library.custom_op("_torch_suite_ckpt::sin_op", mutates_args=())
        def sin_op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(inputs[0])

        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * x.cos()

        torch.library.register_autograd(
            "_torch_suite_ckpt::sin_op", backward, setup_context=setup_context
        )
        try:
            torch.cuda.memory._record_memory_history("all", stacks="python")
            x = torch.randn(4, device="cuda", requires_grad=True)
            y = ckpt.checkpoint(torch.ops._torch_suite_ckpt.sin_op, x, use_reentrant=False)
            y.sum().backward()
        finally:
            torch.cuda.memory._record_memory_history(None)
    torch.testing.assert_close(x.grad, x.detach().cos())


def autocast_matmuls(ckpt: ModuleType, device_type: str) -> None:
    """The source's _test_checkpointing_non_reentrant_autocast: recomputation in bfloat16."""
    for enabled in (True, False):

        def foo(
            x: torch.Tensor,
            y: torch.Tensor,
            z: torch.Tensor,
            expected_dtype: torch.dtype = torch.bfloat16 if enabled else torch.float32,
        ) -> torch.Tensor:
            x = torch.mm(x, y)  # mm runs in the autocast dtype
            y = torch.mm(x, z)
            z = torch.mm(z, z)
            assert z.dtype == expected_dtype  # also in recomputation
            return z

        x, y, z = (torch.randn(3, 3, requires_grad=True) for _ in range(3))
        if device_type == "cuda":
            x, y, z = x.cuda(), y.cuda(), z.cuda()
        with torch.autocast(enabled=enabled, device_type=device_type, dtype=torch.bfloat16):
            loss = ckpt.checkpoint(foo, x, y, z, use_reentrant=False).sum()
        loss.backward()  # mismatched dtypes would raise here without autocast replayed


@both
def test_checkpointing_non_reentrant_autocast_cpu(ckpt: ModuleType) -> None:
    """Recomputation runs under the CPU autocast state of the forward pass."""
    autocast_matmuls(ckpt, "cpu")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs CUDA bf16"
)
@both
def test_checkpointing_non_reentrant_autocast_gpu(ckpt: ModuleType) -> None:
    """Recomputation runs under the CUDA autocast state of the forward pass."""
    autocast_matmuls(ckpt, "cuda")


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpointing_without_reentrant_memory_savings(ckpt: ModuleType) -> None:
    """Eight checkpointed blocks of three Linear(256) peak lower than the same blocks plain."""

    class MyModel(nn.Module):
        def __init__(self, n: int, use_checkpoint: bool) -> None:
            super().__init__()
            self.use_checkpoint = use_checkpoint
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
                for _ in range(n)
            )
            for layer in self.layers:  # gradients allocated up front: the peak is activations
                for linear in layer:
                    linear.weight.grad = torch.ones_like(linear.weight)
                    linear.bias.grad = torch.ones_like(linear.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = (
                    ckpt.checkpoint(layer, x, use_reentrant=False)
                    if self.use_checkpoint
                    else layer(x)
                )
            return x

    x = torch.randn(100, 256, requires_grad=True, device="cuda")
    peaks = []
    for use_checkpoint in (False, True):
        model = MyModel(8, use_checkpoint).cuda()
        torch.cuda.reset_peak_memory_stats()
        model(x.clone()).sum().backward()
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] < peaks[0]


@both
def test_checkpointing_without_reentrant_custom_function_works(ckpt: ModuleType) -> None:
    """A custom Function reads its saved tensors once per backward; a second read raises."""

    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
            x, y, z, _, _ = ctx.saved_tensors
            # recomputed tensors are handed out once: a second read in the same graph task raises
            with pytest.raises(ckpt.CheckpointError, match="unpacked"):
                _ = ctx.saved_tensors
            return x, y, z

    x = torch.tensor(1.0, requires_grad=True)
    y = torch.tensor(2.0, requires_grad=True)
    z = torch.tensor(3.0, requires_grad=True)

    def foo(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return MyFunc.apply(x * y * z, y * y * z, z * z)

    ckpt.checkpoint(foo, x, y, z, use_reentrant=False).sum().backward()
    assert x.grad is not None


class Verbose(TorchDispatchMode):
    """Records the name of every op that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.operators: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operators.append(func.__name__)
        return func(*args, **(kwargs or {}))


@both
def test_checkpointing_without_reentrant_with_context_fn(ckpt: ModuleType) -> None:
    """context_fn's first context wraps the forward pass, its second the recomputation.

    With ``use_reentrant=True`` torch refuses the context_fn; tensorhooks refuses the variant
    itself (docs/differences.md, "use_reentrant=True is refused; left out, it warns and means
    False").
    """
    x = torch.tensor(1.0, requires_grad=True)
    verbose = Verbose()
    ckpt.checkpoint(
        lambda x: x.exp(),
        x,
        use_reentrant=False,
        context_fn=lambda: (verbose, contextlib.nullcontext()),
    )
    assert verbose.operators == ["exp.default"]

    verbose.operators = []

    def context_fn() -> tuple[Any, Any]:
        return contextlib.nullcontext(), verbose

    out = ckpt.checkpoint(lambda x: x.exp(), x, use_reentrant=False, context_fn=context_fn)
    out.backward()
    assert verbose.operators == ["exp.default", "detach.default"]

    refusal = (
        pytest.raises(CheckpointArgumentValueError, match="use_reentrant=True is not supported")
        if is_tensorhooks(ckpt)
        else pytest.raises(Exception, match="only supported when use_reentrant=False")
    )
    with refusal:
        ckpt.checkpoint(lambda x: x.sin(), x, use_reentrant=True, context_fn=context_fn)


@both
def test_checkpoint_warns_if_use_reentrant_not_passed_explcitly(ckpt: ModuleType) -> None:
    """use_reentrant=False is silent; left out, a UserWarning asks to pass it."""
    a = torch.randn(1, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.checkpoint(lambda x: x, a, use_reentrant=False)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly"):
        ckpt.checkpoint(lambda x: x, a)


@both
def test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly(
    ckpt: ModuleType,
) -> None:
    """The same for checkpoint_sequential."""
    a = torch.randn(3, requires_grad=True)
    modules = [nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.checkpoint_sequential(modules, 3, a, use_reentrant=False)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly"):
        ckpt.checkpoint_sequential(modules, 3, a)


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "GraphExecGroup"), reason="GraphExecGroup is new in torch"
)
@both
def test_checkpoint_graph_execution_group(ckpt: ModuleType) -> None:
    """Under a GraphExecGroup torch recomputes once for two backward calls, and refuses overlap.

    tensorhooks recomputes once per backward call and the group has no effect
    (docs/differences.md, "GraphExecGroup: recomputation per backward call"): three runs of the
    function with or without the group, and an overlapping second backward is allowed.
    """
    in_group_runs = 3 if is_tensorhooks(ckpt) else 2

    counter: list[None] = []

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counter.append(None)
        y = x.sin().cos()
        z = y.sin().cos()
        return y, z

    for use_group, expected_runs in ((True, in_group_runs), (False, 3)):
        counter.clear()
        x = torch.randn(3, 3, requires_grad=True)
        y, z = ckpt.checkpoint(fn, x, use_reentrant=False)
        with ckpt.GraphExecGroup() if use_group else contextlib.nullcontext():
            (grad_y,) = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
            torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
        assert len(counter) == expected_runs

    x = torch.randn(3, 3, requires_grad=True)
    out = ckpt.checkpoint(lambda x: x.sin().cos(), x, use_reentrant=False)
    with ckpt.GraphExecGroup():
        out.sum().backward(retain_graph=True)
        if is_tensorhooks(ckpt):
            out.sum().backward()
        else:
            with pytest.raises(RuntimeError, match="Performing two backward calls that overlap"):
                out.sum().backward()


def save_3_tensors(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def save_2_tensors(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def save_2_tensors_alt(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * torch.tensor([1.0, 2.0])


class Mismatch(NamedTuple):
    """One case of the source's test_checkpoint_detects_non_determinism."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    recomputation: Callable[[torch.Tensor], torch.Tensor]
    options: dict[str, Any]
    around: tuple[str, bool] | None  # a context manager of the module, and its argument
    message: str  # torch's
    tensorhooks_says: str | None  # what tensorhooks says instead: why its case xfails


DEBUG_MESSAGE = "You are seeing this error because you passed `debug=True` to checkpoint"
MISMATCHES = {
    "fewer": Mismatch(
        save_3_tensors,
        save_2_tensors,
        {},
        None,
        "A different number of tensors was saved",
        None,
    ),
    "more without early stop": Mismatch(
        save_2_tensors,
        save_3_tensors,
        {},
        ("set_checkpoint_early_stop", False),
        "trying to save more tensors during recomputation",
        None,
    ),
    "metadata": Mismatch(
        save_2_tensors,
        save_2_tensors_alt,
        {},
        None,
        "tensors have different metadata",
        None,
    ),
    "debug": Mismatch(
        save_2_tensors, save_2_tensors_alt, {"debug": True}, None, DEBUG_MESSAGE, None
    ),
    "debug enabled globally": Mismatch(
        save_2_tensors,
        save_2_tensors_alt,
        {"debug": False},
        ("set_checkpoint_debug_enabled", True),
        DEBUG_MESSAGE,
        None,
    ),
    "debug disabled globally": Mismatch(
        save_2_tensors,
        save_2_tensors_alt,
        {"debug": True},
        ("set_checkpoint_debug_enabled", False),
        "Recomputed values for the following tensors have",
        None,
    ),
}


def mismatch_cases() -> list[Any]:
    """The source test's cases, each with both modules; torch's wording xfails on tensorhooks."""
    cases = []
    for case, mismatch in MISMATCHES.items():
        for name, module in IMPLEMENTATIONS.items():
            marks = []
            if name == "tensorhooks" and mismatch.tensorhooks_says is not None:
                reason = f"recomputation.py's CheckpointError {mismatch.tensorhooks_says}"
                marks = [pytest.mark.xfail(strict=True, reason=reason)]
            cases.append(pytest.param(module, mismatch, id=f"{case}-{name}", marks=marks))
    return cases


@pytest.mark.parametrize(("ckpt", "mismatch"), mismatch_cases())
def test_checkpoint_detects_non_determinism(ckpt: ModuleType, mismatch: Mismatch) -> None:
    """A recomputation saving fewer, more or other tensors raises CheckpointError, with debug logs.

    One parameter per case of the source test, in its order; the debug cases use torch's own
    operator logs in both modules.
    """
    around: Any = contextlib.nullcontext()
    if mismatch.around is not None:
        around = getattr(ckpt, mismatch.around[0])(mismatch.around[1])
    fn = once_then(mismatch.forward, mismatch.recomputation)
    a = torch.randn(1, requires_grad=True)
    with (
        debug_logger_restored(),
        around,
        pytest.raises(ckpt.CheckpointError, match=mismatch.message),
    ):
        ckpt.checkpoint(fn, a, use_reentrant=False, **mismatch.options).backward()


@both
def test_checkpoint_detects_non_determinism_more_with_early_stop(ckpt: ModuleType) -> None:
    """With early stop (the default) a recomputation saving more tensors is not an error."""
    a = torch.randn(1, requires_grad=True)
    fn = once_then(save_2_tensors, save_3_tensors)
    ckpt.checkpoint(fn, a, use_reentrant=False).backward()
    torch.testing.assert_close(a.grad, a.detach().sin().exp() * a.detach().cos())


@both
def test_access_saved_tensor_twice_without_recomputation_works(ckpt: ModuleType) -> None:
    """Reading a saved tensor outside backward recomputes each time; backward frees it."""
    count: list[None] = []

    def foo(a: torch.Tensor) -> torch.Tensor:
        count.append(None)
        b = a * a
        _ = a * b
        return torch.exp(a)

    a = torch.randn(5, requires_grad=True)
    d = ckpt.checkpoint(foo, a, use_reentrant=False)
    assert len(count) == 1
    d.grad_fn._saved_result  # noqa: B018 (the read recomputes)
    assert len(count) == 2
    d.grad_fn._saved_result  # noqa: B018 (the read recomputes again)
    assert len(count) == 3
    d.sum().backward()
    assert len(count) == 4
    with pytest.raises(RuntimeError, match="directly access saved tensors after they have"):
        d.grad_fn._saved_result  # noqa: B018 (the read raises)


@pytest.mark.parametrize("input_requires_grad", [True, False])
@both
def test_checkpointing_without_reentrant(ckpt: ModuleType, input_requires_grad: bool) -> None:
    """Many calls of a module with a keyword input give plain autograd's parameter gradients.

    The source runs 2000 inputs through a Linear(10, 1000) bottleneck (a slow test); 50 of them
    here keep the suite fast and test the same thing.
    """

    class MyModule(nn.Module):
        def __init__(self, mod: nn.Module) -> None:
            super().__init__()
            self.module = mod

        def forward(self, data: torch.Tensor) -> torch.Tensor:
            return self.module(data)

    module = MyModule(nn.Sequential(nn.Linear(10, 1000), nn.ReLU(), nn.Linear(1000, 10)))
    module_copy = copy.deepcopy(module)
    checkpointed, plain = [], []
    for _ in range(50):
        data = torch.empty(1, 10).uniform_()
        data.requires_grad = input_requires_grad
        checkpointed.append(ckpt.checkpoint(module, data=data, use_reentrant=False))
        plain.append(module_copy(data))
    torch.stack(checkpointed).mean().backward()
    torch.stack(plain).mean().backward()
    for param, expected in zip(module.parameters(), module_copy.parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected.grad)


@both
def test_checkpointing_without_reentrant_detached_tensor(ckpt: ModuleType) -> None:
    """A region whose output does not require grad runs, three times, without an error."""

    class NoGradModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)
            self.lin2 = nn.Linear(2, 2, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.lin2(self.linear(x))

    module = NoGradModule()
    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        out = ckpt.checkpoint(module, a, use_reentrant=False)
        assert not out.requires_grad
        out += a  # so that the loss requires grad
        out.sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2, 2), 3.0))


@both
def test_checkpointing_without_reentrant_saved_object_identity(ckpt: ModuleType) -> None:
    """A saved input that does not require grad comes back as the same object."""
    seen: list[torch.Tensor] = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            seen.append(ctx.saved_tensors[0])
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    assert seen[-1] is b
    ckpt.checkpoint(Test.apply, a, b, use_reentrant=False).backward()
    assert seen[-1] is b


@both
def test_checkpointing_without_reentrant_correct_grad(ckpt: ModuleType) -> None:
    """backward() and autograd.grad() through a region give plain autograd's gradient."""
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    expected = a.grad
    a.grad = None
    ckpt.checkpoint(torch.exp, a, use_reentrant=False).sum().backward()
    with_backward = a.grad
    a.grad = None
    (with_grad,) = torch.autograd.grad(
        ckpt.checkpoint(torch.exp, a, use_reentrant=False).sum(), (a,)
    )
    torch.testing.assert_close(with_backward, expected)
    torch.testing.assert_close(with_grad, expected)


@both
def test_checkpointing_without_reentrant_dataparallel(ckpt: ModuleType) -> None:
    """A DataParallel module checkpointed gives the plain module's input gradient."""

    class LinearModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return self.linear(inp)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(2, 2, requires_grad=True, device=device)
    model = LinearModule().to(device)
    copy.deepcopy(model)(a).sum().backward()
    expected = a.grad
    a.grad = None
    module = nn.DataParallel(copy.deepcopy(model))
    ckpt.checkpoint(module, a, use_reentrant=False).sum().backward()
    torch.testing.assert_close(a.grad, expected)


@both
def test_checkpointing_without_reentrant_parameter_used_in_an_out(ckpt: ModuleType) -> None:
    """A weight used inside and outside a region gets one gradient hook call."""
    w = torch.randn(10, 10, requires_grad=True)
    count = [0]

    def hook(grad: torch.Tensor) -> None:
        count[0] += 1

    w.register_hook(hook)
    x = torch.rand(10, 10, requires_grad=True)
    h = w * x  # w outside the region
    out = ckpt.checkpoint(lambda x: w * x, h, use_reentrant=False)  # and inside
    out.sum().backward()
    assert count[0] == 1


@both
def test_checkpointing_without_reentrant_arbitrary_input_output(ckpt: ModuleType) -> None:
    """A module taking and returning dicts gives plain autograd's output and gradients."""

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(5, 5, bias=False)

        def forward(self, dict_input: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"result": self.layer(dict_input["tensor"])}

    plain = MyModel()
    checkpointed = copy.deepcopy(plain)
    inp = {"tensor": torch.randn(5, 5)}
    out_plain = plain(inp)["result"].sum()
    out_checkpoint = ckpt.checkpoint(checkpointed, inp, use_reentrant=False)["result"].sum()
    torch.testing.assert_close(out_checkpoint, out_plain)
    out_plain.backward()
    out_checkpoint.backward()
    for param, expected in zip(checkpointed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected.grad)


@both
def test_save_on_cpu_and_checkpoint(ckpt: ModuleType) -> None:
    """A region inside torch's save_on_cpu, and save_on_cpu inside a region: plain gradients."""
    a = torch.randn(2, 2, requires_grad=True)
    a.pow(2).pow(2).pow(2).pow(2).sum().backward()
    expected = a.grad.clone()  # type: ignore[union-attr]
    a.grad.zero_()  # type: ignore[union-attr]

    with torch.autograd.graph.save_on_cpu():
        h = a.pow(2)
        h = ckpt.checkpoint(lambda x: x.pow(2).pow(2), h, use_reentrant=False)
        c = h.pow(2)
    c.sum().backward()
    outer = a.grad.clone()  # type: ignore[union-attr]
    a.grad.zero_()  # type: ignore[union-attr]

    def f(a: torch.Tensor) -> torch.Tensor:
        h = a.pow(2)
        with torch.autograd.graph.save_on_cpu():
            h = h.pow(2).pow(2)
        return h.pow(2)

    ckpt.checkpoint(f, a, use_reentrant=False).sum().backward()
    torch.testing.assert_close(outer, expected)
    torch.testing.assert_close(a.grad, expected)


@both
def test_context_fn_suppressing_the_forward_exception(ckpt: ModuleType) -> None:
    """A forward context that swallows the function's error raises torch's RuntimeError.

    Not a test of the source file: torch.utils.checkpoint.checkpoint's own check ("the forward
    context provided by context_fn suppressed an exception"), pinned here with the rest.
    """

    class Swallow:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> bool:
            return True

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the function failed")

    if not is_tensorhooks(ckpt) and "suppressed an exception" not in TORCH_CHECKPOINT_SOURCE:
        pytest.skip("this torch release does not check a suppressed forward exception")
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="suppressed an exception"):
        ckpt.checkpoint(
            fails, x, use_reentrant=False, context_fn=lambda: (Swallow(), contextlib.nullcontext())
        )


# --- TestNestedCheckpoint ------------------------------------------------------------------------

Fn = Callable[..., torch.Tensor]


def grad(fn: Fn) -> Fn:
    """The gradient of ``fn`` as a function, with a graph (so it can be differentiated again)."""

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def summed(fn: Fn) -> Fn:
    return lambda x: fn(x).sum()


def checkpointed(ckpt: ModuleType) -> Callable[[Fn], Fn]:
    """A wrapper running a function inside a non-reentrant checkpoint of ``ckpt``."""

    def wrap(fn: Fn) -> Fn:
        return lambda *args, **kwargs: ckpt.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrap


def nestings(ckpt: ModuleType, fn: Fn) -> list[tuple[Fn, list[Fn]]]:
    """Each function of grad nesting depth 0 to 3, with versions wrapped in checkpoints."""
    c = checkpointed(ckpt)
    return [
        (fn, [c(fn), c(c(fn))]),
        (grad(fn), [grad(c(fn)), grad(c(c(fn)))]),
        (grad(grad(fn)), [grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn))))]),
        (grad(grad(grad(fn))), [grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn))))))]),
    ]


def check_graph_dies(fn: Fn) -> None:
    """Every node of ``fn``'s graph is freed once its output goes out of scope."""

    class Handle:
        def __init__(self, name: str) -> None:
            self.name = name

    def nodes(root: Any) -> Iterator[Any]:
        seen = {root}
        queue = collections.deque([root])
        while queue:
            node = queue.popleft()
            for following, _ in node.next_functions:
                if following is not None and following not in seen:
                    seen.add(following)
                    queue.append(following)
            yield node

    def scope() -> list[weakref.ref[Handle]]:
        out = fn(torch.randn((), requires_grad=True))
        refs = []
        for node in nodes(out.grad_fn):
            handle = Handle(node.name())
            refs.append(weakref.ref(handle))
            node.metadata["blah"] = handle
        return refs

    alive = [handle.name for ref in scope() if (handle := ref()) is not None]
    assert alive == []


early_stops = pytest.mark.parametrize("early_stop", [True, False])


def plain_chain(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def grads_inside(x: torch.Tensor) -> torch.Tensor:
    """Backward inside the region: two autograd.grad calls, then a sin."""
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    torch.autograd.grad(a, x)
    torch.autograd.grad(b, x)
    return x.sin()


def nested_cases() -> list[Any]:
    """The source test's loop over its two functions and four grad depths, one case each."""
    cases = []
    for function in (plain_chain, grads_inside):
        for depth in range(4):
            for name, module in IMPLEMENTATIONS.items():
                marks: list[Any] = []
                case_id = f"{function.__name__}-depth{depth}-{name}"
                cases.append(pytest.param(module, function, depth, id=case_id, marks=marks))
    return cases


@early_stops
@pytest.mark.parametrize(("ckpt", "function", "depth"), nested_cases())
def test_nested_checkpoint(ckpt: ModuleType, function: Fn, depth: int, early_stop: bool) -> None:
    """Checkpoints nested in checkpoints and in grad give plain values; their graphs die."""
    with ckpt.set_checkpoint_early_stop(early_stop):
        x = torch.randn((), requires_grad=True)
        expected_fn, actual_fns = nestings(ckpt, function)[depth]
        expected = expected_fn(x)
        for actual_fn in actual_fns:
            torch.testing.assert_close(actual_fn(x), expected)
            check_graph_dies(actual_fn)


@early_stops
@both
def test_nested_checkpoint_two_children(ckpt: ModuleType, early_stop: bool) -> None:
    """A region holding two checkpointed children, under double grad: plain values, graphs die."""
    c = checkpointed(ckpt)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin().exp().sin()

    def g(x: torch.Tensor) -> torch.Tensor:
        return x.cos().sin().exp()

    def hc(x: torch.Tensor) -> torch.Tensor:
        return c(g)(c(f)(x))

    def h(x: torch.Tensor) -> torch.Tensor:
        return g(f(x))

    with ckpt.set_checkpoint_early_stop(early_stop):
        a = torch.randn(3, 3, requires_grad=True)
        expected = grad(summed(grad(summed(h))))(a)
        torch.testing.assert_close(grad(summed(grad(summed(c(hc)))))(a), expected)
        torch.testing.assert_close(grad(summed(c(grad(summed(c(hc))))))(a), expected)
        check_graph_dies(grad(c(hc)))
        check_graph_dies(grad(summed(grad(summed(c(hc))))))
        check_graph_dies(grad(summed(c(grad(summed(c(hc)))))))


@early_stops
@both
def test_nested_checkpoint_non_tensor_inputs_and_outputs(
    ckpt: ModuleType, early_stop: bool
) -> None:
    """Non-tensor arguments (an int, a function) and outputs pass through; plain gradients."""

    def fn(k: int, a: torch.Tensor, b: torch.Tensor, f: Fn) -> tuple[torch.Tensor, int, str]:
        return f(k * a * b.exp()), 1, "abcd"

    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    with ckpt.set_checkpoint_early_stop(early_stop):
        out, one, text = ckpt.checkpoint(fn, 3, a, b, torch.sin, use_reentrant=False)
    assert (one, text) == (1, "abcd")
    actual = torch.autograd.grad(out, (a, b))
    expected = torch.autograd.grad(fn(3, a, b, torch.sin)[0], (a, b))
    torch.testing.assert_close(actual, expected)


@early_stops
@both
def test_nested_checkpoint_kwargs(ckpt: ModuleType, early_stop: bool) -> None:
    """A tensor passed by keyword gets plain autograd's gradient."""

    def fn(a: torch.Tensor, blah: torch.Tensor | None = None) -> torch.Tensor:
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    with ckpt.set_checkpoint_early_stop(early_stop):
        actual = torch.autograd.grad(ckpt.checkpoint(fn, a, blah=b, use_reentrant=False), (a, b))
        expected = torch.autograd.grad(fn(a, blah=b), (a, b))
    torch.testing.assert_close(actual, expected)


@early_stops
@both
def test_nested_checkpoint_same_graph(ckpt: ModuleType, early_stop: bool) -> None:
    """A hook on a node of the region's graph fires once: backward runs the original graph."""
    counter = [0]

    def hook(*_: Any) -> None:
        counter[0] += 1

    a = torch.tensor(1.0, requires_grad=True)
    with ckpt.set_checkpoint_early_stop(early_stop):
        out = ckpt.checkpoint(lambda a: a.sin().cos().sin(), a, use_reentrant=False)
    out.grad_fn.next_functions[0][0].register_hook(hook)
    out.backward()
    assert counter[0] == 1


@early_stops
@both
def test_nested_checkpoint_reentrant_backwards(ckpt: ModuleType, early_stop: bool) -> None:
    """A backward started from a node hook of the region (a nested graph task) runs."""

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = a.sin().cos()
        return x, x.sin()

    def hook(*_: Any) -> None:
        x.backward(retain_graph=True)  # skips the part of the graph holding the hook

    a = torch.tensor(1.0, requires_grad=True)
    with ckpt.set_checkpoint_early_stop(early_stop):
        x, out = ckpt.checkpoint(fn, a, use_reentrant=False)
    out.grad_fn.register_hook(hook)
    out.backward(retain_graph=True)
    plain_x, plain_out = fn(a)
    (expected,) = torch.autograd.grad(plain_x + plain_out, a)  # the hook's backward and the main
    torch.testing.assert_close(a.grad, expected)


@both
def test_nested_checkpoint_set_early_stop(ckpt: ModuleType) -> None:
    """early_stop and set_checkpoint_early_stop decide whether recomputation runs to the end.

    The context manager in force at the call wins over the argument, even when backward runs
    after it exited, and the innermost one counts.
    """
    counter = [0]

    def clone(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return x.clone()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return clone(x.sin().cos())  # clone saves nothing: with early stop it is not rerun

    def runs(context: Any, **options: Any) -> int:
        counter[0] = 0
        a = torch.tensor(1.0, requires_grad=True)
        with context:
            out = ckpt.checkpoint(fn, a, use_reentrant=False, **options)
        out.backward()
        return counter[0]

    none = contextlib.nullcontext()
    stop = ckpt.set_checkpoint_early_stop
    assert runs(none) == 1  # early stop is the default
    assert runs(none, early_stop=False) == 2
    assert runs(none, early_stop=True) == 1
    assert runs(stop(False)) == 2
    assert runs(stop(True)) == 1
    nested = contextlib.ExitStack()
    nested.enter_context(stop(False))
    nested.enter_context(stop(True))
    assert runs(nested, early_stop=False) == 1
    assert runs(stop(False), early_stop=True) == 2
    assert runs(stop(True), early_stop=False) == 1


class SinCounter(TorchDispatchMode):
    """Counts the sin ops that reach the backend."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func is torch.ops.aten.sin.default
        return func(*args, **(kwargs or {}))


@both
def test_nested_checkpoint_set_early_stop_no_recompution_needed(ckpt: ModuleType) -> None:
    """Early stop ends recomputation before any op when only the input is saved.

    The function still runs again in Python (the stop is at the autograd level), so the Python
    counter is 2 either way; its sin reaches the backend only without early stop. A region that
    saves nothing is never recomputed.
    """
    counter: list[None] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        counter.append(None)
        return x.sin()

    for early_stop, backend_sins in ((True, 1), (False, 2)):
        counter.clear()
        a = torch.tensor(1.0, requires_grad=True)
        with SinCounter() as sins:
            with ckpt.set_checkpoint_early_stop(early_stop):
                out = ckpt.checkpoint(fn, a, use_reentrant=False)
            out.backward()
        assert (len(counter), sins.count) == (2, backend_sins)

    def saves_nothing(x: torch.Tensor) -> torch.Tensor:
        counter.append(None)
        return x.clone()

    for early_stop in (True, False):
        counter.clear()
        a = torch.tensor(1.0, requires_grad=True)
        with ckpt.set_checkpoint_early_stop(early_stop):
            out = ckpt.checkpoint(saves_nothing, a, use_reentrant=False)
        out.backward()
        assert len(counter) == 1


# --- TestSelectiveActivationCheckpoint -----------------------------------------------------------


def selective(ckpt: ModuleType, policy: Any, **options: Any) -> Callable[[], Any]:
    """A context_fn of ``ckpt``'s create_selective_checkpoint_contexts with ``policy``."""
    return functools.partial(ckpt.create_selective_checkpoint_contexts, policy, **options)


def save_op(ckpt: ModuleType, op: Any) -> Callable[..., Any]:
    """A policy saving the outputs of ``op`` and recomputing every other op."""

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        saved = func == op
        return ckpt.CheckpointPolicy.MUST_SAVE if saved else ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


@pytest.mark.cuda
@requires_cuda
@both
def test_flops_and_mem(ckpt: ModuleType) -> None:
    """Saving the matmul (as a list, a policy or a bool policy) keeps 1 MiB, recomputes no mm."""

    def activation_mib(f: Callable[[], torch.Tensor]) -> float:
        f().backward()  # warm up the allocator
        start = torch.cuda.memory_stats()["requested_bytes.all.current"]
        out = f()
        held = torch.cuda.memory_stats()["requested_bytes.all.current"] - start
        out.backward()
        return held / (1024 * 1024)

    def backward_flops(f: Callable[[], torch.Tensor]) -> float:
        f().backward()
        out = f()
        with FlopCounterMode(display=False) as mode:  # sees whether an op is answered from cache
            out.backward()
        return mode.get_total_flops() / (512**3 * 2)  # a 512 square matmul counts 1

    x = torch.randn(512, 512, requires_grad=True, device="cuda")
    y = torch.randn(512, 512, requires_grad=True, device="cuda")

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.cos(), y).sin().sum()

    mm = torch.ops.aten.mm.default
    runs = {
        "none": lambda: fn(x, y),
        "full": lambda: ckpt.checkpoint(fn, x, y, use_reentrant=False),
    }
    for name, policy in (
        ("list", [mm]),
        ("policy", save_op(ckpt, mm)),
        ("bool", lambda ctx, op, *args, **kwargs: op == mm),
    ):
        context_fn = selective(ckpt, policy)
        runs[name] = lambda context_fn=context_fn: ckpt.checkpoint(
            fn, x, y, use_reentrant=False, context_fn=context_fn
        )
    expected = {
        "none": (2.0, 2.0),
        "full": (0.0, 3.0),
        "list": (1.0, 2.0),
        "policy": (1.0, 2.0),
        "bool": (1.0, 2.0),
    }
    for name, run in runs.items():
        assert (activation_mib(run), backward_flops(run)) == pytest.approx(expected[name]), name


@both
def test_output_already_has_autograd_meta(ckpt: ModuleType) -> None:
    """A policy saving a view of an integer tensor (which has autograd metadata) runs."""

    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(-1), y.sin().cos()

    x = torch.tensor([1, 2, 3], dtype=torch.int64)
    y = torch.randn(3, requires_grad=True)
    context_fn = selective(ckpt, [torch.ops.aten.view.default])
    out = ckpt.checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)
    out[1].sum().backward()
    torch.testing.assert_close(y.grad, -y.detach().sin().sin() * y.detach().cos())


@both
def test_subclass_dispatching_sizes(ckpt: ModuleType) -> None:
    """Metadata ops a subclass dispatches (sym_size) are never cached, whatever the policy says.

    Caching one would hand recomputation a stale shape: the second view saves its input's shape
    [12], and must save it again in recomputation.
    """

    class SizesTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, inner: torch.Tensor) -> SizesTensor:
            return torch.Tensor._make_wrapper_subclass(  # type: ignore[no-any-return]
                cls,
                inner.size(),
                inner.stride(),
                None,
                None,
                inner.dtype,
                inner.layout,
                inner.device,
                False,
                inner.requires_grad,
                "sizes",
            )

        def __init__(self, inner: torch.Tensor) -> None:
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
            unwrapped = torch.utils._pytree.tree_map_only(cls, lambda t: t.inner, args)
            out = func(*unwrapped, **(kwargs or {}))
            return torch.utils._pytree.tree_map_only(torch.Tensor, cls, out)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op is torch.ops.aten.sym_size.default:
            return ckpt.CheckpointPolicy.MUST_SAVE  # silently ignored
        return ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x: torch.Tensor) -> torch.Tensor:
        view_out = (x * x.sum()).view(-1).view(4, 3)
        assert view_out.grad_fn._saved_self_sym_sizes == (12,)
        return view_out.exp()

    x = SizesTensor(torch.randn(4, 3, requires_grad=True))
    context_fn = selective(ckpt, policy_fn)
    out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    assert x.grad is not None


@both
def test_bad_inputs(ckpt: ModuleType) -> None:
    """A non-op or an op packet in the list is a ValueError, a non-callable a TypeError."""
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload"):
        ckpt.create_selective_checkpoint_contexts([2])
    with pytest.raises(ValueError, match="update the OpOverloadPacket to a specific OpOverload"):
        ckpt.create_selective_checkpoint_contexts([torch.ops.aten.sin])
    with pytest.raises(TypeError, match=r"either a function or a list of ops\."):
        ckpt.create_selective_checkpoint_contexts(2)


@both
def test_policy_with_state(ckpt: ModuleType) -> None:
    """A stateful policy's state is shared by the forward pass and the recomputation.

    The source commit's torch asks the policy in recomputation too, with ``is_recompute`` set:
    its counter restarts and stops early, [1, 2, 3, 1, 2]. torch 2.13 answers recomputation from
    what the forward pass filed and asks no more: [1, 2, 3]. Either is accepted, nothing else.
    """
    counters: list[int] = []

    class Policy:
        def __init__(self) -> None:
            self.counter = [0]
            self.recompute_counter = [0]

        def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            counter = self.recompute_counter if ctx.is_recompute else self.counter
            counter[0] += 1
            counters.append(counter[0])
            return ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(3, requires_grad=True)
    context_fn = selective(ckpt, Policy(), allow_cache_entry_mutation=True)
    out = ckpt.checkpoint(
        lambda x: x.sin().sin().sin(), x, use_reentrant=False, context_fn=context_fn
    )
    out.sum().backward()
    assert counters in ([1, 2, 3, 1, 2], [1, 2, 3])


@both
def test_storage_lifetime(ckpt: ModuleType) -> None:
    """What a policy saves dies with the graph, and after backward even with retain_graph.

    The source reads torch's private caching mode's storage; this reads the saved output's
    storage through a weak reference instead, which works for any implementation.
    """
    refs: list[StorageWeakRef] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = x.cos().exp()
        if not refs:  # the forward pass, not the recomputation
            refs.append(StorageWeakRef(out.untyped_storage()))
        return out.sin()  # careful with early stop: the exp output is needed

    def save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return ckpt.CheckpointPolicy.MUST_SAVE

    with gc_disabled():
        # the graph dies without backward: no cycle keeps the saved output
        out = ckpt.checkpoint(
            fn,
            torch.randn(3, requires_grad=True),
            use_reentrant=False,
            context_fn=selective(ckpt, save_all),
        )
        assert not refs[0].expired()
        del out
        assert refs[0].expired()

        # after backward, even with retain_graph=True, the saved output is gone
        refs.clear()
        out = ckpt.checkpoint(
            fn,
            torch.randn(3, requires_grad=True),
            use_reentrant=False,
            context_fn=selective(ckpt, save_all),
        )
        assert not refs[0].expired()
        out.sum().backward(retain_graph=True)
        assert refs[0].expired()


@both
def test_version_counter(ckpt: ModuleType) -> None:
    """A saved output changed in place raises in backward, unless cache entries may change.

    torch says "Tensor cached during selective activation checkpoint has been mutated";
    tensorhooks raises autograd's in-place error naming the op and the policy
    (docs/differences.md, checkpoint, "Errors").
    """

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().mul_(2).cos().exp()

    policy = save_op(ckpt, torch.ops.aten.sin.default)
    x = torch.randn(3, requires_grad=True)
    out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=selective(ckpt, policy))
    message = "modified by an inplace operation" if is_tensorhooks(ckpt) else "has been mutated"
    with pytest.raises(RuntimeError, match=message):
        out.sum().backward()

    x = torch.randn(3, requires_grad=True)
    context_fn = selective(ckpt, policy, allow_cache_entry_mutation=True)
    out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    assert x.grad is not None


@both
def test_function_with_more_than_one_output(ckpt: ModuleType) -> None:
    """An op with two outputs (var_mean) is saved whole: plain autograd's gradient.

    The source expects the policy asked twice (forward pass and recomputation); torch 2.13 asks
    it once, in the forward pass (see test_policy_with_state).
    """
    calls = {False: 0, True: 0}

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op == torch.ops.aten.var_mean.correction:
            calls[ctx.is_recompute] += 1
            return ckpt.CheckpointPolicy.MUST_SAVE
        return ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = torch.var_mean(x)
        return a * b

    x = torch.randn(3, requires_grad=True)
    out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=selective(ckpt, policy_fn))
    x_grad = torch.autograd.grad(out.sum(), (x,))
    torch.testing.assert_close(x_grad, torch.autograd.grad(fn(x).sum(), (x,)))
    assert calls[False] == 1
    assert calls[True] <= 1


@both
def test_function_with_non_tensor_output(ckpt: ModuleType, request: pytest.FixtureRequest) -> None:
    """A saved custom op returning a tensor and an int is not run again in recomputation."""
    namespace = f"torch_suite_{request.node.callspec.id}"
    with torch.library._scoped_library(namespace, "FRAGMENT"):
        counter = [0]

        @torch.library.custom_op(f"{namespace}::sin_with_extra", mutates_args=())
        def sin_with_extra(x: torch.Tensor) -> tuple[torch.Tensor, int]:
            counter[0] += 1
            return x.sin(), 2

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(inputs[0])

        def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * x.cos()

        torch.library.register_autograd(
            f"{namespace}::sin_with_extra", backward, setup_context=setup_context
        )
        op = getattr(torch.ops, namespace).sin_with_extra

        def fn(x: torch.Tensor) -> torch.Tensor:
            return (op(x)[0] * x.sin().exp()).sin()

        x = torch.randn(3, requires_grad=True)
        context_fn = selective(ckpt, [op.default])
        out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
        x_grad = torch.autograd.grad(out.sum(), (x,))
        assert counter[0] == 1
        torch.testing.assert_close(x_grad, torch.autograd.grad(fn(x).sum(), (x,)))


@both
def test_can_only_trigger_recompute_once(ckpt: ModuleType) -> None:
    """A second backward over a retained selective region: torch raises, tensorhooks runs it.

    tensorhooks runs the consumed ops again with the rest of the recomputation
    (docs/differences.md, "A selectively checkpointed region can be backwarded twice"): the
    second gradient equals the first.
    """
    policy = save_op(ckpt, torch.ops.aten.sin.default)
    x = torch.randn(3, requires_grad=True)
    out = ckpt.checkpoint(
        lambda x: x.sin().cos().exp(), x, use_reentrant=False, context_fn=selective(ckpt, policy)
    )
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    if is_tensorhooks(ckpt):
        out.sum().backward(retain_graph=True)
        torch.testing.assert_close(x.grad, 2 * first)
    else:
        with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
            out.sum().backward(retain_graph=True)


def test_a_rebound_counter_counts_forward_passes() -> None:
    """A number the function rebinds (``counter[0] += 1``): forward passes only, in tensorhooks.

    torch's recomputation runs the rebinding again and reads it rebound; tensorhooks runs it
    with the binding the call found and puts the forward pass's back after (docs/differences.md,
    "A binding the region read, replaced before backward, is read as it was").
    """
    for ckpt, runs in ((IMPLEMENTATIONS["torch"], 2), (IMPLEMENTATIONS["tensorhooks"], 1)):
        counter = [0]

        def fn(x: torch.Tensor, counter: list[int] = counter) -> torch.Tensor:
            counter[0] += 1
            return (x * counter[0]).sin()  # sin saves its input: the count's second value

        a = torch.tensor(1.0, requires_grad=True)
        ckpt.checkpoint(fn, a, use_reentrant=False).backward()
        assert counter[0] == runs
        expected = torch.cos(torch.tensor(float(runs)))  # torch: cos(2), plain autograd's cos(1)
        torch.testing.assert_close(a.grad, expected)
