"""checkpoint_module: torch's composable checkpoint(module) on tensorhooks' region, with hooks."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks
from tensorhooks._core.torch_compat import top_saved_tensors_hooks
from tensorhooks.checkpointing import CheckpointError, CheckpointPolicy, checkpoint_module
from tests.checkpoint.common import OpCounter, assert_same

composable = pytest.importorskip("torch.distributed._composable")
torch_checkpoint_module: Callable[..., nn.Module] = composable.checkpoint

Apply = Callable[[nn.Module], Any]
NONE: Apply = lambda module: None  # noqa: E731 (plain autograd: nothing applied)


def layers(count: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Dropout(0.2)) for _ in range(count))
    ).double()


def run(
    apply: Apply, register: Callable[[nn.Module, Apply, list[str]], None]
) -> tuple[list[torch.Tensor], list[str]]:
    """Gradients of input and weights (torch.autograd.grad) and the hooks' calls, in order."""
    model = layers()
    calls: list[str] = []
    for layer in model:
        register(layer, apply, calls)
    torch.manual_seed(1)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    out = model(x)
    got = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    assert tensorhooks.live_graph_tasks() == 0
    return list(got), calls


def hooks_after(layer: nn.Module, apply: Apply, calls: list[str]) -> None:
    """The usual order: checkpoint first, then hooks that read and change arguments and output."""
    apply(layer)
    layer.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    layer.register_forward_pre_hook(lambda m, a, k: ((a[0] * 2,), k), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, o: calls.append("post"))
    layer.register_forward_hook(lambda m, a, o: o + a[0].sum())


def test_matches_torchs_composable_checkpoint_with_hooks() -> None:
    """Plain autograd's gradients, as torch's; hooks run again in recomputation, as in torch."""
    plain, plain_calls = run(NONE, hooks_after)
    ours, our_calls = run(checkpoint_module, hooks_after)
    theirs, their_calls = run(torch_checkpoint_module, hooks_after)
    assert_same(ours, plain)
    assert_same(theirs, plain)
    assert our_calls == their_calls
    assert our_calls.count("pre") == 2 * plain_calls.count("pre")  # once more in recomputation


def hooks_before(layer: nn.Module, apply: Apply, calls: list[str]) -> None:
    """A pre-hook that doubles the argument and a forward hook that saves, then checkpoint."""
    layer.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    layer.register_forward_hook(lambda m, a, o: o * a[0])
    apply(layer)


def test_hooks_registered_before_are_inside_the_region() -> None:
    """Hooks registered before it run once per pass: plain autograd's gradient; torch's is wrong.

    torch runs them outside its region in the forward pass but inside recomputation, where the
    argument is doubled twice.
    """
    plain, _ = run(NONE, hooks_before)
    assert_same(run(checkpoint_module, hooks_before)[0], plain)
    theirs, _ = run(torch_checkpoint_module, hooks_before)
    assert not torch.equal(theirs[0], plain[0])


def test_a_prepended_hook_changing_arguments_again_raises() -> None:
    """A pre-hook that runs before it and changes the arguments raises in backward (torch: wrong).

    It runs outside the region in the forward pass and again in recomputation, on arguments it
    changed already.
    """

    def prepended(layer: nn.Module, apply: Apply, calls: list[str]) -> None:
        apply(layer)
        layer.register_forward_pre_hook(lambda m, a: (a[0] * 2,), prepend=True)

    plain, _ = run(NONE, prepended)
    with pytest.raises(CheckpointError, match="changed the arguments in recomputation"):
        run(checkpoint_module, prepended)
    assert not torch.equal(run(torch_checkpoint_module, prepended)[0][0], plain[0])


def test_a_prepended_hook_returning_arguments_as_they_are_works() -> None:
    """A hook like FSDP2's pre-forward, registered later with prepend=True, is fine."""

    def prepended(layer: nn.Module, apply: Apply, calls: list[str]) -> None:
        apply(layer)

        def cast(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
            calls.append("cast")
            return tuple(t.to(torch.float64) for t in a), k  # .to() of the same dtype: itself

        layer.register_forward_pre_hook(cast, prepend=True, with_kwargs=True)

    plain, _ = run(NONE, prepended)
    ours, calls = run(checkpoint_module, prepended)
    assert_same(ours, plain)
    assert_same(run(torch_checkpoint_module, prepended)[0], plain)
    assert calls.count("cast") == 6  # each layer, in forward and in recomputation


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sin() * scale


def test_keyword_arguments_and_autograd_grad() -> None:
    """Keyword tensors are inputs of the region; .grad() reaches them, as with torch's."""
    results = []
    for apply in (NONE, checkpoint_module, torch_checkpoint_module):
        torch.manual_seed(0)
        module = Scaled()
        apply(module)
        x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
        scale = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
        results.append(torch.autograd.grad(module(x, scale=scale).sum(), [x, scale]))
    assert_same(results[1], results[0])
    assert_same(results[2], results[0])


def test_names_and_state_dict_are_unchanged() -> None:
    """Nothing is wrapped: parameter names and the state dict's keys stay."""
    model = layers()
    names = [name for name, _ in model.named_parameters()]
    keys = list(model.state_dict())
    checkpoint_module(model[0])
    assert [name for name, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys


def test_nested_checkpointed_modules() -> None:
    """A checkpointed module inside another: plain autograd's gradients."""
    plain, _ = run(NONE, lambda layer, apply, calls: None)

    def nested(layer: nn.Module, apply: Apply, calls: list[str]) -> None:
        checkpoint_module(layer[0])
        checkpoint_module(layer)

    assert_same(run(checkpoint_module, nested)[0], plain)


def test_a_selective_policy_through_context_fn() -> None:
    """context_fn takes a selective policy: saved matmuls are not run again in backward."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(tensorhooks.create_selective_checkpoint_contexts, policy)
    model = layers()
    for layer in model:
        checkpoint_module(layer, context_fn=context_fn)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    out = model(x)
    with OpCounter() as counter:
        (gx,) = torch.autograd.grad(out.sum(), [x])
    plain = layers()
    torch.manual_seed(1)
    (expected,) = torch.autograd.grad(plain(x).sum(), [x])
    assert counter.counts.get(torch.ops.aten.addmm.default, 0) == 0
    assert counter.counts.get(torch.ops.aten.tanh.default, 0) == 3  # recomputed, once a layer
    assert_same([gx], [expected])


def test_a_forward_that_raises_leaves_no_hooks_behind() -> None:
    """The error comes out; the region's hooks are popped; the next call checkpoints again."""
    fail = {"on": True}

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.sin()
            if fail["on"]:
                raise ValueError("boom")
            return y.cos()

    module = checkpoint_module(Failing())
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        module(x)
    assert top_saved_tensors_hooks() is None
    fail["on"] = False
    (gx,) = torch.autograd.grad(module(x).sum(), [x])
    assert torch.equal(gx, -torch.sin(torch.sin(x)) * torch.cos(x))


def test_under_no_grad_the_module_just_runs() -> None:
    """Under no_grad nothing is checkpointed; the output has no graph."""
    module = checkpoint_module(nn.Linear(3, 3))
    with torch.no_grad():
        assert module(torch.ones(1, 3)).grad_fn is None


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: checkpoint_module(nn.Linear(2, 2), use_reentrant=True), ValueError, "use_re"),
        (lambda: checkpoint_module(nn.Linear(2, 2), scale=2), ValueError, r"\['scale'\]"),
        (lambda: checkpoint_module(torch.sin), TypeError, "must be a torch.nn.Module"),
    ],
)
def test_bad_arguments_raise(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    """use_reentrant=True, an unknown keyword, a non-module: tensorhooks errors naming them."""
    with pytest.raises(error, match=message) as caught:
        call()
    assert isinstance(caught.value, tensorhooks.TensorHooksError)


def test_applied_twice_raises_as_torch() -> None:
    """Once per module, as torch's composable API."""
    module = checkpoint_module(nn.Linear(2, 2))
    with pytest.raises(tensorhooks.CheckpointArgumentValueError, match="checkpointed already"):
        checkpoint_module(module)
    other = torch_checkpoint_module(nn.Linear(2, 2))
    with pytest.raises(AssertionError):  # torch's contract: once per module and API
        torch_checkpoint_module(other)


def test_threads_run_the_module_at_once() -> None:
    """Each thread has its own region and recomputation switch: plain autograd's gradients."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)).double()
    checkpoint_module(module)
    inputs = [torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    results: dict[int, list[torch.Tensor]] = {}

    def work(index: int) -> None:
        for _ in range(20):
            x = inputs[index]
            results[index] = list(torch.autograd.grad(module(x).sin().sum(), [x, module[0].weight]))

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    plain = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)).double()
    plain.load_state_dict(module.state_dict())
    for index, x in enumerate(inputs):
        expected = torch.autograd.grad(plain(x).sin().sum(), [x, plain[0].weight])
        assert_same(results[index], list(expected))
    assert top_saved_tensors_hooks() is None


# One rank of FSDP2 on CPU (gloo), in its own process so that no process group outlives it:
# checkpoint_module on each layer, then fully_shard, as FSDP2 code applies torch's composable
# checkpoint; the gradients are plain autograd's, as with torch's.
_FSDP2_SCRIPT = """
import copy, sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed._composable import checkpoint as torch_checkpoint_module
from tensorhooks.checkpointing import checkpoint_module

dist.init_process_group(
    "gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1
)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
base = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
x = torch.randn(4, 8)
calls = []


def grads(apply):
    model = copy.deepcopy(base)
    if apply is not None:
        for layer in model:
            apply(layer)
            fully_shard(layer, mesh=mesh)
            layer.register_forward_pre_hook(lambda m, a: calls.append(apply))
        fully_shard(model, mesh=mesh)
    model(x).square().sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


reference = copy.deepcopy(base)
reference(x).square().sum().backward()
plain = [p.grad for p in reference.parameters()]
for apply in (checkpoint_module, torch_checkpoint_module):
    assert all(torch.equal(a, b) for a, b in zip(grads(apply), plain, strict=True)), apply
assert calls.count(checkpoint_module) == calls.count(torch_checkpoint_module) == 6, calls
dist.destroy_process_group()
print("FSDP2-OK")
"""


@pytest.mark.slow
def test_under_fsdp2_as_torchs_composable_checkpoint() -> None:
    """checkpoint_module then fully_shard per layer (FSDP2 on CPU, one rank): plain gradients."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    result = subprocess.run(
        [sys.executable, "-c", _FSDP2_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert "FSDP2-OK" in result.stdout, result.stderr[-3000:]
