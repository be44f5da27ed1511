"""Tests of save_on_cpu: torch's semantics, offload logic on a simulated device, CUDA streams."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import tensorhooks as th
from tensorhooks._activation_offload.copy_engines import copy_engine_provider
from tensorhooks._activation_offload.pinned_pool import HostPool, OffloadStats
from tensorhooks._activation_offload.records import Offloaded, copy_strides
from tensorhooks._activation_offload.session import thread_timeline
from tensorhooks._core.guards import VersionGuard, use_save_guard
from tests.simdevice import SimulatedEngine, simulated_device
from tests.strategies import OffloadProgram, offload_options, offload_programs

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODIFIED = "modified by an inplace operation"


class _GenericGuard(VersionGuard):
    """A VersionGuard by behaviour that declares no inlining: save_on_cpu then uses ``wrap``."""

    version_check_may_be_inlined = False


@pytest.fixture(params=["inline guard", "wrapped guard"])
def guard_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a test with the inlined VersionGuard pair and with the generic ``guard.wrap`` pair."""
    if request.param == "inline guard":
        yield
    else:
        with use_save_guard(_GenericGuard()):
            yield


@pytest.fixture
def sim() -> Iterator[SimulatedEngine]:
    """A simulated device with a side stream: the test's CPU tensors are offloaded through it."""
    with simulated_device() as engine:
        yield engine


def _mul_in_place(a: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    base = a._base if a._base is not None else a
    # Leaves (and views of them) that require grad cannot be changed in place at all.
    return a.cos() if base.is_leaf else a.mul_(0.5)


def _slice(a: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    part = a[:, ::2]  # a strided, non-dense view, saved by sin
    return torch.cat([part.sin(), part], 1)[:, : a.shape[1]]


_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sin": lambda a, _: a.sin(),
    "tanh": lambda a, _: a.tanh(),
    "sigmoid": lambda a, _: a.sigmoid(),
    "relu": lambda a, _: a.relu(),
    "square": lambda a, _: (a * a).tanh(),
    "exp": lambda a, _: a.clamp(-2, 2).exp(),
    "t": lambda a, _: a.t(),
    "slice": _slice,
    "mul": lambda a, b: a * b.tanh(),
    "add": lambda a, b: a + b,
    "matmul": lambda a, b: (a @ b.tanh()) / a.shape[0],
    "mul_": _mul_in_place,
}


def run_program(
    program: OffloadProgram, context: AbstractContextManager[Any] | None = None
) -> tuple[torch.Tensor | None, ...]:
    """Run ``program`` with its ops under ``context``; return the grads of its two leaves."""
    torch.manual_seed(program.seed)
    x = torch.randn(program.n, program.n, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(program.n, program.n))
    values: list[torch.Tensor] = [x, w]
    with context if context is not None else nullcontext():
        for name, i, j in program.ops:
            values.append(_OPS[name](values[i], values[j]))
    loss = sum(values[k].sum() for k in program.outputs)
    assert isinstance(loss, torch.Tensor)
    return torch.autograd.grad(loss, (x, w), allow_unused=True)


def program_outcome(
    program: OffloadProgram, context: AbstractContextManager[Any] | None = None
) -> tuple[torch.Tensor | None, ...] | RuntimeError:
    """The grads of ``program``, or the RuntimeError it raised."""
    try:
        return run_program(program, context)
    except RuntimeError as error:
        return error


def assert_grads_equal(
    actual: tuple[torch.Tensor | None, ...], expected: tuple[torch.Tensor | None, ...]
) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        if want is None:
            assert got is None
        else:
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def clone_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Reference for "the save-time value is used": every saved tensor is cloned at save."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def mlp(layers: int = 4, width: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*modules)


def mlp_grads(
    model: torch.nn.Module, x: torch.Tensor, context: AbstractContextManager[Any] | None = None
) -> tuple[torch.Tensor, ...]:
    with context if context is not None else nullcontext():
        loss = model(x).pow(2).sum()
    return torch.autograd.grad(loss, list(model.parameters()))


def copies(sim: SimulatedEngine, kind: str = "to_host") -> list[int]:
    """The sequence numbers of the simulated copies of one kind, in issue order."""
    return [tag for op, tag in sim.log if op == kind]


class TestSaveOnCpu:
    """save_on_cpu: signature, torch semantics, CPU path, offload logic on a simulated device."""

    # --- API -----------------------------------------------------------------------------------

    def test_signature_matches_torch(self) -> None:
        """Positional parameters and defaults are torch's; the extras are keyword-only."""
        ours = inspect.signature(th.save_on_cpu).parameters
        theirs = inspect.signature(torch.autograd.graph.save_on_cpu).parameters
        positional = [p for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [(p.name, p.default) for p in positional] == [
            (p.name, p.default) for p in theirs.values()
        ]
        extras = [p for p in ours.values() if p.kind is not p.POSITIONAL_OR_KEYWORD]
        assert extras
        assert all(p.kind is p.KEYWORD_ONLY for p in extras)

    def test_is_a_saved_tensors_hooks(self) -> None:
        """save_on_cpu subclasses tensorhooks.saved_tensors_hooks and exposes its hooks."""
        hooks = th.save_on_cpu()
        assert isinstance(hooks, th.saved_tensors_hooks)
        assert callable(hooks.pack_hook)
        assert callable(hooks.unpack_hook)

    def test_is_an_instance_of_torchs_classes(self) -> None:
        """An instance is also one of torch's save_on_cpu and saved_tensors_hooks classes."""
        hooks = th.save_on_cpu(True, "cuda", prefetch=1)
        assert isinstance(hooks, torch.autograd.graph.save_on_cpu)
        assert isinstance(hooks, torch.autograd.graph.saved_tensors_hooks)
        assert (hooks.pin_memory, hooks.device_type, hooks.prefetch) == (True, "cuda", 1)

    def test_no_reference_cycle(self) -> None:
        """An instance, entered and left, is freed by reference counting: nothing left for gc."""
        x = torch.randn(4, requires_grad=True)
        gc.collect()
        gc.disable()
        try:
            hooks = th.save_on_cpu()
            with hooks:
                y = x.exp()
            y.sum().backward()
            freed = weakref.ref(hooks)
            del hooks, y
            assert freed() is None
            assert gc.collect() == 0
        finally:
            gc.enable()

    @pytest.mark.parametrize("name", ["min_offload_bytes", "prefetch", "max_in_flight"])
    def test_a_bool_is_refused_after_the_equal_int_was_taken(self, name: str) -> None:
        """Arguments checked before are remembered by type too: True is refused after 1 passed."""
        assert getattr(th.save_on_cpu(**{name: 1}), name) == 1
        for _ in range(2):
            with pytest.raises(th.HookArgumentTypeError, match=rf"{name} must be an int, got True"):
                th.save_on_cpu(**{name: True})

    def test_unhashable_pin_memory_is_read_as_a_truth_value(self) -> None:
        """An unhashable pin_memory is checked each time and read as torch reads it."""
        assert th.save_on_cpu([1]).pin_memory is True  # type: ignore[arg-type]  # torch takes it
        assert th.save_on_cpu([]).pin_memory is False  # type: ignore[arg-type]

    def test_direct_pack_hook_call_uses_its_own_instances_entry(self, sim: SimulatedEngine) -> None:
        """pack_hook called by hand inside nested entries packs with its own instance's options."""
        outer = th.save_on_cpu(pin_memory=True, min_offload_bytes=0)
        inner = th.save_on_cpu(pin_memory=True, min_offload_bytes=1 << 30)
        t = torch.randn(3, 4)
        with outer, inner:
            kept = inner.pack_hook(t)
            copied = outer.pack_hook(t)
        assert isinstance(kept, torch.Tensor)
        assert not isinstance(copied, torch.Tensor)
        assert torch.equal(outer.unpack_hook(copied), t)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"device_type": None}, r"save_on_cpu: device_type must be a str, got None of type"),
            ({"offload_parameters": "yes"}, r"offload_parameters must be a bool, got 'yes'"),
            ({"prefetch": True}, r"prefetch must be an int, got True of type bool"),
            ({"max_in_flight": 1.5}, r"max_in_flight must be an int, got 1.5 of type float"),
        ],
    )
    def test_wrong_argument_types_raise(self, kwargs: dict[str, Any], match: str) -> None:
        """An argument of the wrong type raises a TypeError naming it and the value seen."""
        with pytest.raises(th.HookArgumentTypeError, match=match):
            th.save_on_cpu(**kwargs)
        with pytest.raises(TypeError):
            th.save_on_cpu(**kwargs)

    @pytest.mark.parametrize("value", ["yes", "false", ""])
    def test_pin_memory_refuses_a_string(self, value: str) -> None:
        """A string pin_memory is refused: torch reads "false" as True."""
        with pytest.raises(
            th.HookArgumentTypeError, match=r"pin_memory must be a bool, got '.*' of type str"
        ):
            th.save_on_cpu(value)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("device_type", "match"),
        [
            ("nonsense", r"device_type 'nonsense' is not a device type: Expected one of cpu"),
            ("cuda:0", r"device type without an index, got 'cuda:0'; pass 'cuda'"),
        ],
    )
    def test_unknown_device_type_raises(self, device_type: str, match: str) -> None:
        """A device_type torch does not know is a ValueError (torch falls back to CUDA's)."""
        torch.autograd.graph.save_on_cpu(device_type=device_type)
        with pytest.raises(th.OffloadArgumentValueError, match=match) as caught:
            th.save_on_cpu(device_type=device_type)
        assert isinstance(caught.value, ValueError)

    @pytest.mark.parametrize("device_type", ["cuda", "xpu", "mps", "cpu", "privateuseone"])
    def test_known_device_types_accepted(self, device_type: str) -> None:
        """Every device type torch parses is accepted, available or not."""
        assert th.save_on_cpu(device_type=device_type).device_type == device_type

    @pytest.mark.parametrize(("value", "expected"), [(1, True), (0, False), (None, False)])
    def test_pin_memory_takes_any_truthy_value(self, value: object, expected: bool) -> None:
        """pin_memory is read as a truth value, as torch's save_on_cpu reads it."""
        hooks = th.save_on_cpu(value)  # type: ignore[arg-type]  # torch accepts it
        assert hooks.pin_memory is expected
        torch.autograd.graph.save_on_cpu(value)  # type: ignore[arg-type]
        x = torch.randn(4, requires_grad=True)
        with hooks:
            y = x.exp()
        y.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, x.detach().exp())

    @pytest.mark.parametrize("name", ["min_offload_bytes", "prefetch", "max_in_flight"])
    def test_negative_numbers_raise(self, name: str) -> None:
        """A negative option raises a ValueError that says what 0 would do."""
        with pytest.raises(th.OffloadArgumentValueError, match=rf"{name} must be >= 0, got -1"):
            th.save_on_cpu(**{name: -1})
        with pytest.raises(ValueError, match="pass 0 to"):
            th.save_on_cpu(**{name: -1})

    def test_disabled_hooks_refuse_entry(self) -> None:
        """Entering while saved-tensor hooks are disabled raises the disabling message."""
        with (
            th.disable_saved_tensors_hooks("no offloading here"),
            pytest.raises(RuntimeError, match="no offloading here"),
            th.save_on_cpu(),
        ):
            pass

    def test_direct_hook_calls_round_trip(self) -> None:
        """Calling pack_hook then unpack_hook by hand gives back an equal tensor."""
        hooks = th.save_on_cpu(min_offload_bytes=0)
        t = torch.randn(3, 4)
        assert torch.equal(hooks.unpack_hook(hooks.pack_hook(t)), t)
        with simulated_device():
            packed = hooks.pack_hook(t)
            assert not isinstance(packed, torch.Tensor)
            assert torch.equal(hooks.unpack_hook(packed), t)

    def test_hooks_are_popped_when_the_body_raises(self) -> None:
        """An exception inside the context leaves no hooks behind."""
        seen: list[int] = []
        hooks = th.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t)
        x = torch.ones(2, requires_grad=True)
        with hooks:
            with pytest.raises(KeyError), th.save_on_cpu():
                raise KeyError("body")
            x.exp()
        assert seen == [1]

    # --- torch semantics on the CPU path ---------------------------------------------------

    def test_cpu_tensors_are_not_copied(self) -> None:
        """A CPU tensor is saved as-is: unpacking gives back the very same storage."""
        x = torch.randn(4, requires_grad=True)
        with th.save_on_cpu(min_offload_bytes=0, pin_memory=True):
            y = x.exp()
        saved = y.grad_fn._saved_result  # type: ignore[union-attr]  # ExpBackward0 has it
        assert saved.data_ptr() == y.data_ptr()

    def test_mlp_grads_match_plain_and_torch(self) -> None:
        """On CPU tensors the grads equal plain autograd's and torch's save_on_cpu's."""
        model = mlp()
        x = torch.randn(3, 8)
        plain = mlp_grads(model, x)
        assert_grads_equal(mlp_grads(model, x, th.save_on_cpu()), plain)
        assert_grads_equal(mlp_grads(model, x, th.save_on_cpu(pin_memory=True)), plain)
        assert_grads_equal(mlp_grads(model, x, torch.autograd.graph.save_on_cpu()), plain)

    def test_cpu_tensor_changed_in_place_raises(self, guard_path: None) -> None:
        """Changing a saved CPU tensor in place makes backward raise autograd's error."""
        x = torch.randn(4, requires_grad=True)
        with th.save_on_cpu():
            y = x.exp()
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(th.SavedTensorModifiedError, match=MODIFIED):
            y.sum().backward()

    def test_cpu_tensor_changed_after_backward_is_fine(self, guard_path: None) -> None:
        """A change after backward read the tensor does not matter."""
        x = torch.randn(4, requires_grad=True)
        with th.save_on_cpu():
            y = x.exp()
        y.sum().backward()
        with torch.no_grad():
            y.add_(1)
        assert x.grad is not None
        torch.testing.assert_close(x.grad, x.detach().exp())

    @pytest.mark.parametrize("op", ["exp", "tanh", "relu", "sigmoid"])
    @pytest.mark.parametrize(
        "where", ["cpu", "small tensor", "allow_mutation", "direct pack_hook call"]
    )
    def test_graph_dropped_without_backward_is_freed(
        self, guard_path: None, op: str, where: str
    ) -> None:
        """A graph whose nodes save their own outputs is freed when dropped without backward."""
        x = torch.randn(16, requires_grad=True)
        hooks = th.save_on_cpu(pin_memory=where == "small tensor")
        with contextlib.ExitStack() as stack:
            if where == "small tensor":
                stack.enter_context(simulated_device())
            if where == "allow_mutation":
                stack.enter_context(th.allow_mutation_on_saved_tensors())
            if where == "direct pack_hook call":
                stack.enter_context(th.saved_tensors_hooks(hooks.pack_hook, hooks.unpack_hook))
            else:
                stack.enter_context(hooks)
            y = getattr(x.sin(), op)()
            loss = y.sum()
            dropped = weakref.ref(y)
            del y, loss
            gc.collect()
            assert dropped() is None

    # --- offload logic, on the simulated device --------------------------------------------

    @given(program=offload_programs(), options=offload_options())
    def test_random_programs_match_plain_and_torch(
        self, program: OffloadProgram, options: dict[str, Any]
    ) -> None:
        """Random programs: grads under offloading equal plain autograd's and torch's."""
        plain = run_program(program)
        assert_grads_equal(run_program(program, torch.autograd.graph.save_on_cpu()), plain)
        with simulated_device() as sim:
            assert_grads_equal(run_program(program, th.save_on_cpu(**options)), plain)
        assert sim.live_sources() == 0
        with simulated_device(), use_save_guard(_GenericGuard()):
            assert_grads_equal(run_program(program, th.save_on_cpu(**options)), plain)

    @given(program=offload_programs(inplace=True), options=offload_options())
    def test_random_in_place_changes_never_give_a_wrong_gradient(
        self, program: OffloadProgram, options: dict[str, Any]
    ) -> None:
        """In-place changes: plain's grads, the save-time values' grads, or autograd's error."""
        plain = program_outcome(program)
        if isinstance(plain, RuntimeError):
            assert MODIFIED in str(plain)
        reference = run_program(program, clone_hooks())
        for guard in (VersionGuard(), _GenericGuard()):
            with simulated_device(), use_save_guard(guard):
                ours = program_outcome(program, th.save_on_cpu(**options))
            if isinstance(ours, RuntimeError):
                assert isinstance(ours, th.SavedTensorModifiedError)
                assert MODIFIED in str(ours)
                assert isinstance(plain, RuntimeError), "raised where plain autograd did not"
            else:
                assert_grads_equal(ours, reference if isinstance(plain, RuntimeError) else plain)

    def test_tensor_saved_by_several_ops_is_copied_once(self, sim: SimulatedEngine) -> None:
        """X feeding three ops is copied to the host once and fetched back once."""
        x = torch.randn(4, 4, requires_grad=True)
        ws = [torch.randn(4, 4, requires_grad=True) for _ in range(3)]

        def f() -> torch.Tensor:
            h = x.tanh()
            return sum((h * w).sum() for w in ws)  # type: ignore[return-value]

        expected = torch.autograd.grad(f(), [x, *ws])
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            loss = f()
        # h (saved by tanh and the three muls) and the three ws: 4 copies, not 7.
        assert len(copies(sim)) == 4
        assert_grads_equal(torch.autograd.grad(loss, [x, *ws]), expected)
        assert sorted(copies(sim, "to_device")) == [0, 1, 2, 3]

    def test_tensor_saved_at_two_versions_gets_two_copies(self, sim: SimulatedEngine) -> None:
        """A tensor changed in place between two saves is copied again, not served stale."""
        x = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)

        def f() -> torch.Tensor:
            h = x.exp()
            a = h * w
            with torch.no_grad():
                h.mul_(3)
            b = h * w
            return (a * b).sum()

        expected = torch.autograd.grad(f_with(clone_hooks(), f), (x, w))
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=0):
            loss = f()
        to_host = copies(sim)
        assert_grads_equal(torch.autograd.grad(loss, (x, w)), expected)
        # h at version 0, w, h at version 1 (w deduped), a, b.
        assert len(to_host) == 5

    def test_tensor_saved_at_two_versions_without_copies_raises(self) -> None:
        """The same program on the CPU path (no copies) raises autograd's error."""
        x = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu():
            h = x.exp()
            a = h * w
            with torch.no_grad():
                h.mul_(3)
            b = h * w
        with pytest.raises(th.SavedTensorModifiedError, match=MODIFIED):
            (a * b).sum().backward()

    def test_reused_id_is_not_mistaken_for_a_saved_tensor(self, sim: SimulatedEngine) -> None:
        """A new tensor at a dead tensor's id (and address) gets its own copy."""
        w = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=0):
            first = w.exp()  # exp saves its result
            loss = (first * 2).sum()  # a mul by a scalar saves nothing
            timeline = thread_timeline(first.device)
            stale = timeline.saved[id(first)]
            del first
            candidate = w * 1.5
            # Whether CPython puts the new tensor at the dead one's id is up to its allocator;
            # file the dead tensor's entry under the new id, as a reused id would find it.
            timeline.saved[id(candidate)] = stale
            loss = loss + candidate.sin().sum()
        n_copies = len(copies(sim))
        (grad,) = torch.autograd.grad(loss, w)
        assert n_copies == 2  # exp's result and candidate
        wd = w.detach()
        torch.testing.assert_close(grad, 2 * wd.exp() + 1.5 * (1.5 * wd).cos())

    def test_small_tensors_stay(self, sim: SimulatedEngine) -> None:
        """Tensors under min_offload_bytes are not copied; those at the threshold are."""
        x = torch.randn(4, requires_grad=True)  # 16 bytes
        y = torch.randn(5, requires_grad=True)  # 20 bytes
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=20):
            a = x.exp()
            b = y.exp()
        assert len(copies(sim)) == 1
        (a.sum() + b.sum()).backward()
        assert x.grad is not None
        assert y.grad is not None
        torch.testing.assert_close(x.grad, x.detach().exp())
        torch.testing.assert_close(y.grad, y.detach().exp())

    @pytest.mark.usefixtures("sim")
    def test_small_tensor_changed_in_place_raises(self, guard_path: None) -> None:
        """A tensor left on its device because of its size is guarded like a CPU tensor."""
        x = torch.randn(4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True):
            y = x.exp()
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(th.SavedTensorModifiedError, match=MODIFIED):
            y.sum().backward()

    @pytest.mark.parametrize("pin_memory", [False, True])
    def test_parameters_and_their_views_stay(self, sim: SimulatedEngine, pin_memory: bool) -> None:
        """Parameters and views of them (Linear saves weight.t()) are not copied by default."""
        model = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        expected = mlp_grads(model, x)
        with th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
            out = model(x)
        saved = [getattr(out.grad_fn, name) for name in ("_saved_mat2", "_saved_mat1")]
        assert_grads_equal(
            torch.autograd.grad(out.pow(2).sum(), list(model.parameters())), expected
        )
        # mat2 is weight.t(): handed back as-is, sharing the parameter's storage.
        assert isinstance(saved[0], torch.Tensor)
        assert saved[0].data_ptr() == model.weight.data_ptr()
        # mat1 is x, a copy.
        assert saved[1].data_ptr() != x.data_ptr()
        assert len(copies(sim)) == (1 if pin_memory else 0)

    def test_offload_parameters_copies_them(self, sim: SimulatedEngine) -> None:
        """offload_parameters=True copies parameters and views of them too."""
        model = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        expected = mlp_grads(model, x)
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0, offload_parameters=True)
        assert_grads_equal(mlp_grads(model, x, hooks), expected)
        assert len(copies(sim)) == 3  # x, weight.t() and the output (saved by pow)

    @pytest.mark.usefixtures("sim")
    def test_parameter_changed_in_place_raises(self, guard_path: None) -> None:
        """An optimizer-style update of a saved parameter before backward raises."""
        model = torch.nn.Linear(4, 4)
        with th.save_on_cpu(min_offload_bytes=0):
            loss = model(torch.randn(2, 4, requires_grad=True)).sum()  # saves weight.t()
        with torch.no_grad():
            model.weight.add_(1)
        with pytest.raises(th.SavedTensorModifiedError, match=MODIFIED):
            loss.backward()

    @pytest.mark.parametrize("pin_memory", [False, True])
    @pytest.mark.parametrize(
        "make",
        [
            lambda t: t,
            lambda t: t.t(),
            lambda t: t[:, ::2],
            lambda t: t[:1].expand(4, 4),
            lambda t: t[1:3],
        ],
        ids=["contiguous", "transposed", "strided-slice", "expanded", "offset-view"],
    )
    def test_restored_value_dtype_and_layout(
        self, pin_memory: bool, make: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """The unpacked tensor has the saved value, dtype, device and shape; dense strides kept."""
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            base = torch.randn(4, 4, dtype=dtype, requires_grad=True) * 1
            saved_view = make(base)
            with (
                simulated_device(),
                th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0),
            ):
                out = saved_view.sin()
            restored = out.grad_fn._saved_self  # type: ignore[union-attr]
            assert restored.dtype == dtype
            assert restored.device == saved_view.device
            assert restored.shape == saved_view.shape
            assert torch.equal(restored, saved_view)
            assert restored.data_ptr() != saved_view.data_ptr()
            if restored.stride() != saved_view.stride():
                assert restored.is_contiguous()
                assert copy_strides(saved_view) != saved_view.stride()

    @pytest.mark.usefixtures("sim")
    def test_restored_channels_last_keeps_strides(self) -> None:
        """A channels-last activation comes back channels-last."""
        x = torch.randn(2, 3, 4, 5, requires_grad=True).to(memory_format=torch.channels_last)
        with th.save_on_cpu(True, min_offload_bytes=0):
            out = x.sin()
        restored = out.grad_fn._saved_self  # type: ignore[union-attr]
        assert restored.stride() == x.stride()
        assert torch.equal(restored, x)

    @pytest.mark.parametrize("pin_memory", [False, True])
    @pytest.mark.usefixtures("sim")
    def test_integer_and_bool_saved_tensors(self, pin_memory: bool) -> None:
        """Index (int64) and mask (bool) tensors saved by gather and where come back intact."""
        x = torch.randn(6, 6, requires_grad=True)
        index = torch.randint(0, 6, (6, 3))

        def f() -> torch.Tensor:
            mask = x > 0
            return (torch.where(mask, x, x * 2).gather(1, index) ** 2).sum()

        expected = torch.autograd.grad(f(), x)
        with th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
            loss = f()
        assert_grads_equal(torch.autograd.grad(loss, x), expected)

    @pytest.mark.parametrize("simulated", [False, True])
    @pytest.mark.parametrize("pin_memory", [False, True])
    def test_sparse_tensors(self, simulated: bool, pin_memory: bool) -> None:
        """Sparse saved tensors come back sparse with their values; grads match plain."""
        indices = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
        sparse = torch.sparse_coo_tensor(
            indices, torch.randn(4), (4, 4), check_invariants=True
        ).coalesce()
        sparse.requires_grad_(True)
        dense = torch.randn(4, 3, requires_grad=True)

        def f() -> torch.Tensor:
            return torch.sparse.mm(sparse, dense).pow(2).sum()

        expected = torch.autograd.grad(f(), (sparse, dense))
        switch = simulated_device() if simulated else nullcontext()
        with switch:
            with th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
                loss = f()
            grads = torch.autograd.grad(loss, (sparse, dense))
        assert grads[0].layout == expected[0].layout
        assert torch.equal(grads[0].to_dense(), expected[0].to_dense())
        assert_grads_equal(grads[1:], expected[1:])

    @pytest.mark.parametrize("pin_memory", [False, True])
    @pytest.mark.usefixtures("sim")
    def test_double_backward(self, pin_memory: bool) -> None:
        """Grad of grad through offloaded tensors equals plain autograd's."""
        x = torch.randn(5, requires_grad=True)
        w = torch.randn(5, requires_grad=True)

        def second(context: AbstractContextManager[Any]) -> tuple[torch.Tensor, ...]:
            with context:
                y = (x.exp() * w).sin().sum()
            (gx,) = torch.autograd.grad(y, x, create_graph=True)
            return torch.autograd.grad(gx.pow(2).sum(), (x, w))

        expected = second(nullcontext())
        got = second(th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0))
        assert_grads_equal(got, expected)

    @pytest.mark.parametrize("use_reentrant", [False, True])
    @pytest.mark.parametrize("inside", [False, True])
    def test_checkpoint(self, use_reentrant: bool, inside: bool) -> None:
        """Works around and inside torch.utils.checkpoint, reentrant or not."""
        model = mlp(3)
        x = torch.randn(2, 8, requires_grad=True)
        params = list(model.parameters())
        plain_loss = model(x).pow(2).sum()
        plain_loss.backward()
        expected = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        model.zero_grad()

        def block(inp: torch.Tensor) -> torch.Tensor:
            if inside:
                with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
                    return model[2:](model[:2](inp))  # type: ignore[no-any-return]
            return model[2:](model[:2](inp))  # type: ignore[no-any-return]

        with simulated_device():
            outer = nullcontext() if inside else th.save_on_cpu(True, min_offload_bytes=0)
            with outer:
                out = checkpoint(block, x, use_reentrant=use_reentrant)
                loss = out.pow(2).sum()
            loss.backward()
        assert_grads_equal(tuple(p.grad for p in params), tuple(expected))

    @pytest.mark.usefixtures("sim")
    def test_retain_graph_backward_twice(self) -> None:
        """Two backward calls over one offloaded graph give the same grads."""
        model = mlp()
        x = torch.randn(3, 8)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            loss = model(x).pow(2).sum()
        first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(model.parameters()))
        assert_grads_equal(second, first)
        assert_grads_equal(first, mlp_grads(model, x))

    def test_grad_that_stops_early_drops_its_prefetches(self, sim: SimulatedEngine) -> None:
        """autograd.grad w.r.t. a middle tensor: prefetched leftovers die with the graph task."""
        x = torch.randn(4, 4, requires_grad=True)

        def f() -> tuple[torch.Tensor, torch.Tensor]:
            mid = x.exp().sin()  # exp's result is saved by exp and sin: never unpacked below
            return mid, mid.tanh().cos()

        mid, out = f()
        expected = torch.autograd.grad(out.sum(), mid)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=3):
            mid, out = f()
        got = torch.autograd.grad(out.sum(), mid)
        fetched = set(copies(sim, "to_device"))
        handed = set(copies(sim, "hand_over"))
        assert fetched - handed == {0}
        assert_grads_equal(got, expected)

    @pytest.mark.usefixtures("sim")
    def test_backward_that_raises_leaves_no_state(self) -> None:
        """A backward that raises part-way drops the prefetch state (checked by the fixture)."""

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
                return t.clone()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                raise ValueError("boom")

        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            out = Boom.apply(x.exp()).sin().tanh()
        with pytest.raises(ValueError, match="boom"):
            out.sum().backward()

    @pytest.mark.usefixtures("sim")
    def test_unpack_outside_backward(self) -> None:
        """grad_fn._saved_* reads work on offloaded tensors and leave no per-backward state."""
        x = torch.randn(4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            y = x.exp()
        saved = y.grad_fn._saved_result  # type: ignore[union-attr]
        assert torch.equal(saved, y)
        assert saved.data_ptr() != y.data_ptr()
        y.sum().backward()
        assert th.live_graph_tasks() == 0

    # --- side-stream rules, on the simulated device ----------------------------------------

    @pytest.mark.usefixtures("sim")
    def test_write_while_copy_in_flight_raises(self) -> None:
        """An in-place write before the copy is fenced raises instead of using changed data."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=4):
            h = x.exp()
            loss = (h * 2).sum() + h.sin().sum()
            with torch.no_grad():
                h.add_(100)  # the simulated copy has not run yet: it would read this
        with pytest.raises(th.SavedTensorModifiedError, match="still copying this tensor"):
            loss.backward()

    @pytest.mark.usefixtures("sim")
    def test_unguarded_fence_would_give_a_wrong_gradient(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The simulation is faithful: without the version check the late copy reads the write."""
        fence = Offloaded.fence

        def fence_without_check(record: Offloaded) -> None:
            fence(record)
            record.raced = None

        monkeypatch.setattr(Offloaded, "fence", fence_without_check)
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=4):
            h = x.exp()
            loss = h.sin().sum()
            with torch.no_grad():
                h.add_(100)
        (grad,) = torch.autograd.grad(loss, x)
        e = x.detach().exp()
        right = e.cos() * e
        wrong = (e + 100).cos() * (e + 100)  # both exp's and sin's saved value read the write
        torch.testing.assert_close(grad, wrong)
        assert not torch.allclose(grad, right)

    @pytest.mark.usefixtures("sim")
    def test_write_after_fence_uses_save_time_value(self) -> None:
        """With max_in_flight=0 every copy is ordered before the next op: writes are fine."""
        x = torch.randn(4, 4, requires_grad=True)

        def f(context: AbstractContextManager[Any]) -> tuple[torch.Tensor, ...]:
            with context:
                h = x.exp()
                loss = h.sin().sum()
                with torch.no_grad():
                    h.add_(100)
            return torch.autograd.grad(loss, x)

        expected = f(clone_hooks())
        got = f(th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=0))
        assert_grads_equal(got, expected)

    @pytest.mark.usefixtures("sim")
    def test_write_after_exit_uses_save_time_value(self) -> None:
        """Leaving the context fences every copy: later writes do not reach the saved value."""
        x = torch.randn(4, 4, requires_grad=True)
        with clone_hooks():
            h = x.exp()
            loss = h.sin().sum()
        with torch.no_grad():
            h.add_(100)
        expected = torch.autograd.grad(loss, x)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=8):
            h = x.exp()
            loss = h.sin().sum()
        with torch.no_grad():
            h.add_(100)
        assert_grads_equal(torch.autograd.grad(loss, x), expected)

    @pytest.mark.usefixtures("sim")
    def test_mutation_tolerant_guard_fences_at_once(self) -> None:
        """Under a guard that lets saved tensors change, a write right after the save is fine."""

        class Cloning:
            """Clones at save what pack returned as-is (a stand-in for a mutation guard)."""

            lets_saved_tensors_change = True
            version_check_may_be_inlined = False

            def wrap(self, pack: Any, unpack: Any) -> tuple[Any, Any]:
                def guarded_pack(t: torch.Tensor) -> object:
                    packed = pack(t)
                    return packed.clone() if packed is t else packed

                return guarded_pack, unpack

        x = torch.randn(4, 4, requires_grad=True)

        def f(context: AbstractContextManager[Any]) -> tuple[torch.Tensor, ...]:
            with context:
                h = x.exp()
                loss = h.sin().sum()
                with torch.no_grad():
                    h.add_(100)
            return torch.autograd.grad(loss, x)

        expected = f(clone_hooks())
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=8)
        with use_save_guard(Cloning()):
            got = f(hooks)
        assert_grads_equal(got, expected)
        assert hooks.max_in_flight == 8  # the entry derived its window; the options are intact

    @pytest.mark.parametrize("source", ["released", "held"])
    @pytest.mark.usefixtures("sim")
    def test_fence_that_does_not_wait_is_caught(
        self, monkeypatch: pytest.MonkeyPatch, source: str
    ) -> None:
        """The simulation is faithful: a fence that orders nothing fails, or a write leaks in."""
        held: list[torch.Tensor | None] = []

        def fence_without_wait(record: Offloaded) -> None:
            if source == "held":
                held.append(record.source)  # keeps the device memory, as a real fence does
            record.source = record.stream = record.issuer = None

        monkeypatch.setattr(Offloaded, "fence", fence_without_wait)
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=0):
            h = x.exp()
            loss = h.sin().sum()
        with torch.no_grad():
            h.add_(100)  # after the context: correct fences order this after the copy
        if source == "released":
            with pytest.raises(AssertionError, match="released before the copy ran"):
                torch.autograd.grad(loss, x)
            return
        (grad,) = torch.autograd.grad(loss, x)
        e = x.detach().exp()
        torch.testing.assert_close(grad, (e + 100).cos() * (e + 100))

    def test_sources_are_held_until_fenced_and_released_after(self, sim: SimulatedEngine) -> None:
        """At most max_in_flight sources are held in forward; none after the context exits."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=2):
            h = x
            for _ in range(6):
                h = h.sin()  # saves its input
                assert sim.live_sources() <= 2
        assert sim.live_sources() == 0
        waits = [i for i, (op, _) in enumerate(sim.log) if op == "wait"]
        sends = [i for i, (op, _) in enumerate(sim.log) if op == "to_host"]
        assert len(waits) == len(sends) == 6
        h.sum().backward()  # the simulation raises if a source died before its copy ran

    def test_context_exit_fences_when_body_raises(self) -> None:
        """Copies are fenced (sources released) even when the body raises."""
        x = torch.randn(4, 4, requires_grad=True)
        kept: list[torch.Tensor] = []

        def body() -> None:
            with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=8):
                kept.append(x.exp().sin())
                raise KeyError("body")

        with simulated_device() as sim:
            with pytest.raises(KeyError):
                body()
            assert sim.sources
            assert sim.live_sources() == 0

    @pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
    def test_prefetch_order(self, sim: SimulatedEngine, prefetch: int) -> None:
        """Backward fetches the next `prefetch` saved tensors ahead, in reverse save order."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=prefetch):
            h = x
            for _ in range(8):
                h = h.sin()
        sim.log.clear()
        h.sum().backward()
        fetches = copies(sim, "to_device")
        handed = copies(sim, "hand_over")
        assert fetches == list(range(7, -1, -1))
        assert handed == list(range(7, -1, -1))
        log = sim.log
        for seq in range(8):
            fetched_at = log.index(("to_device", seq))
            handed_at = log.index(("hand_over", seq))
            # Seq s is fetched while seq s + prefetch is handed over (or at once if prefetch=0).
            ahead = min(seq + prefetch, 7)
            assert fetched_at < log.index(("hand_over", ahead)) or ahead == seq
            assert fetched_at < handed_at
            in_flight = {tag for op, tag in log[:handed_at] if op == "to_device"} - {
                tag for op, tag in log[:handed_at] if op == "hand_over"
            }
            assert len(in_flight) <= prefetch + 1

    def test_prefetch_crosses_per_layer_contexts(self, sim: SimulatedEngine) -> None:
        """With one context per layer, the previous layer's tensors are prefetched."""
        x = torch.randn(4, 4, requires_grad=True)
        h = x
        for _ in range(4):
            with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=1):
                h = h.sin()
        sim.log.clear()
        h.sum().backward()
        for seq in range(3):
            assert sim.log.index(("to_device", seq)) < sim.log.index(("hand_over", seq + 1))

    def test_prefetch_stays_within_one_forward(self, sim: SimulatedEngine) -> None:
        """Two forwards, then their backwards: each backward fetches only its own tensors once."""
        w = torch.nn.Parameter(torch.randn(8, 8))
        expected = []
        for seed in range(2):
            torch.manual_seed(seed)
            h = torch.randn(4, 8)
            for _ in range(3):
                h = (h @ w).tanh()
            expected.append(torch.autograd.grad(h.sum(), w)[0])
        losses = []
        for seed in range(2):  # gradient accumulation: the micro-batch forwards come first
            torch.manual_seed(seed)
            with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=2):
                h = torch.randn(4, 8)
                for _ in range(3):
                    h = (h @ w).tanh()
                losses.append(h.sum())
        assert copies(sim) == list(range(8))  # per micro-batch: h, then three tanh outputs
        sim.log.clear()
        grads = [torch.autograd.grad(losses[1], w)[0]]
        assert copies(sim, "to_device") == [7, 6, 5, 4]
        grads.insert(0, torch.autograd.grad(losses[0], w)[0])
        assert copies(sim, "to_device") == [7, 6, 5, 4, 3, 2, 1, 0]
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)

    def test_pinned_buffers_are_reused_across_steps(self, sim: SimulatedEngine) -> None:
        """The second step allocates no host buffers; all are back in the pool after backward."""
        model = mlp()
        x = torch.randn(3, 8)
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0)
        mlp_grads(model, x, hooks)
        after_first = th.save_on_cpu.stats("cpu")
        for _ in range(3):
            mlp_grads(model, x, hooks)
        after_more = th.save_on_cpu.stats("cpu")
        assert after_first.host_allocations > 0
        assert after_more.host_allocations == after_first.host_allocations
        assert after_more.host_bytes_in_use == 0
        assert after_more.host_bytes_free == after_more.host_bytes_peak

    def test_copied_bytes_are_counted(self, sim: SimulatedEngine) -> None:
        """Each offloaded tensor moves its bytes once each way in a plain backward."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            y = x.exp().sin()
        y.sum().backward()
        stats = th.save_on_cpu.stats("cpu")
        # exp saves its result and sin saves its input, the same tensor: one copy.
        assert stats.bytes_to_host == 64
        assert stats.bytes_to_device == 64

    @given(depth=st.integers(0, 3), in_flight=st.integers(0, 3))
    def test_store_is_empty_after_backward(self, depth: int, in_flight: int) -> None:
        """Any prefetch depth and copy window leaves the graph-task store empty after backward."""
        x = torch.randn(4, 4, requires_grad=True)
        with simulated_device():
            with th.save_on_cpu(
                pin_memory=True, min_offload_bytes=0, prefetch=depth, max_in_flight=in_flight
            ):
                y = x.exp().sin().tanh()
            y.sum().backward()
        assert th.live_graph_tasks() == 0

    def test_default_device_does_not_move_host_buffers(self) -> None:
        """Under torch.set_default_device("meta") host copies are still made on the CPU."""
        x = torch.randn(4, 4, requires_grad=True, device="cpu")
        expected = torch.autograd.grad(x.exp().sin().sum(), x)
        for pin_memory in (False, True):
            with simulated_device() as sim, torch.device("meta"):
                with th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
                    loss = x.exp().sin().sum()
                assert_grads_equal(torch.autograd.grad(loss, x), expected)
            assert len(sim.host_buffers) == (1 if pin_memory else 0)
            assert all(b.device.type == "cpu" for b in sim.host_buffers)

    # --- threads and nesting ---------------------------------------------------------------

    @pytest.mark.usefixtures("sim")
    def test_one_instance_on_several_threads(self) -> None:
        """The same instance entered on four threads gives each its correct grads."""
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0, max_in_flight=1)
        model = mlp()
        inputs = [torch.randn(3, 8) for _ in range(4)]
        expected = [mlp_grads(model, x) for x in inputs]
        results: dict[int, tuple[torch.Tensor, ...]] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for _ in range(5):
                    results[i] = mlp_grads(model, inputs[i], hooks)
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        for i in range(4):
            assert_grads_equal(results[i], expected[i])

    def test_nested_contexts(self, sim: SimulatedEngine) -> None:
        """Nested entries (same instance or not) apply the innermost and unwind in order."""
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0)
        x = torch.randn(4, requires_grad=True)
        with hooks:
            a = x.exp()
            with hooks:
                b = a.sin()
                with th.save_on_cpu(min_offload_bytes=0):  # synchronous: no log entries
                    c = b.tanh()
            d = c.cos()
        # a (saved by exp and sin); c is copied synchronously by the innermost context and
        # that copy is reused by cos.
        assert len(copies(sim)) == 1
        (grad,) = torch.autograd.grad(d.sum(), x)
        (expected,) = torch.autograd.grad(x.exp().sin().tanh().cos().sum(), x)
        torch.testing.assert_close(grad, expected)

    # --- docs ------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("page", "section"),
        [("save_on_cpu.md", None), ("differences.md", "## save_on_cpu")],
    )
    def test_docs_examples_run(
        self, page: str, section: str | None, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The CPU examples of the docs run and print what their comments show."""
        for code in doc_examples(page, section):
            if "needs a GPU" in code and not torch.cuda.is_available():
                continue
            capsys.readouterr()
            exec(compile(code, page, "exec"), {})  # the docs' own examples
            assert capsys.readouterr().out.splitlines() == shown_output(code)


def doc_examples(page: str, section: str | None) -> list[str]:
    """The python code blocks of ``docs/<page>``, only those under ``section`` if given."""
    text = (Path(__file__).parents[2] / "docs" / page).read_text()
    if section is not None:
        text = text.split(section + "\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, f"no examples in {page}"
    return blocks


def shown_output(code: str) -> list[str]:
    """The output an example shows: the comment lines right after its last print()."""
    lines = code.splitlines()
    prints = [i for i, line in enumerate(lines) if "print(" in line]
    shown: list[str] = []
    if prints:
        for line in lines[prints[-1] + 1 :]:
            if not line.startswith("# "):
                break
            shown.append(line[2:])
    return shown


def f_with(context: AbstractContextManager[Any], f: Callable[[], torch.Tensor]) -> torch.Tensor:
    with context:
        return f()


class TestStats:
    """save_on_cpu.stats: what the side-stream path moved and the host memory it holds."""

    def test_device_without_an_engine_has_zero_stats(self) -> None:
        """The CPU has no side stream: every count is 0, in a frozen record."""
        stats = th.save_on_cpu.stats("cpu")
        assert stats == OffloadStats(0, 0, 0, 0, 0, 0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.bytes_to_host = 1  # type: ignore[misc]  # the point: it is read-only

    def test_counts_follow_one_step(self, sim: SimulatedEngine) -> None:
        """Bytes each way, host memory in use while the graph lives, and free after it dies."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            y = x.exp().sin().tanh()  # saves exp's result (once, for exp and sin) and sin's
        held = th.save_on_cpu.stats("cpu")
        assert (held.bytes_to_host, held.host_bytes_in_use, held.bytes_to_device) == (128, 128, 0)
        y.sum().backward()
        del y
        done = th.save_on_cpu.stats("cpu")
        assert (done.bytes_to_device, done.host_bytes_in_use) == (128, 0)
        assert done.host_bytes_free == done.host_bytes_peak == 128
        assert done.host_allocations == len(sim.host_buffers) == 2


class TestCopyEngineProvider:
    """The provider save_on_cpu asks for copy engines."""

    def test_provider_is_restored_after_an_error(self) -> None:
        """use_copy_engine_provider puts the previous provider back, however it exits."""
        before = copy_engine_provider()
        inside: list[object] = []

        def body() -> None:
            with simulated_device():
                inside.append(copy_engine_provider())
                raise KeyError("body")

        with pytest.raises(KeyError):
            body()
        assert inside
        assert inside[0] is not before
        assert copy_engine_provider() is before

    def test_entries_keep_the_engine_they_got(self) -> None:
        """A context entered under the simulation keeps its engine after the provider changes."""
        x = torch.randn(4, requires_grad=True)
        with simulated_device() as sim:
            hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0)
            hooks.__enter__()
        try:
            y = x.exp()
        finally:
            hooks.__exit__(None, None, None)
        assert copies(sim) == [0]
        y.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, x.detach().exp())


class TestHostPool:
    """The pool of host buffers behind save_on_cpu(pin_memory=True)."""

    def test_reuses_buffers_of_the_same_size(self) -> None:
        """A released buffer is handed out again for the same size."""
        pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        first = pool.acquire(64)
        pool.release(first)
        assert pool.acquire(64) is first
        assert pool.stats().host_allocations == 1

    def test_holds_no_more_than_the_peak(self) -> None:
        """Sizes that change every step do not pile up: held bytes stay at the peak in use."""
        pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        for step in range(20):
            buffers = [pool.acquire(100 + step), pool.acquire(200 + step)]
            for buffer in buffers:
                pool.release(buffer)
            stats = pool.stats()
            assert stats.host_bytes_in_use + stats.host_bytes_free <= stats.host_bytes_peak
        assert pool.stats().host_bytes_peak <= 2 * (200 + 19)

    def test_release_from_another_thread(self) -> None:
        """Buffers released on another thread are filed by the next acquire."""
        pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
        buffer = pool.acquire(32)
        thread = threading.Thread(target=pool.release, args=(buffer,))
        thread.start()
        thread.join()
        assert pool.acquire(32) is buffer


class TestCopyStrides:
    """The layout of host copies."""

    @pytest.mark.parametrize(
        ("make", "dense"),
        [
            (lambda: torch.empty(3, 4), True),
            (lambda: torch.empty(3, 4).t(), True),
            (lambda: torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last), True),
            (lambda: torch.empty(3, 4)[:, ::2], False),
            (lambda: torch.empty(1, 4).expand(3, 4), False),
            (lambda: torch.empty(0, 4).t(), True),
            (lambda: torch.empty(3, 1, 4)[:, :, 1:3], False),
        ],
    )
    def test_dense_layouts_are_kept(self, make: Callable[[], torch.Tensor], dense: bool) -> None:
        """Dense layouts keep their strides; others become contiguous."""
        t = make()
        strides = copy_strides(t)
        if dense:
            assert strides == t.stride()
        else:
            assert strides == torch.empty(t.shape).stride()


class TestDeviceRules:
    """Rules of NOTE [Offloading saved tensors without races] a device brings, on the simulation."""

    @staticmethod
    def _bits_program() -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
        a = torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)
        b = torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)
        z = torch.randn(4, 4, dtype=torch.complex64)
        w = torch.randn(4, 4, requires_grad=True)

        def run() -> torch.Tensor:
            # mm saves b.mH (a conjugate view); mul saves z.conj().imag (a negative view).
            return (a @ b.mH).abs().sum() + (z.conj().imag * w).sum()

        return [a, b, w], run

    def _offloaded_grads(self, sim: SimulatedEngine) -> list[torch.Tensor]:
        leaves, run = self._bits_program()
        expected = torch.autograd.grad(run(), leaves)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            loss = run()
        assert copies(sim), "nothing went through the simulated device"
        got = torch.autograd.grad(loss, leaves)
        return [g - e for g, e in zip(got, expected, strict=True)]

    def test_conjugate_and_negative_views_keep_their_values(self, sim: SimulatedEngine) -> None:
        """A saved conj or neg view comes back with its bits: copies move raw bytes, as a DMA."""
        for difference in self._offloaded_grads(sim):
            assert difference.abs().max().item() == 0.0

    def test_dropping_the_bits_is_caught(
        self, sim: SimulatedEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Negative control: copying a conj/neg view as it is gives wrong gradients here."""
        from tensorhooks._activation_offload import records

        monkeypatch.setattr(records, "strip_view_bits", lambda t: (t, (False, False)))
        worst = max(d.abs().max().item() for d in self._offloaded_grads(sim))
        assert worst > 1e-3

    def test_capture_is_refused(self, sim: SimulatedEngine) -> None:
        """An offload while the stream is being captured raises OffloadCaptureError."""
        x = torch.randn(4, 4, requires_grad=True)
        sim.capture = True
        with (
            pytest.raises(th.OffloadCaptureError, match=r"being captured into a graph"),
            th.save_on_cpu(pin_memory=True, min_offload_bytes=0),
        ):
            x.exp()
        assert not copies(sim)
        sim.capture = False
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            y = x.exp()
        y.sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, x.detach().exp())

    def test_out_of_memory_in_prefetch_does_not_fail_backward(self, sim: SimulatedEngine) -> None:
        """A prefetch that runs out of device memory gives up; the unpack fetches it later."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=2):
            h = x
            for _ in range(6):
                h = h.sin()
        sim.out_of_memory_after = 1  # the first unpack's own copy goes through, its prefetch not
        (grad,) = torch.autograd.grad(h.sum(), x)
        assert sim.out_of_memory_after is None, "no copy back ran out of memory"
        expected = x.detach()
        ref = expected.requires_grad_()
        h_ref = ref
        for _ in range(6):
            h_ref = h_ref.sin()
        (grad_ref,) = torch.autograd.grad(h_ref.sum(), ref)
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0)

    def test_out_of_memory_when_needed_still_raises(self, sim: SimulatedEngine) -> None:
        """The copy backward needs now is not speculative: its out-of-memory error propagates."""
        x = torch.randn(4, 4, requires_grad=True)
        with th.save_on_cpu(pin_memory=True, min_offload_bytes=0, prefetch=2):
            h = x.sin().sin()
        sim.out_of_memory_after = 0
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            h.sum().backward()
        assert th.live_graph_tasks() == 0


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
class TestSaveOnCpuCuda:
    """save_on_cpu on a real CUDA device: streams, events, prefetch, allocator reuse."""

    def _mlp(self, width: int = 512, layers: int = 6) -> torch.nn.Sequential:
        return mlp(layers, width).cuda()

    def test_conjugate_and_negative_views(self) -> None:
        """Saved conj and neg views of many MiB come back with their values (raw copy + bits)."""
        a = torch.randn(2048, 1024, dtype=torch.complex64, device="cuda", requires_grad=True)
        b = torch.randn(1024, 1024, dtype=torch.complex64, device="cuda", requires_grad=True)
        z = torch.randn(2048, 1024, dtype=torch.complex64, device="cuda")
        w = torch.randn(2048, 1024, device="cuda", requires_grad=True)

        def loss() -> torch.Tensor:
            return (a @ b.mH).abs().sum() + (z.conj().imag * w).sum()

        expected = torch.autograd.grad(loss(), [a, b, w])
        with th.save_on_cpu(pin_memory=True):
            out = loss()
        torch.cuda._sleep(10_000_000)  # keep the stream busy so that a raced copy would show
        for got, want in zip(torch.autograd.grad(out, [a, b, w]), expected, strict=True):
            torch.testing.assert_close(got, want)

    def test_capture_is_refused(self) -> None:
        """Offloading under CUDA graph capture raises OffloadCaptureError."""
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # x was made on the current stream
        with torch.cuda.stream(stream):
            x.exp()  # warm-up outside capture
        with (
            pytest.raises(th.OffloadCaptureError, match="being captured"),
            torch.cuda.graph(graph, stream=stream),
            th.save_on_cpu(pin_memory=True),
        ):
            x.exp()

    def test_inside_allow_mutation(self) -> None:
        """save_on_cpu inside allow_mutation_on_saved_tensors on CUDA: right grads, no raise."""
        model = self._mlp()
        x = torch.randn(64, 512, device="cuda")
        expected = mlp_grads(model, x)
        with th.allow_mutation_on_saved_tensors():
            got = mlp_grads(model, x, th.save_on_cpu(pin_memory=True, min_offload_bytes=0))
        assert_grads_equal(got, expected)

    @pytest.mark.parametrize("pin_memory", [False, True])
    def test_grads_match_plain(self, pin_memory: bool) -> None:
        """An offloaded MLP on CUDA has plain autograd's grads, values restored on the device."""
        model = self._mlp()
        x = torch.randn(64, 512, device="cuda")
        expected = mlp_grads(model, x)
        hooks = th.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0)
        for _ in range(3):
            assert_grads_equal(mlp_grads(model, x, hooks), expected)
        torch.cuda.synchronize()

    def test_activations_leave_the_device(self) -> None:
        """Device memory held between forward and backward drops with offloading."""
        model = self._mlp(1024, 8)
        x = torch.randn(256, 1024, device="cuda")

        def held(context: AbstractContextManager[Any]) -> int:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            with context:
                loss = model(x).pow(2).sum()
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated() - before
            loss.backward()
            model.zero_grad(set_to_none=True)
            return after

        plain = held(nullcontext())
        offloaded = held(th.save_on_cpu(pin_memory=True))
        assert offloaded < 0.3 * plain

    @staticmethod
    def _write_right_after_save(max_in_flight: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Save ``x * 2``, write it in place at once; the input's gradient and the true one."""
        x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
        with th.save_on_cpu(pin_memory=True, max_in_flight=max_in_flight):
            h = x * 2
            loss = h.sin().sum()
            with torch.no_grad():
                h.add_(100)
        (grad,) = torch.autograd.grad(loss, x)
        return grad, (x.detach() * 2).cos() * 2

    def test_write_while_copying_is_caught(self) -> None:
        """A write right after the save, while its copy is in flight, raises at unpack.

        A deliberate race of the user's (the write and the copy are unordered), so it is also
        one of the negative controls the sanitizer run expects to catch.
        """
        with pytest.raises(th.SavedTensorModifiedError, match="still copying"):
            self._write_right_after_save(max_in_flight=4)

    def test_write_after_a_fenced_save(self) -> None:
        """With max_in_flight=0 the copy is ordered before the write: the save-time value."""
        grad, expected = self._write_right_after_save(max_in_flight=0)
        torch.testing.assert_close(grad, expected)

    def test_write_after_exit_is_ordered_after_the_copy(self) -> None:
        """Writes after the context are ordered after the copies: save-time values, every time."""
        x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
        expected = (x.detach() * 2).cos() * 2
        for _ in range(20):
            with th.save_on_cpu(pin_memory=True):
                h = x * 2
                loss = h.sin().sum()
            h.fill_(float("nan"))
            torch.testing.assert_close(torch.autograd.grad(loss, x)[0], expected)

    def test_freed_memory_reused_by_the_allocator(self) -> None:
        """A tensor freed after save and its address reused by a new tensor: both values kept."""
        w = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        with th.save_on_cpu(pin_memory=True, max_in_flight=0):
            first = w.exp()
            ptr = first.data_ptr()
            loss = first.sin().sum()
            del first
            candidates = [w.cos() for _ in range(4)]
            second = next(c for c in candidates if c.data_ptr() == ptr)
            loss = loss + second.sin().sum()
        (grad,) = torch.autograd.grad(loss, w)
        wd = w.detach()
        expected = wd.exp().cos() * wd.exp() - wd.cos().cos() * wd.sin()
        torch.testing.assert_close(grad, expected)

    def test_prefetch_overlaps_and_is_correct(self) -> None:
        """A deep chain with prefetch: correct grads, each tensor fetched once."""
        x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        with th.save_on_cpu(pin_memory=True, prefetch=3):
            h = x
            for _ in range(16):
                h = h.sin()
        before = th.save_on_cpu.stats(x.device).bytes_to_device
        h.sum().backward()
        assert th.save_on_cpu.stats("cuda").bytes_to_device - before == 16 * x.nbytes
        with torch.no_grad():
            expected = torch.ones_like(x)
            values = [x.detach()]
            for _ in range(16):
                values.append(values[-1].sin())
            for value in reversed(values[:-1]):
                expected = expected * value.cos()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, expected)

    def test_pinned_pool_reused_on_cuda(self) -> None:
        """Steps after the first allocate no pinned memory."""
        model = self._mlp()
        x = torch.randn(64, 512, device="cuda")
        hooks = th.save_on_cpu(pin_memory=True, min_offload_bytes=0)
        mlp_grads(model, x, hooks)
        allocations = th.save_on_cpu.stats(x.device).host_allocations
        assert allocations > 0
        for _ in range(3):
            mlp_grads(model, x, hooks)
        assert th.save_on_cpu.stats(x.device).host_allocations == allocations

    def test_forward_on_a_side_stream_of_its_own(self) -> None:
        """A forward pass run on a user stream is fenced on that stream."""
        model = self._mlp()
        x = torch.randn(64, 512, device="cuda")
        expected = mlp_grads(model, x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = mlp_grads(model, x, th.save_on_cpu(pin_memory=True, min_offload_bytes=0))
        torch.cuda.current_stream().wait_stream(stream)
        assert_grads_equal(got, expected)

    @given(program=offload_programs(inplace=True), options=offload_options())
    def test_random_programs_on_cuda(
        self, program: OffloadProgram, options: dict[str, Any]
    ) -> None:
        """Random programs on CUDA: plain's grads, save-time grads, or autograd's error."""
        with torch.device("cuda"):
            try:
                plain: tuple[torch.Tensor | None, ...] | None = run_program(program)
            except RuntimeError:
                plain = None
            reference = run_program(program, clone_hooks())
            try:
                grads = run_program(program, th.save_on_cpu(**options))
            except th.SavedTensorModifiedError:
                assert plain is None
                return
        assert_grads_equal(grads, plain if plain is not None else reference)


# The stream rules on a real device, each with a negative control: the same check with the rule
# patched out must fail, or the check proves nothing. The streams are kept busy
# (``torch.cuda._sleep``) and freed blocks are poisoned, so a missing wait shows on an idle GPU.
_SPIN_CYCLES = 50_000_000  # tens of milliseconds of a busy stream


def _poisoned_block(nbytes: int) -> None:
    """Leave a freed block of ``nbytes`` filled with NaN, for the next allocation to get."""
    torch.empty(nbytes // 4, device="cuda").fill_(float("nan"))


@pytest.mark.cuda
@requires_cuda
class TestStreamRulesCuda:
    """Rules 1-3 of NOTE [Offloading saved tensors without races], each shown to be needed."""

    def test_the_stream_engine_serves_cuda(self) -> None:
        """CUDA tensors go through the side-stream engine (not the synchronous path)."""
        from tensorhooks._activation_offload.copy_engines import StreamEngine

        engine = copy_engine_provider().engine_for(torch.device("cuda", 0))
        assert isinstance(engine, StreamEngine)
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        with th.save_on_cpu(pin_memory=True):
            y = x.exp()
        assert isinstance(y.grad_fn._raw_saved_result.data, Offloaded)  # type: ignore[union-attr]

    @staticmethod
    def _saved_after_busy_producer() -> tuple[torch.Tensor, torch.Tensor]:
        """Grad of sin(x * 2), with x * 2 produced behind a busy stream into a poisoned block."""
        x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
        expected = (x.detach() * 2).cos() * 2
        _poisoned_block(x.nbytes)
        with th.save_on_cpu(pin_memory=True, max_in_flight=0):
            torch.cuda._sleep(_SPIN_CYCLES)
            loss = (x * 2).sin().sum()  # mul's output is saved by sin; produced after the spin
        (grad,) = torch.autograd.grad(loss, x)
        return grad, expected

    def test_copy_waits_for_the_producer(self) -> None:
        """Rule 1: the device-to-host copy reads the finished value."""
        grad, expected = self._saved_after_busy_producer()
        torch.testing.assert_close(grad, expected)

    def test_copy_without_producer_wait_is_caught(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Negative control of rule 1: without the wait, the copy reads the poisoned block."""
        from tensorhooks._activation_offload.copy_engines import StreamEngine

        def to_host(self: StreamEngine, source: torch.Tensor, host: torch.Tensor, _: Any) -> Any:
            with self.module.stream(self.stream):
                host.copy_(source, non_blocking=True)
                return self.stream.record_event()

        monkeypatch.setattr(StreamEngine, "to_host", to_host)
        grad, expected = self._saved_after_busy_producer()
        assert not torch.allclose(grad, expected, equal_nan=False)

    @staticmethod
    def _prefetched_chain() -> tuple[torch.Tensor, torch.Tensor]:
        """Backward over a chain with prefetch, the compute stream kept busy at every unpack."""
        x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        with th.save_on_cpu(pin_memory=True, prefetch=2):
            h = x
            for _ in range(8):
                h = h.sin()
                h.register_hook(lambda g: torch.cuda._sleep(_SPIN_CYCLES // 8) or g)
        (grad,) = torch.autograd.grad(h.sum(), x)
        with torch.no_grad():
            expected = torch.ones_like(x)
            values = [x.detach()]
            for _ in range(8):
                values.append(values[-1].sin())
            for value in reversed(values[:-1]):
                expected = expected * value.cos()
        return grad, expected

    def test_prefetched_memory_kept_until_the_consumer_is_done(self) -> None:
        """Rules 2-3: prefetched tensors are not recycled while the consumer still reads them."""
        grad, expected = self._prefetched_chain()
        torch.testing.assert_close(grad, expected)

    def test_hand_over_without_record_stream_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Negative control of rule 3: without record_stream the side stream reuses the memory."""
        from tensorhooks._activation_offload.copy_engines import StreamEngine

        def hand_over(self: StreamEngine, tensor: torch.Tensor, stream: Any, event: Any) -> None:
            stream.wait_event(event)

        monkeypatch.setattr(StreamEngine, "hand_over", hand_over)
        grad, expected = self._prefetched_chain()
        assert not torch.allclose(grad, expected)
