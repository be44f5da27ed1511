"""PyTorch's own tests of the five APIs, run against tensorhooks.

Each test mirrors one test of ``test/test_autograd.py`` in the PyTorch repository (named in its
docstring) with ``torch.autograd.graph`` replaced by ``tensorhooks``: the same programs and the
same assertions. Where tensorhooks deliberately behaves otherwise, the test asserts tensorhooks'
behaviour and names the entry of ``docs/differences.md`` that describes it. Tests that cannot run
here say why in their docstring; none is left out silently. Tests that fail because of a gap
(not a deliberate difference) are listed in ``KNOWN_GAPS`` and marked ``xfail(strict=True)``, so
they flip to an error once the gap is closed.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint

import tensorhooks
from tensorhooks._core.torch_compat import get_disabled_hooks_message

# Tests that fail for a reason that is not a deliberate difference; each flips when fixed.
KNOWN_GAPS: dict[str, str] = {}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def known_gap(test: Callable[..., None]) -> Callable[..., None]:
    """Mark ``test`` as a known gap (listed in `KNOWN_GAPS`), expected to fail until fixed."""
    reason = KNOWN_GAPS.get(test.__name__)
    if reason is None:
        return test
    return pytest.mark.xfail(strict=True, reason=reason)(test)


def hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be entered on this thread."""
    return get_disabled_hooks_message() is None


def run_threads(fn: Callable[..., None], args: tuple[Any, ...], num_threads: int) -> None:
    """Run ``fn(*args)`` on ``num_threads`` threads at once and re-raise the first failure."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn(*args)
        except BaseException as error:  # re-raised on the calling thread
            errors.append(error)

    threads = [threading.Thread(target=target) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# saved_tensors_hooks
# ---------------------------------------------------------------------------------------------


def backward_on_threads_failing_once(t2: torch.Tensor, t3: torch.Tensor) -> int:
    """Backward of ``(x * t3).sum()`` on 5 threads, ``x`` a node whose first backward raises.

    Mirrors the failing part of torch's multithreaded multi-grad tests; returns how many of the
    threads' backward calls raised.
    """
    lock = threading.Lock()
    errors = [0]
    backward_calls = [0]

    class FailsOnce(Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            with lock:
                backward_calls[0] += 1
                if backward_calls[0] == 1:
                    raise RuntimeError("error message")
            return grad

    def backward_counting_errors(out: torch.Tensor) -> None:
        try:
            out.backward(inputs=(t2, t3), retain_graph=True)
        except RuntimeError:
            with lock:
                errors[0] += 1

    run_threads(backward_counting_errors, ((FailsOnce.apply(t2) * t3).sum(),), num_threads=5)
    return errors[0]


class TestSavedTensorsHooks:
    def test_saved_variable_packing_unpacking_saved_original_with_default_hooks(self) -> None:
        """Mirrors test_saved_variable_packing_unpacking_saved_original_with_default_hooks."""

        def pack(x: torch.Tensor) -> torch.Tensor:
            warnings.warn("pack", stacklevel=1)
            return x

        with tensorhooks.saved_tensors_hooks(pack, lambda x: x):
            a = torch.ones(5, requires_grad=True)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                y = a * a
                assert len(w) == 2  # a is saved twice

        with tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = a * a
            torch.testing.assert_close(y.grad_fn._saved_self, a)
            torch.testing.assert_close(y.grad_fn._saved_other, a)
            y.sum().backward()
            torch.testing.assert_close(a.grad, 2 * a)

        with tensorhooks.saved_tensors_hooks(lambda x: 2 * x, lambda x: x / 2):
            a = torch.randn(5, requires_grad=True)
            y = a * a
            torch.testing.assert_close(y.grad_fn._saved_self, a)
            torch.testing.assert_close(y.grad_fn._saved_other, a)
            y.sum().backward()
            torch.testing.assert_close(a.grad, 2 * a)

        with tensorhooks.saved_tensors_hooks(lambda x: 2 * x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = a * a
            torch.testing.assert_close(y.grad_fn._saved_self, 2 * a)
            torch.testing.assert_close(y.grad_fn._saved_other, 2 * a)
            y.sum().backward()
            torch.testing.assert_close(a.grad, 4 * a)

        # The hooks are gone once the context exits.
        a = torch.randn(5, requires_grad=True)
        y = a * a
        torch.testing.assert_close(y.grad_fn._saved_self, a)
        torch.testing.assert_close(y.grad_fn._saved_other, a)
        y.sum().backward()
        torch.testing.assert_close(a.grad, 2 * a)

    def test_saved_variable_packing_unpacking_did_not_save_original_with_default_hooks(
        self,
    ) -> None:
        """Mirrors ..._did_not_save_original_with_default_hooks (the same name as the test)."""
        with tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = torch.exp(a)
            torch.testing.assert_close(y.grad_fn._saved_result, y)
            y.sum().backward()
            torch.testing.assert_close(a.grad, y)

    def test_setting_default_saved_variable_hooks_twice_should_not_fail(self) -> None:
        """Mirrors test_setting_default_saved_variable_hooks_twice_should_not_fail."""
        with (
            tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x),
            tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x),
        ):
            pass

    def test_setting_default_saved_variable_hooks_twice_should_use_inner(self) -> None:
        """Mirrors test_setting_default_saved_variable_hooks_twice_should_use_inner."""
        with tensorhooks.saved_tensors_hooks(lambda x: 3 * x, lambda x: 3 * x):
            b = torch.randn(5, requires_grad=True)
            with tensorhooks.saved_tensors_hooks(lambda x: 5 * x, lambda x: 5 * x):
                a = torch.randn(5, requires_grad=True)
                y = a * a
            z = b * b
        y.sum().backward()
        z.sum().backward()
        torch.testing.assert_close(a.grad, 2 * 5 * 5 * a)
        torch.testing.assert_close(b.grad, 2 * 3 * 3 * b)

    def test_saved_tensor_hooks_custom_error_propagation(self) -> None:
        """Mirrors test_saved_tensor_hooks_custom_error_propagation (subclassing the context)."""

        class CustomError(Exception):
            pass

        class error_on_pack_hook(tensorhooks.saved_tensors_hooks):  # torch's name
            def __init__(self) -> None:
                def pack_hook(x: torch.Tensor) -> torch.Tensor:
                    raise CustomError("pack")

                super().__init__(pack_hook, lambda x: x)

        class error_on_unpack_hook(tensorhooks.saved_tensors_hooks):  # torch's name
            def __init__(self) -> None:
                def unpack_hook(x: torch.Tensor) -> torch.Tensor:
                    raise CustomError("unpack")

                super().__init__(lambda x: x, unpack_hook)

        a = torch.tensor(1.0, requires_grad=True)

        with error_on_pack_hook(), pytest.raises(CustomError, match="pack"):
            torch.sin(a)

        with error_on_unpack_hook():
            out = torch.sin(a)
            with pytest.raises(CustomError, match="unpack"):
                out.backward()

    def test_saved_tensor_hooks_custom_function_intermediates(self) -> None:
        """Mirrors test_saved_tensor_hooks_custom_function_intermediates."""

        class Func(Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                intermediate = x.exp()
                ctx.save_for_backward(intermediate.clone().detach_().requires_grad_(True))
                return x.exp()

            @staticmethod
            def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
                (intermediate,) = ctx.saved_tensors
                return grad_out * intermediate

        a = torch.tensor(1.0, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x):
            out = Func.apply(a)
        out.backward()

    def test_unpack_hooks_exec_count(self) -> None:
        """Mirrors test_unpack_hooks_exec_count."""
        counts = {"pack": 0, "unpack": 0}

        def pack_hook(x: torch.Tensor) -> torch.Tensor:
            counts["pack"] += 1
            return x

        def unpack_hook(x: torch.Tensor) -> torch.Tensor:
            counts["unpack"] += 1
            return x

        x = torch.ones(4, requires_grad=True)
        y = torch.ones(4, requires_grad=False)
        with tensorhooks.saved_tensors_hooks(pack_hook, unpack_hook):
            out = x * y
            assert counts == {"pack": 1, "unpack": 0}
            out.sum().backward()
            assert counts == {"pack": 1, "unpack": 1}

    def test_saved_tensors_hook_version_counter_not_shared(self) -> None:
        """Mirrors test_saved_tensors_hook_version_counter_not_shared."""
        a = torch.tensor(1.0, requires_grad=True)
        a_replacement = a.clone()

        class Test(Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
                (x,) = ctx.saved_tensors
                before = a._version
                x.add_(1)
                assert a._version == before
                return grad_output

        with tensorhooks.saved_tensors_hooks(lambda x: a_replacement, lambda x: x):
            b = Test.apply(a)
        b.backward()

    def test_pack_hook_with_inplace_modification_should_fail(self) -> None:
        """Mirrors test_pack_hook_with_inplace_modification_should_fail (its context half).

        Its other half registers hooks on one ``SavedTensor`` (``_raw_saved_result``), torch's
        own per-tensor API that tensorhooks does not wrap.
        """
        a = torch.randn(5, requires_grad=True)

        def inc(x: torch.Tensor) -> torch.Tensor:
            x += 1
            return x

        with (
            tensorhooks.saved_tensors_hooks(inc, lambda x: x),
            pytest.raises(
                RuntimeError, match=r"A saved tensor pack hook is modifying its input in place\."
            ),
        ):
            torch.exp(a)

    def test_saving_variable_to_disk(self) -> None:
        """Mirrors test_saving_variable_to_disk."""
        with tempfile.TemporaryDirectory() as tmp_dir:

            def pack(x: torch.Tensor) -> str:
                name = os.path.join(tmp_dir, str(uuid.uuid4()))
                torch.save(x, name)
                return name

            def unpack(name: str) -> torch.Tensor:
                return torch.load(name)  # type: ignore[no-any-return]

            with tensorhooks.saved_tensors_hooks(pack, unpack):
                a = torch.ones(5, requires_grad=True)
                y = a * a
                torch.testing.assert_close(y.grad_fn._saved_self, a)
                y.sum().backward()
                torch.testing.assert_close(a.grad, 2 * a)

    def test_default_saved_tensors_hooks_double_backward(self) -> None:
        """Mirrors test_default_saved_tensors_hooks_double_backward."""
        with tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = a**3
            s = torch.sum(y)
            (g,) = torch.autograd.grad(s, (a,), create_graph=True)
            g.sum().backward()
            torch.testing.assert_close(a.grad, 6 * a)

        with tensorhooks.saved_tensors_hooks(lambda x: 2 * x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = a**3
            s = torch.sum(y)
        (g,) = torch.autograd.grad(s, (a,), create_graph=True)
        g.sum().backward()
        torch.testing.assert_close(a.grad, 6 * 2 * a)  # only a is saved, once

        a = torch.randn(5, requires_grad=True)
        y = a**3
        s = torch.sum(y)
        with tensorhooks.saved_tensors_hooks(lambda x: 2 * x, lambda x: x):
            (g,) = torch.autograd.grad(s, (a,), create_graph=True)
            g.sum().backward()
            # pow's backward saves grad and a: factor 4
            torch.testing.assert_close(a.grad, 6 * 4 * a)

        with tensorhooks.saved_tensors_hooks(lambda x: 2 * x, lambda x: x):
            a = torch.randn(5, requires_grad=True)
            y = a**3
            s = torch.sum(y)
            (g,) = torch.autograd.grad(s, (a,), create_graph=True)
            g.sum().backward()
            torch.testing.assert_close(a.grad, 6 * 8 * a)  # both blocks above: 2 * 4

    def test_wrapped_number_saved_tensors_hooks(self) -> None:
        """Mirrors test_wrapped_number_saved_tensors_hooks."""

        def err_hook(x: Any) -> Any:
            raise RuntimeError("this hook should not be called")

        with tensorhooks.saved_tensors_hooks(err_hook, err_hook):
            a = torch.randn(5, requires_grad=True)
            out = (a * 3).sum()
            torch.autograd.grad(out, (a,))  # 3 is a wrapped number: no hook is called

    def test_grad_fn_attr_bindings_under_hooks(self) -> None:
        """Mirrors the saved-tensor part of test_grad_fn_attr_bindings, under our hooks."""
        a = torch.ones(1, requires_grad=True)
        b = torch.zeros(1, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x):
            out = (a * 2) * b
        torch.testing.assert_close(out.grad_fn._saved_self, a * 2)
        assert isinstance(out.grad_fn._saved_self, torch.Tensor)
        assert isinstance(out.grad_fn._raw_saved_self, torch._C._autograd.SavedTensor)
        out.sum().backward()
        with pytest.raises(RuntimeError, match="after they have already been freed"):
            out.grad_fn._saved_self  # noqa: B018

    def test_get_data_and_hooks_from_raw_saved_variable(self) -> None:
        """Mirrors test_get_data_and_hooks_from_raw_saved_variable: a deliberate difference.

        torch's ``_raw_saved_self.data`` is the object pack returned and ``.unpack_hook`` the
        user's hook; under tensorhooks an as-is pack is wrapped in the save guard's record and
        the hook is the guard's. ``_saved_self`` (unpack) is the same in both. See
        docs/differences.md, "grad_fn._raw_saved_<name> under tensorhooks' hooks".
        """

        def pack_hook(t: torch.Tensor) -> torch.Tensor:
            return t

        def unpack_hook(t: torch.Tensor) -> torch.Tensor:
            return t

        a = torch.tensor(2.0, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(pack_hook, unpack_hook):
            b = a**2
        c = b.exp()
        d = c**2

        pow_sv = b.grad_fn._raw_saved_self
        exp_sv = c.grad_fn._raw_saved_result
        pow2_sv = d.grad_fn._raw_saved_self

        # torch: pow_sv.data is a, pow_sv.unpack_hook is unpack_hook. tensorhooks: the guard's
        # record holds what pack returned, and unpack gives it back.
        assert pow_sv.data is not a
        assert any(item is a for item in pow_sv.data)
        assert pow_sv.unpack_hook is not unpack_hook
        assert pow_sv.unpack_hook(pow_sv.data) is a
        torch.testing.assert_close(b.grad_fn._saved_self, a)  # a new Python object, as torch's
        # Outside the hooks, as torch: the detached data of a saved output, the input as is.
        assert exp_sv.data is not c
        assert exp_sv.unpack_hook is None
        assert pow2_sv.data is c
        assert pow2_sv.unpack_hook is None

    def test_raw_saved_data_is_what_a_copying_pack_returned(self) -> None:
        """Mirrors the raw-data check of test_get_data_and_hooks_from_raw_saved_variable.

        A pack that does not return the tensor itself is not wrapped: ``.data`` is exactly what
        the user's pack returned, as in torch.
        """
        packed: list[object] = []

        def pack_hook(t: torch.Tensor) -> object:
            packed.append(("copy", t.detach().clone()))
            return packed[-1]

        a = torch.tensor(2.0, requires_grad=True)
        with tensorhooks.saved_tensors_hooks(pack_hook, lambda p: p[1]):
            b = a**2
        assert b.grad_fn._raw_saved_self.data is packed[0]
        torch.testing.assert_close(b.grad_fn._saved_self, a.detach())

    def test_dataparallel_saved_tensors_hooks(self) -> None:
        """Mirrors TestMultithreadAutograd.test_dataparallel_saved_tensors_hooks.

        Without two GPUs DataParallel runs the forward on the calling thread, so the hooks
        fire there; with two or more it runs replicas on threads that do not inherit them.
        """
        calls: list[int] = []

        def pack(x: torch.Tensor) -> torch.Tensor:
            calls.append(threading.get_ident())
            return x

        class Model(nn.Module):
            def forward(self, x: torch.Tensor) -> None:
                before = len(calls)
                x * x  # saves x twice
                if torch.cuda.device_count() >= 2:
                    assert len(calls) == before
                else:
                    assert len(calls) > before

        x = torch.ones(5, 5, requires_grad=True)
        model = nn.DataParallel(Model())
        with tensorhooks.saved_tensors_hooks(pack, lambda x: x):
            model(x)
            before = len(calls)
            x * x
            assert len(calls) > before


# ---------------------------------------------------------------------------------------------
# disable_saved_tensors_hooks
# ---------------------------------------------------------------------------------------------


class TestDisableSavedTensorsHooks:
    def test_disabling_saved_tensor_hooks(self) -> None:
        """Mirrors test_disabling_saved_tensor_hooks."""
        with (
            tensorhooks.disable_saved_tensors_hooks("error message"),
            pytest.raises(RuntimeError, match="error message"),
            tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x),
        ):
            pass

        assert hooks_enabled()

        with (
            tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x),
            pytest.raises(RuntimeError, match="error message"),
            tensorhooks.disable_saved_tensors_hooks("error message"),
        ):
            pass

        assert hooks_enabled()

    def test_disabling_saved_tensor_hooks_nested(self) -> None:
        """Mirrors test_disabling_saved_tensor_hooks_nested."""
        with tensorhooks.disable_saved_tensors_hooks("outer"):
            with (
                tensorhooks.disable_saved_tensors_hooks("inner"),
                pytest.raises(RuntimeError, match="inner"),
                tensorhooks.saved_tensors_hooks(lambda x: x, lambda x: x),
            ):
                pass

            assert not hooks_enabled()

        assert hooks_enabled()

    def test_disabling_blocks_the_other_contexts(self) -> None:
        """Mirrors test_disabling_saved_tensor_hooks for save_on_cpu and allow_mutation.

        Both are saved-tensor hooks in torch, so disabling refuses them too.
        """
        with tensorhooks.disable_saved_tensors_hooks("error message"):
            with pytest.raises(RuntimeError, match="error message"), tensorhooks.save_on_cpu():
                pass
            with (
                pytest.raises(RuntimeError, match="error message"),
                tensorhooks.allow_mutation_on_saved_tensors(),
            ):
                pass
            assert not hooks_enabled()
        assert hooks_enabled()


# ---------------------------------------------------------------------------------------------
# save_on_cpu
# ---------------------------------------------------------------------------------------------


class TestSaveOnCpu:
    def test_save_on_cpu_and_checkpoint(self) -> None:
        """Mirrors test_save_on_cpu_and_checkpoint."""
        a = torch.randn(2, 2, requires_grad=True)

        b = a.pow(2).pow(2).pow(2).pow(2)
        b.sum().backward()
        assert a.grad is not None
        b_grad = a.grad.clone()
        a.grad.zero_()

        with tensorhooks.save_on_cpu():
            h = a.pow(2)
            h = checkpoint(lambda x: x.pow(2).pow(2), h, use_reentrant=False)
            c = h.pow(2)
        c.sum().backward()
        c_grad = a.grad.clone()
        a.grad.zero_()

        def f(a: torch.Tensor) -> torch.Tensor:
            h = a.pow(2)
            with tensorhooks.save_on_cpu():
                h = h.pow(2).pow(2)
            return h.pow(2)

        d = checkpoint(f, a, use_reentrant=False)
        d.sum().backward()
        d_grad = a.grad.clone()

        torch.testing.assert_close(c_grad, b_grad)
        torch.testing.assert_close(d_grad, b_grad)

    # Some torch releases (2.11) warn from inside the sparse copy that invariant checks are off.
    @pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
    @pytest.mark.parametrize("pin_memory", [True, False])
    @pytest.mark.parametrize("kind", ["float", "double", "sparse"])
    def test_graph_save_on_cpu(self, kind: str, pin_memory: bool) -> None:
        """Mirrors test_graph_save_on_cpu (its CPU half; the CUDA half is the next test)."""
        self._check_graph_save_on_cpu(kind, pin_memory, cuda=False)

    @pytest.mark.cuda
    @requires_cuda
    @pytest.mark.parametrize("pin_memory", [True, False])
    @pytest.mark.parametrize("kind", ["float", "double", "sparse"])
    def test_graph_save_on_cpu_with_cuda(self, kind: str, pin_memory: bool) -> None:
        """Mirrors test_graph_save_on_cpu with cuda=True (torch's loop, where CUDA exists).

        torch's test calls ``a.cuda()`` without keeping the result, so its inputs stay on the
        CPU even then; kept as written.
        """
        self._check_graph_save_on_cpu(kind, pin_memory, cuda=True)

    @staticmethod
    def _check_graph_save_on_cpu(kind: str, pin_memory: bool, cuda: bool) -> None:
        with tensorhooks.save_on_cpu(pin_memory):
            if kind == "float":
                a = torch.randn(5, requires_grad=True)
            elif kind == "double":
                a = torch.randn(5, requires_grad=True, dtype=torch.double)
            else:
                # check_invariants opts in explicitly: torch warns once per process otherwise.
                a = torch.sparse_coo_tensor(
                    torch.tensor([[1, 1]]).long(),
                    torch.tensor([1.0, 1.0]),
                    requires_grad=True,
                    check_invariants=True,
                )
            if cuda:
                a.cuda()
            y = a * a
            torch.testing.assert_close(y.grad_fn._saved_self, a)
            torch.testing.assert_close(y.grad_fn._saved_other, a)
            assert y.grad_fn._saved_self.dtype == a.dtype
            assert y.grad_fn._saved_self.layout == a.layout
            if y.is_sparse:
                y = y.to_dense()
            y.sum().backward()

            actual = 2 * a
            expected = a.grad
            assert expected is not None
            if a.is_sparse:
                actual = actual.coalesce()
                expected = expected.coalesce()
            torch.testing.assert_close(actual, expected)

    @pytest.mark.cuda
    @requires_cuda
    def test_graph_save_on_cpu_cuda(self) -> None:
        """Mirrors test_graph_save_on_cpu_cuda: saved CUDA tensors leave the GPU.

        torch's test saves a 1-element tensor; tensorhooks keeps dense tensors under
        ``min_offload_bytes`` on their device (docs/differences.md, save_on_cpu, "What is
        copied"), so the test passes ``min_offload_bytes=0`` to ask for torch's behaviour.
        """

        def f(x: torch.Tensor) -> torch.Tensor:
            a = x + 1
            return a * a

        a = torch.ones(1, requires_grad=True, device="cuda")
        y = f(a)
        memory_with_grad = torch.cuda.memory_allocated()
        del a, y

        a = torch.ones(1, requires_grad=True, device="cuda")
        with torch.no_grad():
            y = f(a)
        memory_without_grad = torch.cuda.memory_allocated()
        assert memory_with_grad > memory_without_grad
        del a, y

        with tensorhooks.save_on_cpu(min_offload_bytes=0):
            a = torch.ones(1, requires_grad=True, device="cuda")
            y = f(a)
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == memory_without_grad
            assert y.requires_grad


# ---------------------------------------------------------------------------------------------
# allow_mutation_on_saved_tensors
# ---------------------------------------------------------------------------------------------

MODIFIED = "variables needed for gradient computation has been modified by an inplace"


class TestAllowMutationOnSaved:
    """Mirrors TestAllowMutationOnSaved.

    torch's tests count ``len(ctx.cloned)`` (one entry per cloned tensor version) and
    ``len(ctx.tid_to_weakhandle)`` (one per saved tensor version); tensorhooks'
    `MutationContext` has ``num_cloned()`` and ``num_saved()``, which count saves (a tensor saved
    by two ops counts twice). See docs/differences.md, "What the
    allow_mutation_on_saved_tensors context object counts".
    """

    def test_basic(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_basic."""
        a = torch.rand(2, 3, requires_grad=True)

        def fn(a: torch.Tensor) -> torch.Tensor | None:
            b = a.clone()
            out = (b**2).sum()
            b.sin_()
            out.sum().backward()
            return a.grad

        with pytest.raises(RuntimeError, match=MODIFIED):
            fn(a)

        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            da = fn(a)

        assert da is not None
        torch.testing.assert_close(da, a * 2)
        assert ctx.num_cloned() == 0

    def test_views(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_views."""
        a = torch.rand(2, 3, requires_grad=True)

        def fn(a: torch.Tensor) -> torch.Tensor | None:
            b = a.clone()
            c = b.view_as(b)
            out = (b**2).sum()
            c.sin_()
            out.sum().backward()
            return a.grad

        with pytest.raises(RuntimeError, match=MODIFIED):
            fn(a)

        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            da = fn(a)

        assert ctx.num_cloned() == 0
        assert da is not None
        torch.testing.assert_close(da, a * 2)

    def test_save_base_and_modify_view(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_save_base_and_modify_view."""
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.rand(2, 3, requires_grad=True)
            b = a.clone()
            c = b[:1]
            out = b**2
            c *= 10  # modify the view
            out.sum().backward()
            assert ctx.num_cloned() == 0

        assert ctx.num_cloned() == 0
        assert a.grad is not None
        torch.testing.assert_close(a.grad, a * 2)

    def test_save_view_modify_base(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_save_view_modify_base."""
        with tensorhooks.allow_mutation_on_saved_tensors():
            a = torch.rand(2, 3, requires_grad=True)
            b = a.clone()
            c = b[:]
            out = (c**2).sum()
            b *= 2
            out.backward()
            assert a.grad is not None
            torch.testing.assert_close(a.grad, a * 2)

    def test_double_backward(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_double_backward."""
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.rand(2, 3, requires_grad=True)
            b = a.clone()
            out = (b**2).sum()
            b.sin_()
            torch.autograd.grad(out, a, create_graph=True)
            (da,) = torch.autograd.grad(out, a, create_graph=True)
            (d2a,) = torch.autograd.grad(da.sum(), a)

        torch.testing.assert_close(d2a, torch.ones_like(a) * 2)
        assert ctx.num_cloned() == 0

    def test_saved_but_not_anymore(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_saved_but_not_anymore."""
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.randn(2, 3, requires_grad=True).clone()
            out = (a**2).sum()
            assert ctx.num_saved() == 1
            assert ctx.num_cloned() == 0
            out.backward()
            a.sin_()
            assert ctx.num_cloned() == 0  # saved once, but not any more: nothing cloned
            out = (a**2).sum()
            a.sin_()
            assert ctx.num_cloned() == 1
            del out
            assert ctx.num_cloned() == 0

    def test_saved_same_tensor_many_times(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_saved_same_tensor_many_times.

        torch counts one clone (``len(ctx.cloned) == 1``); tensorhooks also clones once but
        ``num_cloned()`` counts the two saves that share that clone. See docs/differences.md,
        "What the allow_mutation_on_saved_tensors context object counts".
        """
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.randn(2, 3, requires_grad=True).clone()
            b = a**2
            c = a**2
            a.sin_()
            assert ctx.num_cloned() == 2
            saved_b, saved_c = b.grad_fn._saved_self, c.grad_fn._saved_self
            assert saved_b.untyped_storage().data_ptr() == saved_c.untyped_storage().data_ptr()
            del saved_b, saved_c
            del b, c
            assert ctx.num_cloned() == 0

    def test_saved_same_tensor_different_versions(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_saved_same_tensor_different_versions."""
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.randn(2, 3, requires_grad=True).clone()
            b = a**2
            a.sin_()
            c = a**2
            a.sin_()
            assert ctx.num_cloned() == 2
            del b
            assert ctx.num_cloned() == 1
            del c
            assert ctx.num_cloned() == 0

    def test_with_math_views(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_with_math_views."""
        with tensorhooks.allow_mutation_on_saved_tensors():
            a = torch.tensor([1 + 1j], requires_grad=True).clone()
            b = a.conj()
            out = (b**2).sum()
            a.sin_()
            out.abs().backward()

            a = torch.tensor([1 + 1j], requires_grad=True).clone()
            b = a.conj()
            out = (b**2).sum()
            b.sin_()  # no longer a view, it seems
            out.abs().backward()

    def test_with_out_variant(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_with_out_variant."""
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            a = torch.tensor([1.0], requires_grad=True)
            b = torch.tensor([1.0])
            c = torch.tensor([2.0])
            out = a * b
            assert ctx.num_saved() == 1
            torch.sin(c, out=b)
            assert ctx.num_cloned() == 1
            out.backward()
            assert ctx.num_cloned() == 0

    def test_backward_out_of_context(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_backward_out_of_context.

        The error is `MutationContextExitedError`, an ``AssertionError`` as torch's and also a
        ``RuntimeError`` (docs/differences.md, "Backward outside the context raises a
        RuntimeError"); its message contains torch's.
        """
        msg = "Trying to backward outside of the 'allow_mutation_on_saved_tensors' context"
        with tensorhooks.allow_mutation_on_saved_tensors():
            a = torch.rand(2, 3, requires_grad=True)
            out = (a**2).sum()

        with pytest.raises(AssertionError, match=msg) as raised:
            out.backward()
        assert isinstance(raised.value, RuntimeError)

        with tensorhooks.allow_mutation_on_saved_tensors():
            a = torch.rand(2, 3, requires_grad=True)
            out = (a**2).sum()

        with (
            tensorhooks.allow_mutation_on_saved_tensors(),
            pytest.raises(AssertionError, match=msg),
        ):
            out.backward()

    def test_disallow_nesting(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_disallow_nesting: nesting is allowed on purpose.

        torch raises "allow_mutation_on_saved_tensors contexts cannot be nested"; tensorhooks
        nests (docs/differences.md, "Contexts on several threads, and nested contexts"), so this
        asserts that a nested context works: each context protects what is saved inside it.
        """
        a = torch.rand(2, 3, requires_grad=True)
        with tensorhooks.allow_mutation_on_saved_tensors() as outer:
            b = a.clone()
            out_outer = (b**2).sum()
            with tensorhooks.allow_mutation_on_saved_tensors() as inner:
                c = a.clone()
                out_inner = (c**2).sum()
                b.sin_()
                c.sin_()
                assert (outer.num_cloned(), inner.num_cloned()) == (1, 1)
                out_inner.backward()
            out_outer.backward()
        assert a.grad is not None
        torch.testing.assert_close(a.grad, a * 4)

    def test_inplace_foreach(self) -> None:
        """Mirrors TestAllowMutationOnSaved.test_inplace_foreach."""
        with tensorhooks.allow_mutation_on_saved_tensors():
            a = [
                torch.tensor(1.0, requires_grad=True),
                torch.tensor(1.0, requires_grad=True),
            ]
            b = torch._foreach_exp(a)
            torch._foreach_add_(b, 1)
            (b[0] + b[1]).backward()

        torch.testing.assert_close([a[0].grad, a[1].grad], list(torch._foreach_exp(a)))


# ---------------------------------------------------------------------------------------------
# register_multi_grad_hook
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("tensorhooks_conformance::clone", mutates_args=())
def _library_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_library_clone.register_autograd(lambda ctx, grad: grad)


class _Identity(Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _FailsInBackward(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("error message")


class TestRegisterMultiGradHook:
    def test_multi_grad_all_hooks(self) -> None:
        """Mirrors test_multi_grad_all_hooks.

        torch builds its fourth node kind, a C++ ``torch::autograd::Function`` behind a custom
        op, with ``load_inline`` (a C++ compiler at test time); here the fourth tensor goes
        through a ``torch.library`` custom op with a registered autograd formula instead, also a
        node the dispatcher creates outside Python's ``Function``.
        """
        t1 = torch.rand(2, requires_grad=True).mul(2)  # C++ node
        t2 = _Identity.apply(torch.rand(2, requires_grad=True))  # Python custom Function
        t3 = torch._C._functions.UndefinedGrad()(torch.rand(2, requires_grad=True))  # C++ node
        t4 = _library_clone(torch.rand(2, requires_grad=True))  # custom op

        res: list[bool] = [False] * 4
        count = [0]

        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            nonlocal res
            count[0] += 1
            res = [g is not None for g in grads]

        handle = tensorhooks.register_multi_grad_hook((t1, t2, t3, t4), hook)

        out = t2 * t3
        out.sum().backward(inputs=(t2, t3), retain_graph=True)
        assert count[0] == 1
        assert res == [False, True, True, False]

        out.sum().backward(inputs=(t1, t4), retain_graph=True)
        assert count[0] == 1

        out.sum().backward(inputs=(t1, t3), retain_graph=True)
        assert count[0] == 2
        assert res == [False, False, True, False]

        out = _FailsInBackward.apply(t2) * t3
        with pytest.raises(RuntimeError, match="error message"):
            out.sum().backward(inputs=(t2, t3), retain_graph=True)
        assert count[0] == 2

        handle.remove()
        out.sum().backward(inputs=(t1, t3), retain_graph=True)
        assert count[0] == 2

    def test_multi_grad_any_hooks(self) -> None:
        """Mirrors test_multi_grad_any_hooks."""
        hook_id = 0
        any_hook_handles: list[Any] = []
        hook_order: list[int] = []

        def hook(hook_id: int, *unused: object) -> None:
            hook_order.append(hook_id)

        class MultiOutputModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                nonlocal hook_id
                z = self.lin(x)
                out = torch.sin(z), torch.cos(z)
                z.register_hook(functools.partial(hook, hook_id))
                hook_id += 1
                any_hook_handles.append(
                    tensorhooks.register_multi_grad_hook(
                        out, functools.partial(hook, hook_id), mode="any"
                    )
                )
                hook_id += 1
                return out

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.mod1 = MultiOutputModule()
                self.mod2 = MultiOutputModule()

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                y = self.mod1(x)
                z = y[0] + y[1]
                return self.mod2(z)  # type: ignore[no-any-return]

        # Any hooks: ids 1 and 3; regular hooks: ids 0 and 2.
        model = Model()
        inp = torch.randn((2, 3))
        out = model(inp)
        (out[0] + out[1]).sum().backward()
        # Each any-hook runs once, before the module's regular hook.
        assert len(any_hook_handles) == 2
        assert hook_order == [3, 2, 1, 0]

        hook_id = 0
        hook_order.clear()
        any_hook_handles.clear()
        out = model(inp)
        for handle in any_hook_handles:
            handle.remove()
        (out[0] + out[1]).sum().backward()
        assert hook_order == [2, 0]  # removed any-hooks do not run

    def test_multi_grad_hooks_invalid_mode(self) -> None:
        """Mirrors test_multi_grad_hooks_invalid_mode: torch's message, a ValueError."""
        t1 = torch.rand(2, requires_grad=True)
        t2 = torch.rand(2, requires_grad=True)
        regex = r"Expects mode to be one of \('all', 'any'\) but got foo"
        with pytest.raises(ValueError, match=regex):
            tensorhooks.register_multi_grad_hook((t1, t2), lambda _: None, mode="foo")  # type: ignore[arg-type]

    def test_multi_grad_all_hooks_threads(self) -> None:
        """Mirrors TestMultithreadAutograd.test_multi_grad_all_hooks."""
        t1, t2, t3, t4 = (torch.rand(2, requires_grad=True) for _ in range(4))
        state: dict[str, Any] = {"res": None, "count": 0}
        lock = threading.Lock()

        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            with lock:
                state["count"] += 1
                computed = [g is not None for g in grads]
                if state["res"] is None:
                    state["res"] = computed
                else:
                    assert state["res"] == computed

        handle = tensorhooks.register_multi_grad_hook((t1, t2, t3, t4), hook)

        def backward_retain_graph(out: torch.Tensor) -> None:
            out.backward(inputs=(t2, t3), retain_graph=True)

        run_threads(backward_retain_graph, ((t2 * t3).sum(),), num_threads=5)
        assert state == {"res": [False, True, True, False], "count": 5}

        # One thread's backward fails part-way: its call never completes.
        state.update(res=None, count=0)
        errors = backward_on_threads_failing_once(t2, t3)
        assert state == {"res": [False, True, True, False], "count": 4}
        assert errors == 1
        handle.remove()

    def test_multi_grad_any_hooks_threads(self) -> None:
        """Mirrors TestMultithreadAutograd.test_multi_grad_any_hooks."""
        t1, t2, t3, t4 = (torch.rand(2, requires_grad=True) for _ in range(4))
        count = [0]
        lock = threading.Lock()

        def hook(grad: torch.Tensor) -> None:
            with lock:
                count[0] += 1

        handle = tensorhooks.register_multi_grad_hook((t1, t2, t3, t4), hook, mode="any")

        def backward_retain_graph(out: torch.Tensor) -> None:
            out.backward(inputs=(t2, t3), retain_graph=True)

        run_threads(backward_retain_graph, ((t2 * t3).sum(),), num_threads=5)
        assert count[0] == 5

        # One thread's backward fails, after the hook ran (it runs before the custom backward).
        count[0] = 0
        errors = backward_on_threads_failing_once(t2, t3)
        assert count[0] == 5
        assert errors == 1
        handle.remove()
