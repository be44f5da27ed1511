"""Saved-tensor hooks pushed inside the context with tensorhooks keep its protection."""

from __future__ import annotations

import collections
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.graph as torch_graph

import tensorhooks
from tests.mutation.programs import Program, grad_under, leaf_4x6

pytestmark = pytest.mark.usefixtures("no_open_contexts")


@pytest.mark.parametrize(
    ("pack", "unpack", "tracked"),
    [
        pytest.param(lambda t: t, lambda t: t, True, id="identity"),
        pytest.param(lambda t: t.view(-1), lambda p: p, True, id="view"),
        pytest.param(lambda t: [t.detach(), 3], lambda p: p[0], True, id="list_alias"),
        pytest.param(lambda t: {"t": t}, lambda p: p["t"], True, id="unknown_object"),
        pytest.param(lambda t: t.detach().clone(), lambda p: p, False, id="copy"),
        pytest.param(
            lambda t: (t.to(torch.float32), t.dtype),
            lambda p: p[0].to(p[1]),
            False,
            id="cast",
        ),
    ],
)
def test_tensorhooks_hooks_inside_keep_the_protection(
    pack: Callable[[torch.Tensor], Any],
    unpack: Callable[[Any], torch.Tensor],
    tracked: bool,
) -> None:
    """saved_tensors_hooks pushed inside are guarded: aliases packed as-is are cloned."""
    calls = []

    def counting_unpack(packed: Any) -> torch.Tensor:
        calls.append(1)
        return unpack(packed)

    def program(a: torch.Tensor) -> torch.Tensor:
        b = a * 1
        with tensorhooks.saved_tensors_hooks(pack, counting_unpack):
            out = (b[1:] ** 2).sum()
        b.mul_(2.0)
        return out

    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
    expected = grad_under(None, lambda a: (a[1:] ** 2).sum(), leaf_4x6())
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert calls == ([] if tracked else [1])  # not run when the clone is handed back


def test_copying_hooks_inside_track_nothing() -> None:
    """A pack that returns a real copy needs no protection: nothing is tracked or cloned."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        tracked: list[torch.Tensor] = []
        track = ctx._guard._track

        def counting_track(tensor: torch.Tensor, is_output: bool) -> Any:
            tracked.append(tensor)
            return track(tensor, is_output)

        ctx._guard._track = counting_track
        b = a * 1
        with tensorhooks.saved_tensors_hooks(lambda t: t.detach().clone(), lambda p: p):
            out = (b**2).sum()
        assert tracked == []  # not even a handle made and dropped
        assert ctx.num_saved() == 0
        b.mul_(2.0)
        assert ctx.num_cloned() == 0
        out.backward()
    torch.testing.assert_close(a.grad, 2 * leaf_4x6())


def test_guarded_hooks_free_dropped_graphs() -> None:
    """Saved outputs packed as aliases by guarded user hooks do not keep their graph alive."""
    a = leaf_4x6().requires_grad_()
    with (
        tensorhooks.allow_mutation_on_saved_tensors() as ctx,
        tensorhooks.saved_tensors_hooks(lambda t: t.detach(), lambda p: p),
    ):
        b = torch.tanh(a * 1)  # saves its output
        b.mul_(2.0)
        watched = weakref.ref(b)
        del b
        assert watched() is None
        assert ctx.num_saved() == 0


@pytest.mark.parametrize("pin_memory", [False, True])
def test_save_on_cpu_inside_keeps_offloading_and_protection(pin_memory: bool) -> None:
    """save_on_cpu inside: host copies untracked (device memory freed), kept tensors cloned."""
    from tests.simdevice import simulated_device

    expected = 2 * leaf_4x6()
    with simulated_device() as sim:  # CPU tensors offloaded as device ones
        a = leaf_4x6().requires_grad_()
        with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
            b = a * 1
            with tensorhooks.save_on_cpu(pin_memory=pin_memory, min_offload_bytes=0):
                out = (b**2).sum()
            assert ctx.num_saved() == 0
            b.mul_(2.0)
            out.backward()
        torch.testing.assert_close(a.grad, expected)
        assert sim.live_sources() == 0
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        b = a * 1
        with tensorhooks.save_on_cpu(pin_memory=pin_memory):
            out = (b**2).sum()  # a CPU tensor: save_on_cpu keeps it as it is
        assert ctx.num_saved() == 1
        b.mul_(2.0)
        assert ctx.num_cloned() == 1
        out.backward()
    torch.testing.assert_close(a.grad, expected)


def test_torch_is_wrong_with_hooks_pushed_inside() -> None:
    """Case 7: torch's tracker is replaced by inner hooks and the gradient is wrong."""

    def program(hooks: Any) -> Program:
        def run(a: torch.Tensor) -> torch.Tensor:
            b = a * 1
            with hooks(lambda t: t, lambda t: t):
                out = (b**2).sum()
            b.mul_(2.0)
            return out

        return run

    expected = 2 * leaf_4x6()
    got_torch = grad_under(
        torch_graph.allow_mutation_on_saved_tensors,
        program(torch_graph.saved_tensors_hooks),
        leaf_4x6(),
    )
    got = grad_under(
        tensorhooks.allow_mutation_on_saved_tensors,
        program(tensorhooks.saved_tensors_hooks),
        leaf_4x6(),
    )
    assert not torch.allclose(got_torch, expected)
    torch.testing.assert_close(got, expected)


def test_guarded_unpack_after_exit_raises() -> None:
    """A graph saved through guarded user hooks cannot be used after the context exits."""
    a = leaf_4x6().requires_grad_()
    with (
        tensorhooks.allow_mutation_on_saved_tensors(),
        tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t),
    ):
        out = ((a * 1) ** 2).sum()
    with pytest.raises(tensorhooks.MutationContextExitedError, match="has exited"):
        out.backward()


class _CopyRecord:
    """A pack record that keeps a copy of the saved tensor in an attribute."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.copy = tensor.clone()


@pytest.mark.parametrize(
    ("pack", "unpack"),
    [
        (_CopyRecord, lambda record: record.copy),
        (lambda t: {"copy": t.clone()}, lambda record: record["copy"]),
        (lambda t: collections.deque([t.clone()]), lambda record: record[0]),
    ],
    ids=["object", "dict", "deque"],
)
def test_pack_returning_a_record_of_a_copy_keeps_nothing_alive(pack: Any, unpack: Any) -> None:
    """A user pack returning an object or dict holding a copy frees the saved tensor."""
    x = torch.randn(8, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors() as context:
        with tensorhooks.saved_tensors_hooks(pack, unpack):
            h = x * 2
            alive = weakref.ref(h)
            y = h.sin()
            del h
        gc.collect()
        assert alive() is None
        assert context.num_saved() == 0
        y.sum().backward()
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pack", "unpack"),
    [
        (lambda t: lambda: t, lambda p: p()),
        (lambda t: [[t], *[[] for _ in range(300)]], lambda p: p[0][0]),
    ],
    ids=["closure", "over_budget"],
)
def test_pack_hiding_the_tensor_from_the_walk_still_gets_the_save_time_value(
    pack: Any, unpack: Any
) -> None:
    """A pack whose alias the walk cannot rule out is tracked: a write does not reach backward."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        with tensorhooks.saved_tensors_hooks(pack, unpack):
            b = x * 1
            y = (b * b).sum()
        b.mul_(10)
        y.backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0, 6.0]))  # type: ignore[arg-type]


def test_pack_to_a_key_keeps_nothing_alive() -> None:
    """A user pack that moves the data out and returns a key frees the tensor in the context."""
    store: dict[str, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> str:
        key = f"saved-{len(store)}"
        store[key] = tensor.detach().clone()  # stands in for a file on disk
        return key

    x = torch.randn(64, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        with tensorhooks.saved_tensors_hooks(pack, store.pop):
            a = x * 2
            out = a.sin().sum()
        alive = weakref.ref(a)
        del a
        gc.collect()
        assert alive() is None
        out.backward()
    assert torch.allclose(x.grad, 2 * torch.cos(2 * x.detach()))  # type: ignore[arg-type]
