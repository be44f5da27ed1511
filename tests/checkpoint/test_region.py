"""tensorhooks.checkpoint: torch's non-reentrant semantics, state in the store, compositions."""

from __future__ import annotations

import copy
import functools
import gc
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorhooks
from tensorhooks import CheckpointError, CheckpointPolicy, checkpoint
from tensorhooks._core.torch_compat import top_saved_tensors_hooks
from tests.checkpoint.common import (
    OpCounter,
    assert_same,
    block_of,
    grads,
    input_tensor,
    mm_policy,
    th_ckpt,
    torch_ckpt,
    weights,
)
from tests.simdevice import simulated_device
from tests.strategies import BackwardFailedError, FailingBackward, Program, backwards, programs

aten = torch.ops.aten


# --- differential: random programs ----------------------------------------------------------------


def _run_with_region(
    program: Program,
    leaves: Sequence[torch.Tensor],
    start: int,
    stop: int,
    wrap: Callable[..., Any] | None,
) -> list[torch.Tensor]:
    """Run ``program`` with its steps ``start:stop`` inside ``wrap`` (a checkpoint) or plainly."""
    head = Program(program.n_leaves, program.steps[:start], program.seed)
    values = head.run(leaves)
    region = Program(len(values), program.steps[start:stop], program.seed)

    def body(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(region.run(inputs)[len(inputs) :])

    produced = body(*values) if wrap is None else wrap(body, *values)
    values = values + list(produced)
    tail = Program(len(values), program.steps[stop:], program.seed)
    return tail.run(values)


@st.composite
def _regions(draw: st.DrawFn) -> tuple[Program, int, int]:
    program = draw(programs(min_steps=1, max_steps=8))
    start = draw(st.integers(0, len(program.steps) - 1))
    stop = draw(st.integers(start + 1, len(program.steps)))
    return program, start, stop


@given(data=st.data(), region=_regions())
def test_matches_plain_autograd_and_torch_on_random_programs(
    data: st.DataObject, region: tuple[Program, int, int]
) -> None:
    """Every backward variant gives plain autograd's and torch's checkpoint's gradients."""
    program, start, stop = region
    backward = data.draw(backwards(program))
    results = []
    for wrap in (None, torch_ckpt, th_ckpt):
        leaves = program.leaves()
        values = _run_with_region(program, leaves, start, stop, wrap)
        grads = backward.run(Program.loss(values), values)
        results.append(grads + [leaf.grad for leaf in leaves])
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(results[0], other, strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                torch.testing.assert_close(a, b)
    assert tensorhooks.live_graph_tasks() == 0


@given(region=_regions(), early_stop=st.booleans())
@settings(max_examples=30)
def test_nested_regions_match_plain_autograd(region: tuple[Program, int, int], early_stop: bool):
    """A region inside a region gives plain autograd's gradients, with or without early stop."""
    program, start, stop = region

    def outer(body: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        def twice(*xs: torch.Tensor) -> Any:
            return checkpoint(body, *xs, early_stop=early_stop, use_reentrant=False)

        return checkpoint(twice, *inputs, early_stop=early_stop, use_reentrant=False)

    expected_leaves = program.leaves()
    Program.loss(_run_with_region(program, expected_leaves, start, stop, None)).backward()
    leaves = program.leaves()
    Program.loss(_run_with_region(program, leaves, start, stop, outer)).backward()
    for a, b in zip(expected_leaves, leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


# --- torch's semantics ----------------------------------------------------------------------------


def test_dropout_replays_the_rng_state() -> None:
    """Dropout inside a region draws the same mask in recomputation: torch's gradients."""
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(h @ w1, 0.5, training=True).sin() @ w2

    results = []
    for run in (th_ckpt, torch_ckpt):
        torch.manual_seed(3)
        out = run(block, x)
        after_forward = torch.rand(3)
        results.append([*grads(lambda out=out: out, [x, w1, w2]), after_forward])
    torch.manual_seed(3)
    plain = grads(lambda: block(x), [x, w1, w2])
    assert_same(results[0], results[1])
    assert_same(results[0][:3], plain)


def test_cpu_autocast_bf16_is_replayed() -> None:
    """A region run under CPU autocast (bf16) recomputes under it: torch's gradients."""
    w1, w2 = weights()
    w1, w2 = w1.float().detach().requires_grad_(), w2.float().detach().requires_grad_()
    x = input_tensor().float().detach().requires_grad_()
    block = block_of(w1, w2)
    results = []
    for run in (th_ckpt, torch_ckpt, lambda f, a: f(a)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(block, x)
        assert out.dtype == torch.bfloat16
        results.append(grads(lambda out=out: out.float(), [x, w1, w2]))
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])


@pytest.mark.parametrize("kind", ["grad_leaf", "grad_intermediate", "backward_inputs"])
def test_grad_and_backward_inputs_on_leaves_and_intermediates(kind: str) -> None:
    """autograd.grad and backward(inputs=) work on leaves and on tensors made before the region."""
    w1, w2 = weights()
    x = input_tensor()
    h = x * 2
    target = x if kind == "grad_leaf" else h
    got = checkpoint(block_of(w1, w2), h, use_reentrant=False).sum()
    expected = block_of(w1, w2)(h).sum()
    if kind == "backward_inputs":
        h.retain_grad()
        got.backward(inputs=[h, w1], retain_graph=True)
        first = [h.grad.clone(), w1.grad.clone()]  # type: ignore[union-attr]
        h.grad, w1.grad = None, None
        expected.backward(inputs=[h, w1])
        assert_same(first, [h.grad, w1.grad])  # type: ignore[list-item]
        assert x.grad is None
        assert w2.grad is None
    else:
        assert_same(
            torch.autograd.grad(got, [target, w2], retain_graph=True),
            torch.autograd.grad(expected, [target, w2]),
        )


def test_retain_graph_twice_recomputes_per_backward() -> None:
    """Two backward calls over a retained graph recompute twice and agree."""
    calls = []
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        calls.append(tensorhooks.is_recomputing())
        return block_of(w1, w2)(h)

    loss = checkpoint(block, x, use_reentrant=False).sum()
    first = torch.autograd.grad(loss, [x, w1], retain_graph=True)
    second = torch.autograd.grad(loss, [x, w1])
    assert_same(first, second)
    assert calls == [False, True, True]


def test_double_backward() -> None:
    """create_graph=True through a region gives plain autograd's second derivatives."""
    w1, w2 = weights()
    x = input_tensor()
    results = []
    for run in (th_ckpt, lambda f, a: f(a)):
        (gx,) = torch.autograd.grad(run(block_of(w1, w2), x).sum(), x, create_graph=True)
        results.append(torch.autograd.grad((gx * gx).sum(), [x, w1, w2]))
    assert_same(results[0], results[1])


def test_non_tensor_arguments_outputs_and_kwargs() -> None:
    """Non-tensor arguments and outputs pass through; keyword arguments reach the function."""
    w1, _ = weights()
    x = input_tensor()

    def block(h: torch.Tensor, scale: float, *, name: str, bias: torch.Tensor) -> Any:
        return {"out": (h @ w1).sin() * scale + bias.exp(), "name": name, "none": None}

    bias = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    got = checkpoint(block, x, 3.0, name="b", bias=bias, use_reentrant=False)
    assert got["name"] == "b"
    assert got["none"] is None
    expected = block(x, 3.0, name="b", bias=bias)
    assert_same(
        torch.autograd.grad(got["out"].sum(), [x, bias]),
        torch.autograd.grad(expected["out"].sum(), [x, bias]),
    )


def test_decorator_form() -> None:
    """checkpoint(function=None, ...) returns a decorator that takes the same options."""
    w1, w2 = weights()

    @checkpoint(early_stop=False, determinism_check="none", use_reentrant=False)
    def block(h: torch.Tensor, *, k: int) -> torch.Tensor:
        return block_of(w1, w2)(h) * k

    x = input_tensor()
    assert_same(grads(lambda: block(x, k=2), [x]), grads(lambda: block_of(w1, w2)(x) * 2, [x]))
    assert block.__name__ == "block"


def test_use_reentrant_true_is_refused_with_the_reason() -> None:
    """use_reentrant=True raises, explaining what the hook-based version gains."""
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=r"autograd\.grad"):
        checkpoint(torch.sin, input_tensor(), use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        checkpoint(use_reentrant=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"determinism_check": "strict"}, "determinism_check must be one of"),
        ({"debug": True, "context_fn": lambda: (None, None)}, "cannot be combined"),
    ],
)
def test_invalid_options_raise(options: dict[str, Any], message: str) -> None:
    """Options checkpoint cannot honour raise a ValueError naming the fix."""
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match=message):
        checkpoint(torch.sin, input_tensor(), use_reentrant=False, **options)


def test_positional_arguments_without_function_raise() -> None:
    """checkpoint(None, x) is a mistake, not a decorator."""
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="without a function"):
        checkpoint(None, input_tensor(), use_reentrant=False)


def test_no_grad_runs_the_function_plainly() -> None:
    """Under no_grad the function just runs: nothing is saved or hooked."""
    with torch.no_grad():
        out = checkpoint(torch.sin, input_tensor(), use_reentrant=False)
    assert out.grad_fn is None


def test_early_stop_skips_ops_after_the_last_save() -> None:
    """With early stop, recomputation ends at the last saved tensor; without, it runs on."""
    for early_stop, tail_runs in ((True, 0), (False, 1)):
        tail = []

        def block(h: torch.Tensor, tail: list[int] = tail) -> torch.Tensor:
            out = h.sin()  # the only save: h
            tail.append(1)
            return out + 1

        x = input_tensor()
        checkpoint(block, x, early_stop=early_stop, use_reentrant=False).sum().backward()
        assert len(tail) == 1 + tail_runs


def test_torch_set_checkpoint_early_stop_is_honoured() -> None:
    """Torch's set_checkpoint_early_stop(False) overrides early_stop=True, as in torch."""
    tail: list[int] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        out = h.sin()
        tail.append(1)
        return out

    with torch_checkpoint.set_checkpoint_early_stop(False):
        out = checkpoint(block, input_tensor(), use_reentrant=False)
    out.sum().backward()
    assert len(tail) == 2


def test_determinism_check_counts_then_metadata() -> None:
    """A recomputation saving another number of tensors, or other shapes, raises CheckpointError."""
    x = input_tensor()
    # Read through a function: recomputation reads the closure's own bindings as at the call.
    state = {"extra": False, "shape": False}
    flag = state.get

    def block(h: torch.Tensor) -> torch.Tensor:
        out = (h[:2] if flag("shape") else h).sin()
        if flag("extra"):
            out = out.exp().exp()
        return out.sum()

    out = checkpoint(block, x, early_stop=False, use_reentrant=False)
    state["extra"] = True
    with pytest.raises(CheckpointError, match="more tensors were saved during recomputation"):
        out.backward()
    state["extra"] = False
    out = checkpoint(block, x, early_stop=False, use_reentrant=False)
    state["extra"] = True
    out = checkpoint(block, x, use_reentrant=False)
    state["extra"] = False
    with pytest.raises(CheckpointError, match="different number of tensors"):
        out.backward()
    out = checkpoint(block, x, use_reentrant=False)
    state["shape"] = True
    with pytest.raises(CheckpointError, match="differ from those saved"):
        out.backward()
    assert tensorhooks.live_graph_tasks() == 0


def test_debug_adds_the_op_traces() -> None:
    """debug=True re-raises a CheckpointError with torch's log of both runs."""
    x = input_tensor()
    flip = {"on": False}
    on = flip.get  # a reader: recomputation reads the closure's own bindings as at the call

    def block(h: torch.Tensor) -> torch.Tensor:
        return h.exp() if on("on") else h.sin().cos()

    out = checkpoint(block, x, debug=True, use_reentrant=False)
    flip["on"] = True
    with pytest.raises(CheckpointError, match="original forward"):
        out.sum().backward()


def test_unpack_twice_in_one_backward_raises() -> None:
    """A custom Function reading saved_tensors twice in backward gets a CheckpointError."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a)
            return a * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            ctx.saved_tensors  # noqa: B018
            ctx.saved_tensors  # noqa: B018
            return grad * 2

    out = checkpoint(Twice.apply, input_tensor() * 1, use_reentrant=False)
    with pytest.raises(CheckpointError, match="unpacked twice"):
        out.sum().backward()


def test_saved_tensor_read_outside_backward() -> None:
    """grad_fn._saved_* outside backward recomputes on the spot and keeps nothing."""
    x = input_tensor()
    out = checkpoint(lambda h: h.sin(), x, use_reentrant=False)
    torch.testing.assert_close(out.grad_fn._saved_self, x)  # type: ignore[union-attr]
    assert tensorhooks.live_graph_tasks() == 0


def test_inputs_saved_without_the_direct_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """On releases without a direct way to save inputs, a no-op Function saves them."""
    import tensorhooks._checkpoint.arguments as module

    monkeypatch.setattr(module, "make_saved_tensor", None)
    w1, w2 = weights()
    x = input_tensor()
    h = x.detach() * 1  # no input requires grad, the weights do
    assert_same(
        grads(lambda: checkpoint(block_of(w1, w2), h, use_reentrant=False), [w1, w2]),
        grads(lambda: block_of(w1, w2)(h), [w1, w2]),
    )
    assert_same(
        grads(lambda: checkpoint(block_of(w1, w2), x, use_reentrant=False), [x]),
        grads(lambda: block_of(w1, w2)(x), [x]),
    )
    out = checkpoint(block_of(w1, w2), x * 1, use_reentrant=False)
    del out
    gc.collect()


def test_input_changed_in_place_after_the_call_raises() -> None:
    """An input changed in place between forward and backward raises autograd's error."""
    w1, w2 = weights()
    h = input_tensor() * 1
    out = checkpoint(block_of(w1, w2), h, use_reentrant=False)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


class _Tagged(NamedTuple):
    h: torch.Tensor
    tag: str


# How a test passes its tensor ``h`` to the checkpointed function: (args, kwargs) from ``h``, and
# ``h`` back from (args, kwargs).
_CALL_FORMS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[..., torch.Tensor]]] = {
    "keyword": (lambda h: ((), {"h": h}), lambda a, k: k["h"]),
    "in a list": (lambda h: (([2.0, h],), {}), lambda a, k: a[0][1]),
    "in a tuple keyword": (lambda h: ((), {"hs": (None, h)}), lambda a, k: k["hs"][1]),
    "in a dict": (lambda h: (({"h": h, "n": 3},), {}), lambda a, k: a[0]["h"]),
    "in a named tuple": (lambda h: ((_Tagged(h, "t"),), {}), lambda a, k: a[0].h),
}


def _writes_its_input(w: torch.Tensor, form: str) -> Callable[..., torch.Tensor]:
    """``h += h * w; h.sin()``, reading ``h`` from the arguments as ``form`` passes it."""
    get = _CALL_FORMS[form][1]

    def block(*args: Any, **kwargs: Any) -> torch.Tensor:
        h = get(args, kwargs)
        h += h * w
        return h.sin()

    return block


def _call(block: Callable[..., torch.Tensor], form: str, h: torch.Tensor, run: Any) -> Any:
    args, kwargs = _CALL_FORMS[form][0](h)
    return run(block, *args, **kwargs)


@pytest.mark.parametrize("form", sorted(_CALL_FORMS))
def test_keyword_or_nested_input_written_in_the_region_raises(form: str) -> None:
    """A keyword or nested input the region writes in place raises, as a positional one does."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out = _call(_writes_its_input(w, form), form, input_tensor() * 1, th_ckpt)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("form", sorted(_CALL_FORMS))
def test_keyword_or_nested_input_written_under_allow_mutation(form: str) -> None:
    """Under allow_mutation_on_saved_tensors a keyword or nested written input: plain gradients."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    h0 = input_tensor()
    block = _writes_its_input(w, form)
    results = []
    for run in (th_ckpt, lambda f, *a, **k: f(*a, **k)):
        with tensorhooks.allow_mutation_on_saved_tensors():
            loss = _call(block, form, h0 * 1, run).sum()
            results.append(torch.autograd.grad(loss, [h0, w]))
    assert_same(results[0], results[1])


@pytest.mark.parametrize("form", sorted(_CALL_FORMS))
def test_keyword_or_nested_input_changed_after_the_call(form: str) -> None:
    """A keyword or nested input written before backward raises; under allow_mutation it is kept."""
    get = _CALL_FORMS[form][1]
    h0 = input_tensor()

    def block(*args: Any, **kwargs: Any) -> torch.Tensor:
        return get(args, kwargs).sin()

    h = h0 * 1
    out = _call(block, form, h, th_ckpt)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    with tensorhooks.allow_mutation_on_saved_tensors():
        h = h0 * 1
        out = _call(block, form, h, th_ckpt)
        h.mul_(2)
        (got,) = torch.autograd.grad(out.sum(), [h0])
    assert_same([got], [h0.detach().cos()])


def test_keyword_and_nested_inputs_are_saved_like_positional_ones() -> None:
    """Outer hooks pack every input tensor once; recomputation gets the same argument shapes."""
    x = input_tensor()
    packed: list[torch.Tensor] = []
    calls: list[tuple[Any, ...]] = []
    untouched: list[Any] = []

    def block(a: torch.Tensor, pair: _Tagged, empty: list[Any], *, d: dict[str, Any]) -> Any:
        calls.append((type(pair), pair.tag, empty is untouched, sorted(d), d["n"]))
        return a.sin() + pair.h.exp() + d["h"].cos() + d["again"].tan()

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    h, k = x * 1, x * 2
    with tensorhooks.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(
            block,
            h,
            _Tagged(k, "t"),
            untouched,
            d={"h": x, "n": 3, "again": h},
            use_reentrant=False,
        )
    assert [id(t) for t in packed] == [id(h), id(k), id(x)]  # h once, though passed twice
    out.sum().backward()
    assert calls[0] == calls[1] == (_Tagged, "t", True, ["again", "h", "n"], 3)
    torch.testing.assert_close(x.grad, (x.cos() + 2 * (2 * x).exp() - x.sin() + 1 / x.cos() ** 2))


def test_tensor_from_elsewhere_changed_before_backward_raises() -> None:
    """A closure's saved tensor changed after the call raises; the region's own writes do not."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    x = input_tensor()
    v = w * 1
    out = checkpoint(lambda h: (h * v).sin(), x, use_reentrant=False)
    v.mul_(2)
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match="outside its arguments"):
        out.sum().backward()
    buffer = torch.zeros(6, dtype=torch.float64)

    def block(h: torch.Tensor) -> torch.Tensor:
        buffer.copy_(w.detach() * 2)  # the same values on every run
        return (h * buffer).sin()

    loss = checkpoint(block, x, use_reentrant=False).sum()
    first = torch.autograd.grad(loss, [x], retain_graph=True)
    assert_same(first, torch.autograd.grad(loss, [x]))
    assert_same(first, [2 * w.detach() * (x * 2 * w).detach().cos()])


def test_input_written_in_the_region_leaves_no_cycle() -> None:
    """A region that writes its input in place, then fails in backward, is collected."""
    from tensorhooks._checkpoint.recomputation import Frame as _Frame

    gc.collect()
    before = sum(type(obj) is _Frame for obj in gc.get_objects())
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        h += h * w
        return h.sin()

    out = checkpoint(block, input_tensor() * 1, use_reentrant=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    del out
    gc.collect()
    assert sum(type(obj) is _Frame for obj in gc.get_objects()) == before


def test_write_inside_the_region_after_a_save_uses_the_saved_value() -> None:
    """A tensor the region saves and then changes in place: the gradient of the save-time value."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    x = input_tensor()

    def block(a: torch.Tensor) -> torch.Tensor:
        b = a * 2
        c = b * w  # saves b
        b.add_(1)
        return c + b.sin()

    got = torch.autograd.grad(checkpoint(block, x, use_reentrant=False).sum(), [x, w])
    with tensorhooks.allow_mutation_on_saved_tensors():
        expected = torch.autograd.grad(block(x).sum(), [x, w])
    assert_same(got, expected)


# --- memory and leaks -----------------------------------------------------------------------------


def test_intermediates_are_not_alive_between_forward_and_backward() -> None:
    """The region's intermediates die after forward; recomputed ones die after backward."""
    w1, w2 = weights()
    x = input_tensor()
    refs: list[weakref.ref[torch.Tensor]] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        a = torch.mm(h, w1)
        b = a.sin()
        refs.extend([weakref.ref(a), weakref.ref(b)])
        return (b.exp() @ w2).tanh()

    out = checkpoint(block, x, use_reentrant=False).sum()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    out.backward()
    del out
    assert all(r() is None for r in refs)
    assert tensorhooks.live_graph_tasks() == 0


def test_dropped_graph_frees_everything() -> None:
    """A graph dropped without backward frees the region's inputs and touches no store."""
    w1, w2 = weights()
    h = input_tensor() * 1
    ref = weakref.ref(h)
    out = checkpoint(block_of(w1, w2), h, use_reentrant=False)
    del h
    assert ref() is not None  # saved as an input
    del out
    assert ref() is None
    assert tensorhooks.live_graph_tasks() == 0


def test_failed_backward_releases_recomputed_tensors() -> None:
    """A backward that raises part-way keeps nothing in the store or alive."""
    w1, w2 = weights()
    x = input_tensor()
    refs: list[weakref.ref[torch.Tensor]] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        a = (h @ w1).sin()
        refs.append(weakref.ref(a))
        return FailingBackward.apply(a.exp() @ w2)  # type: ignore[no-any-return]

    out = (
        checkpoint(block, x, use_reentrant=False).sum()
        * checkpoint(block_of(w1, w2), x, use_reentrant=False).sum()
    )
    with pytest.raises(BackwardFailedError):
        out.backward()
    del out
    gc.collect()
    assert tensorhooks.live_graph_tasks() == 0
    assert all(r() is None for r in refs)


def test_error_during_recomputation_leaves_nothing() -> None:
    """A function that raises when run again fails backward cleanly."""
    x = input_tensor()
    runs = []

    def block(h: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        if len(runs) > 1:
            raise ValueError("second run fails")
        return h.sin()

    out = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(ValueError, match="second run fails"):
        out.sum().backward()
    assert tensorhooks.live_graph_tasks() == 0
    assert top_saved_tensors_hooks() is None


def test_custom_function_as_last_op_does_not_leak() -> None:
    """A custom Function saving its outputs as the region's last op is freed (pytorch 161186)."""

    class TwoOutputs(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            first, second = a * 2, a * 3
            ctx.save_for_backward(a, first, second)
            return first, second

        @staticmethod
        def backward(ctx: Any, g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
            a, _, _ = ctx.saved_tensors
            return g1 * 2 + g2 * 3 + 0 * a

    refs: list[weakref.ref[torch.Tensor]] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        first, second = TwoOutputs.apply(h)
        refs.append(weakref.ref(second))
        return first  # type: ignore[no-any-return]

    x = torch.nn.Parameter(torch.randn(8))
    for _ in range(3):
        checkpoint(block, x, use_reentrant=False).sum().backward()
    gc.collect()
    assert all(r() is None for r in refs)
    assert tensorhooks.live_graph_tasks() == 0


def test_forward_raising_inside_the_region_unwinds_its_contexts() -> None:
    """An exception in the function pops the region's hooks and its forward context."""
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )

    def block(h: torch.Tensor) -> torch.Tensor:
        h.sin()
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        checkpoint(block, input_tensor(), context_fn=context_fn, use_reentrant=False)
    assert top_saved_tensors_hooks() is None
    from tensorhooks._core.torch_compat import current_dispatch_mode

    assert current_dispatch_mode() is None


def test_memory_is_flat_over_many_steps() -> None:
    """Thousands of steps leave no frames, holders or recomputed tensors behind."""
    from tensorhooks._checkpoint.recomputation import Frame as _Frame

    gc.collect()
    before = sum(type(obj) is _Frame for obj in gc.get_objects())  # kept by earlier tests' objects
    w1, w2 = weights()
    for _ in range(2000):
        x = input_tensor()
        checkpoint(block_of(w1, w2), x, use_reentrant=False).sum().backward()
    gc.collect()
    assert sum(type(obj) is _Frame for obj in gc.get_objects()) == before


# --- compositions ---------------------------------------------------------------------------------


def test_save_on_cpu_outside_offloads_the_region_inputs() -> None:
    """save_on_cpu around a checkpoint copies the region's saved inputs (pytorch 84907)."""
    w1, w2 = weights()
    x = input_tensor()
    with simulated_device():
        with tensorhooks.save_on_cpu(pin_memory=True, min_offload_bytes=0):
            out = checkpoint(block_of(w1, w2), x * 1, use_reentrant=False)
        assert tensorhooks.save_on_cpu.stats("cpu").bytes_to_host == 4 * 6 * 8  # one input
        got = torch.autograd.grad(out.sum(), [x, w1, w2])
    assert_same(got, grads(lambda: block_of(w1, w2)(x * 1), [x, w1, w2]))


@pytest.mark.parametrize(
    ("outer_min_bytes", "offload_is_outer", "copies"),
    [
        (0, False, 3),  # the input, and the two mm outputs through the default offload context
        (1 << 20, False, 2),  # the outer threshold keeps the input; the policy's outputs still go
        (1 << 20, True, 0),  # offload= the outer context: its threshold applies to them too
    ],
)
def test_save_on_cpu_outside_a_selective_region(
    outer_min_bytes: int, offload_is_outer: bool, copies: int
) -> None:
    """save_on_cpu around a selective region offloads its inputs; CPU_OFFLOAD follows offload=."""
    w1, w2 = weights()
    x = input_tensor()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == aten.sin.default:
            return CheckpointPolicy.MUST_SAVE  # kept on its device, whatever is around
        return mm_policy(CheckpointPolicy.MUST_CPU_OFFLOAD)(ctx, op)

    with simulated_device() as sim:
        outer = tensorhooks.save_on_cpu(pin_memory=True, min_offload_bytes=outer_min_bytes)
        options = {"offload": outer} if offload_is_outer else {}
        context_fn = functools.partial(
            tensorhooks.create_selective_checkpoint_contexts, policy, **options
        )
        with outer:
            out = checkpoint(block_of(w1, w2), x * 1, context_fn=context_fn, use_reentrant=False)
        assert [entry for entry in sim.log if entry[0] == "to_host"] == [
            ("to_host", tag) for tag in range(copies)
        ]
        with OpCounter() as counter:
            got = torch.autograd.grad(out.sum(), [x, w1, w2])
        stats = tensorhooks.save_on_cpu.stats("cpu")
    assert stats.bytes_to_host == stats.bytes_to_device == copies * 4 * 6 * 8
    assert counter.counts.get(aten.mm.default, 0) == 4  # only the two mms' backward: none re-run
    assert counter.counts.get(aten.sin.default, 0) == 0
    assert_same(got, grads(lambda: block_of(w1, w2)(x * 1), [x, w1, w2]))


def test_save_on_cpu_inside_the_region() -> None:
    """save_on_cpu inside the function: its hooks are innermost, gradients are right."""
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        with tensorhooks.save_on_cpu():
            return block_of(w1, w2)(h)

    assert_same(
        grads(lambda: checkpoint(block, x, use_reentrant=False), [x, w1]),
        grads(lambda: block(x), [x, w1]),
    )


def test_user_hooks_outside_see_the_tensors_the_region_keeps() -> None:
    """Hooks around a checkpoint pack the region's inputs, not its intermediates."""
    w1, w2 = weights()
    x = input_tensor()
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with tensorhooks.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(lambda h, scale: block_of(w1, w2)(h) * scale, x, 2.0, use_reentrant=False)
    assert len(packed) == 1
    assert packed[0] is x
    out.sum().backward()


def test_mutation_context_around_a_region_that_writes_its_input() -> None:
    """allow_mutation_on_saved_tensors around `h += h * w`: plain autograd's gradient."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    h0 = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        n = h * w
        h += n
        return h.sin()

    results = []
    for run in (th_ckpt, lambda f, a: f(a)):
        with tensorhooks.allow_mutation_on_saved_tensors():
            loss = run(block, h0 * 1).sum()
            results.append(torch.autograd.grad(loss, [h0, w], retain_graph=True))
            if run is th_ckpt:
                assert_same(results[-1], torch.autograd.grad(loss, [h0, w]))
    assert_same(results[0], results[1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        checkpoint(block, h0 * 1, use_reentrant=False).sum().backward()


def test_mutation_context_inside_the_region() -> None:
    """allow_mutation_on_saved_tensors inside the function behaves as it does without one."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        with tensorhooks.allow_mutation_on_saved_tensors():
            a = h * 1
            b = a * w
            a.add_(1)
            return b + a.exp()

    for run in (th_ckpt, lambda f, a: f(a)):
        loss = run(block, x).sum()
        with pytest.raises(tensorhooks.MutationContextExitedError, match="has exited"):
            loss.backward()


def test_multi_grad_hooks_fire_once_per_backward() -> None:
    """A multi-grad hook over a checkpointed model's parameters fires once per backward."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    fired: list[int] = []
    handle = tensorhooks.register_multi_grad_hook(
        list(model.parameters()), lambda grads: fired.append(1)
    )
    x = torch.randn(4, 6)
    for _ in range(3):
        checkpoint(model, x, use_reentrant=False).sum().backward()
    assert len(fired) == 3
    handle.remove()


def test_hooks_registered_from_forward_hooks_do_not_pile_up() -> None:
    """Forward hooks that register hooks run again in recomputation; is_recomputing guards them."""
    layer = torch.nn.Linear(6, 6)
    fired: list[int] = []
    handles: list[Any] = []

    def forward_hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        handles.append(
            tensorhooks.register_multi_grad_hook([output], lambda grads: fired.append(1))
        )
        if not tensorhooks.is_recomputing():
            handles.append(
                tensorhooks.register_multi_grad_hook(
                    [module.weight], lambda grads: fired.append(10)
                )
            )

    layer.register_forward_hook(forward_hook)
    x = torch.randn(4, 6, requires_grad=True)
    checkpoint(lambda h: layer(h).sin(), x, use_reentrant=False).sum().backward()
    assert sorted(fired) == [1, 10]  # the hook on the recomputed output never fires
    for handle in handles:
        handle.remove()


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank, unless one is already up."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_sync_gradients_over_a_checkpointed_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """sync_gradients all-reduces each bucket once per backward over checkpointed blocks."""
    from tensorhooks.distributed import sync_gradients

    calls: list[int] = []
    original = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
    plain = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
    plain.load_state_dict(blocks.state_dict())
    handle = sync_gradients(blocks, bucket_cap_mb=1e-4)
    x = torch.randn(4, 6)
    for _ in range(2):
        h = x
        for block in blocks:
            h = checkpoint(lambda t, block=block: block(t).tanh(), h, use_reentrant=False)
        h.sum().backward()
        hp = x
        for block in plain:
            hp = block(hp).tanh()
        hp.sum().backward()
    assert len(calls) == 2 * len(handle.buckets)
    for a, b in zip(blocks.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    handle.remove()


@pytest.mark.usefixtures("world_of_one")
def test_fully_shard_on_one_rank_under_allow_mutation() -> None:
    """FSDP2 on one rank refills freed weights uncounted: recomputation reads the refill."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(6, 12)
            self.down = torch.nn.Linear(12, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(
                lambda h: h + self.down(torch.tanh(self.up(h))), x, use_reentrant=False
            )

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(6, 2)).double()
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (1,))
    for block in sharded[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(6, 6, dtype=torch.float64)
    for model in (plain, sharded):
        with tensorhooks.allow_mutation_on_saved_tensors():
            model(x).pow(2).mean().backward()
    for a, b in zip(sharded.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=1e-12, atol=1e-12)


# --- threads --------------------------------------------------------------------------------------


def test_concurrent_backward_on_many_threads() -> None:
    """Threads backwarding through their own graphs, and one shared graph, agree with plain."""
    w1, w2 = weights()
    x = input_tensor()
    expected = grads(lambda: block_of(w1, w2)(x), [x, w1, w2])
    shared = checkpoint(block_of(w1, w2), x, use_reentrant=False).sum()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(20):
                own = checkpoint(block_of(w1, w2), x, use_reentrant=False).sum()
                assert_same(torch.autograd.grad(own, [x, w1, w2]), expected)
                assert_same(torch.autograd.grad(shared, [x, w1, w2], retain_graph=True), expected)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert tensorhooks.live_graph_tasks() == 0


def test_is_recomputing_is_per_thread() -> None:
    """is_recomputing is False on other threads while one thread recomputes."""
    seen: list[bool] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        if tensorhooks.is_recomputing():
            thread = threading.Thread(target=lambda: seen.append(tensorhooks.is_recomputing()))
            thread.start()
            thread.join()
        return h.sin()

    checkpoint(block, input_tensor(), use_reentrant=False).sum().backward()
    assert seen == [False]
