"""TestCheckpoint of PyTorch's test/test_utils.py, against both checkpoint modules.

Source: pytorch/pytorch, test/test_utils.py at commit 0025348e03d0307b815c0043b702e2a64c2ef752
(the newest stored; no v2.13.0 tag was reachable). Each test keeps its source test's name, model
and assertions, rewritten as plain pytest: TestCase helpers became asserts and
torch.testing.assert_close, subTest loops became parametrization, and only the
``use_reentrant=False`` half of a test that covers both variants is kept. The GPU tests are marked
``cuda``.

Not ported: the tests of the reentrant variant only, which tensorhooks refuses by design
(docs/differences.md, "use_reentrant=True is refused"): test_checkpoint_rng_cpu,
test_checkpoint_rng_gpu, test_checkpoint_non_tensor, test_checkpoint_non_tensor_inputs_outputs,
test_checkpoint_no_tensors, test_checkpoint_partial_grad; and the tests of the private helper
``_infer_device_type``, which neither module exports: test_infer_device_state_recursive_meta,
test_infer_device_state_recursive_multi_gpu.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from tests.checkpoint.torch_suite.common import both, requires_cuda

pytestmark = pytest.mark.filterwarnings(
    # torch warns when a non-reentrant region's forward finds no input requiring grad
    "ignore:None of the inputs have requires_grad=True:UserWarning"
)


def mlp() -> nn.Sequential:
    """The source's three Linear+ReLU pairs, 100 -> 50 -> 20 -> 5."""
    return nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU()
    )


def check_sequential(
    ckpt: ModuleType,
    model: nn.Module,
    sequences: Sequence[Any],
    segments: int,
    input: torch.Tensor,
) -> None:
    """``checkpoint_sequential`` over each of ``sequences`` matches ``model`` run plainly.

    Output, input gradient and every parameter gradient of ``model`` (the sequences hold its
    layers) are compared, as the source's ``_check_checkpoint_sequential`` does.
    """
    out = model(input)
    expected_out = out.detach().clone()
    model.zero_grad()
    out.sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    assert input.grad is not None
    expected_input_grad = input.grad.clone()
    for sequence in sequences:
        leaf = input.detach().requires_grad_()
        out = ckpt.checkpoint_sequential(sequence, segments, leaf, use_reentrant=False)
        torch.testing.assert_close(out.detach(), expected_out)
        model.zero_grad()
        out.sum().backward()
        torch.testing.assert_close(leaf.grad, expected_input_grad)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name])


@both
def test_checkpoint_trigger(ckpt: ModuleType) -> None:
    """The checkpointed half of ten modules runs twice, the last segment once."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[None] = []  # see test_autograd_checkpoint.py on counting calls

        def forward(self, input_var: torch.Tensor) -> torch.Tensor:
            self.calls.append(None)
            return input_var * torch.tensor(2.0)  # saves a tensor, so there is a recomputation

    modules = [Net() for _ in range(10)]
    assert [len(m.calls) for m in modules] == [0] * 10
    input_var = torch.randn(3, 4, requires_grad=True)
    out = ckpt.checkpoint_sequential(modules, 2, input_var, use_reentrant=False)
    assert [len(m.calls) for m in modules] == [1] * 10
    out.sum().backward()
    assert [len(m.calls) for m in modules] == [2] * 5 + [1] * 5


@both
def test_checkpoint_valid(ckpt: ModuleType) -> None:
    """Segments give plain autograd's output and create_graph gradients through autograd.grad."""
    model = mlp()
    input_var = torch.randn(1, 100, requires_grad=True)
    modules = list(model.children())

    out = model(input_var)
    expected = torch.autograd.grad(
        outputs=[out], grad_outputs=[torch.ones(1, 5)], inputs=[input_var], create_graph=True
    )
    out_checkpoint = ckpt.checkpoint_sequential(modules, 2, input_var, use_reentrant=False)
    torch.testing.assert_close(out_checkpoint, out)
    got = torch.autograd.grad(
        outputs=[out_checkpoint],
        grad_outputs=[torch.ones(1, 5)],
        inputs=[input_var],
        create_graph=True,
    )
    torch.testing.assert_close(got, expected)


@both
def test_checkpoint(ckpt: ModuleType) -> None:
    """A Sequential and the list of its children, in two segments, give plain gradients."""
    model = mlp()
    check_sequential(
        ckpt, model, [list(model.children()), model], 2, torch.randn(1, 100, requires_grad=True)
    )


@both
def test_checkpoint_module_list(ckpt: ModuleType) -> None:
    """A ModuleList and the list of its children give the gradients of the module using them."""

    class ModuleListNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module_list = nn.ModuleList(mlp().children())

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            for layer in self.module_list:
                input = layer(input)
            return input

    model = ModuleListNet()
    check_sequential(
        ckpt,
        model,
        [list(model.module_list.children()), model.module_list],
        2,
        torch.randn(1, 100, requires_grad=True),
    )


@both
def test_checkpoint_sequential_deprecated_multiple_args(ckpt: ModuleType) -> None:
    """A second input (the deprecated multi-input form) is a TypeError."""

    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a, b

    model = nn.Sequential(Two())
    a = torch.randn(1, 100, requires_grad=True)
    b = torch.randn(1, 100, requires_grad=True)
    with pytest.raises(TypeError):
        ckpt.checkpoint_sequential(model, 1, a, b)


@both
def test_checkpoint_sequential_deprecated_no_args(ckpt: ModuleType) -> None:
    """No input at all is a TypeError."""

    class Noop(nn.Module):
        def forward(self) -> None:
            pass

    model = nn.Sequential(Noop())
    call: Callable[..., Any] = ckpt.checkpoint_sequential
    with pytest.raises(TypeError):
        call(model, 1)


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpoint_not_preserve_rng_state_and_without_reentrant(ckpt: ModuleType) -> None:
    """A dropout region on the GPU runs forward and backward with preserve_rng_state=False."""
    inp = torch.randn(2, device="cuda").requires_grad_()
    layer = nn.Dropout()
    out = ckpt.checkpoint(layer, inp, use_reentrant=False, preserve_rng_state=False)
    out.sum().backward()
    assert inp.grad is not None


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpointing_without_reentrant_early_free(ckpt: ModuleType) -> None:
    """Backward frees a region's recomputed buffers step by step, retain_graph or not."""

    def run(fn: Callable[[Callable[..., torch.Tensor]], None], should_free: bool) -> list[int]:
        stats: list[int] = []

        def track(x: torch.Tensor, index: int) -> None:
            def hook(_: torch.Tensor) -> None:
                assert len(stats) == index
                torch.cuda.synchronize()
                stats.append(torch.cuda.memory_allocated())
                if index > 0:
                    if should_free:
                        assert stats[index] < stats[index - 1]
                    else:
                        assert stats[index] == stats[index - 1]

            x.register_hook(hook)

        def chain(x: torch.Tensor) -> torch.Tensor:
            x = x**2
            track(x, 2)
            x = x**2
            track(x, 1)
            x = x**2
            track(x, 0)
            x = x**2
            return x.sum()

        fn(chain)
        return stats

    x = torch.zeros(10, device="cuda", requires_grad=True)
    x.grad = torch.zeros_like(x)
    plain = run(lambda fn: fn(x).backward(), True)
    run(lambda fn: fn(x).backward(retain_graph=True), False)
    checkpointed = run(lambda fn: ckpt.checkpoint(fn, x, use_reentrant=False).backward(), True)
    retained = run(
        lambda fn: ckpt.checkpoint(fn, x, use_reentrant=False).backward(retain_graph=True), True
    )
    assert checkpointed == plain
    assert retained == plain


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@both
def test_get_device_states_recursive(ckpt: ModuleType) -> None:
    """get_device_states finds the devices of tensors nested in dicts and lists."""
    inp = {"foo": torch.rand(10, device="cuda:0"), "bar": [torch.rand(10, device="cuda:1")]}
    device_ids, device_states = ckpt.get_device_states(inp)
    assert device_ids == [0, 1]
    assert len(device_states) == 2
    assert all(isinstance(state, torch.Tensor) for state in device_states)


@pytest.mark.cuda
@requires_cuda
@both
def test_checkpoint_preserves_device_context(ckpt: ModuleType) -> None:
    """Recomputation creates tensors on the device of the torch.device context of the call."""
    seen: list[torch.device] = []

    def creates_tensor(x: torch.Tensor) -> torch.Tensor:
        intermediate = torch.empty(4)  # on the default device
        seen.append(intermediate.device)
        return x * intermediate.sum()

    x = torch.randn(4, device="cuda", requires_grad=True)
    with torch.device("cuda"):
        y = ckpt.checkpoint(creates_tensor, x, use_reentrant=False)
        assert seen[-1].type == "cuda"
        y.sum().backward()
        assert len(seen) == 2  # the forward pass and the recomputation
        assert seen[-1].type == "cuda"
