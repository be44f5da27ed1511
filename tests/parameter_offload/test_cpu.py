"""offload_parameters on a machine without CUDA: the same script runs, nothing is streamed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tensorhooks as th

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = (nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh()) for _ in range(3))
    return nn.Sequential(*layers)


def train(module: nn.Module, steps: int = 3) -> list[int]:
    """AdamW steps; return the data pointers the first block's weight had in each forward."""
    seen: list[int] = []
    hook = module[0].register_forward_pre_hook(lambda m, _: seen.append(m[0].weight.data_ptr()))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    for seed in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        module(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    hook.remove()
    return seen


def assert_same(ours: nn.Module, resident: nn.Module) -> None:
    for (name, a), b in zip(ours.state_dict().items(), resident.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_device_cpu_streams_nothing() -> None:
    """device='cpu': no warning, no copies, the parameters' own memory; training as resident."""
    ours, resident = model(), model()
    pointers = [p.data_ptr() for p in ours.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = th.offload_parameters(ours, device="cpu")
    assert handle.device == torch.device("cpu")
    assert handle.blocks == tuple(ours)
    seen = train(ours)
    train(resident)
    assert seen == [pointers[0]] * 3  # the block ran on the parameter itself, not a copy
    assert [p.data_ptr() for p in ours.parameters()] == pointers
    assert_same(ours, resident)
    handle.remove()
    handle.remove()
    assert [p.data_ptr() for p in ours.parameters()] == pointers


@no_cuda
def test_device_none_without_cuda_warns_and_streams_nothing() -> None:
    """device=None with no CUDA device: a warning says nothing is streamed; training as resident."""
    ours, resident = model(), model()
    with pytest.warns(UserWarning, match=r"no CUDA device is available.*nothing is streamed"):
        handle = th.offload_parameters(ours)
    assert handle.device == torch.device("cpu")
    train(ours)
    train(resident)
    assert_same(ours, resident)
    handle.remove()


def test_cpu_keeps_the_argument_checks() -> None:
    """On the CPU the blocks are checked as on a GPU, and a second handle is refused as there."""
    with pytest.raises(th.ParameterOffloadValueError, match="prefetch must be an int >= 0"):
        th.offload_parameters(model(), device="cpu", prefetch=-1)
    ours = model()
    handle = th.offload_parameters(ours, device="cpu")
    with pytest.raises(th.ParameterOffloadValueError, match="already streamed"):
        th.offload_parameters(ours, device="cpu")
    handle.remove()
    th.offload_parameters(ours, device="cpu").remove()


def test_cpu_with_tensors_elsewhere_is_refused() -> None:
    """device='cpu' runs blocks where their tensors are: a tensor not on the CPU is refused."""
    meta = copy.deepcopy(model()).to("meta")
    with pytest.raises(
        th.ParameterOffloadValueError, match=r"nothing is streamed .* but 0\.0\.weight is on meta"
    ):
        th.offload_parameters(meta, device="cpu")


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_a_device_neither_cuda_nor_cpu_is_refused(device: str | torch.device) -> None:
    """Another device type needs transfer=...; the message says so."""
    with pytest.raises(
        th.ParameterOffloadValueError, match=r"neither a CUDA device nor the CPU.*transfer=\.\.\."
    ):
        th.offload_parameters(model(), device=device)


@no_cuda
def test_cuda_asked_for_without_cuda_raises() -> None:
    """device='cuda' with no CUDA device: ParameterOffloadDeviceError says what to do."""
    ours = model()
    before = [p.data_ptr() for p in ours.parameters()]
    with pytest.raises(
        th.ParameterOffloadDeviceError, match=r"no CUDA device is available.*device='cpu'"
    ):
        th.offload_parameters(ours, device="cuda")
    assert [p.data_ptr() for p in ours.parameters()] == before
    assert isinstance(th.ParameterOffloadDeviceError(), RuntimeError)
    th.offload_parameters(ours, device="cpu").remove()  # nothing was left claimed


class Unrepeated(nn.Module):
    """A model with no repeated blocks: an embedding, a list of two layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.ModuleList([nn.Linear(6, 6), nn.LayerNorm(6)])
        self.head = nn.Linear(6, 2)


def test_the_handle_says_which_blocks_the_default_chose() -> None:
    """repr(handle) names every block: the children, a ModuleList child's items each a block."""
    handle = th.offload_parameters(Unrepeated(), device="cpu")
    assert handle.block_names == ("embed", "body.0", "body.1", "head")
    assert repr(handle) == (
        "<offload_parameters: 4 blocks (embed, body.0, body.1, head), nothing streamed>"
    )
    handle.remove()


def test_a_long_list_of_blocks_is_counted_past_eight() -> None:
    """Past eight blocks the repr counts the rest instead of listing them."""
    handle = th.offload_parameters(
        nn.Sequential(*(nn.Linear(2, 2) for _ in range(10))), device="cpu"
    )
    assert repr(handle) == (
        "<offload_parameters: 10 blocks (0, 1, 2, 3, 4, 5, 6, 7, and 2 more), nothing streamed>"
    )
    handle.remove()
