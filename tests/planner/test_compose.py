"""plan_activations composes with autograd.grad, mutation, parameter offload and gradient sync."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tensorhooks as th
from tensorhooks.cli._models import ModelConfig, TinyTransformer, make_batch
from tensorhooks.distributed import sync_gradients
from tests.params_device import HostCloneTransfer


def mlp_block(width: int = 16) -> nn.Module:
    """Linear, GELU, Linear: saves its input and two wider tensors."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def stack(seed: int = 0) -> nn.Sequential:
    """Four MLP blocks in float64, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(*(mlp_block() for _ in range(4))).double()


def batch() -> torch.Tensor:
    return torch.randn(6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' gradients, cleared from the model."""
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs) > 0
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine, other)


def planned(model: nn.Module, step: Callable[[], object], budget: float) -> th.ActivationPlan:
    """A plan that checkpoints at least one block, applied inside ``with``."""
    plan = th.plan_activations(model, step, budget)
    assert any(block.checkpoint for block in plan.blocks)
    return plan


def test_autograd_grad() -> None:
    """A step that calls torch.autograd.grad gets the unplanned gradients under a plan."""
    model = stack()
    x = batch()
    results: list[tuple[torch.Tensor, ...]] = []

    def step() -> None:
        results.append(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))

    step()
    reference = results.pop()
    plan = planned(model, step, 0.5)
    results.clear()
    with plan:
        step()
    assert_same(list(results[-1]), list(reference))
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes


def test_allow_mutation_on_saved_tensors() -> None:
    """In-place residual adds under allow_mutation_on_saved_tensors: out-of-place gradients."""
    config = ModelConfig(batch=2, seq=8, d_model=16, heads=2, layers=3, vocab=32)
    torch.manual_seed(0)
    model = TinyTransformer(config).double()
    tokens, targets = make_batch(config)

    def step() -> None:
        with th.allow_mutation_on_saved_tensors():
            model(tokens, targets, inplace=True).backward()

    model(tokens, targets).backward()
    reference = grads_of(model)
    plan = planned(model, step, 0.6)
    with plan:
        step()
    assert_same(grads_of(model), reference)


def test_offload_parameters() -> None:
    """Blocks streamed by offload_parameters and planned: the resident model's gradients."""
    ours, resident = stack(), stack()
    x = batch()
    handle = th.offload_parameters(ours, blocks=list(ours), transfer=HostCloneTransfer())

    def step() -> None:
        ours(x).square().sum().backward()

    resident(x).square().sum().backward()
    plan = planned(ours, step, 0.5)
    with plan:
        step()
    assert_same(grads_of(ours), grads_of(resident))
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    handle.remove()


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A default gloo process group of one rank."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_sync_gradients() -> None:
    """Gradients synchronised by sync_gradients (one gloo rank) under a plan: as plain."""
    ours, plain = stack(), stack()
    x = batch()
    handle = sync_gradients(ours)

    def step() -> None:
        ours(x).square().sum().backward()

    plain(x).square().sum().backward()
    plan = planned(ours, step, 0.5)
    with plan:
        step()
    assert_same(grads_of(ours), grads_of(plain))
    handle.remove()


@pytest.mark.usefixtures("world_of_one")
def test_distributed_data_parallel() -> None:
    """DDP (one gloo rank) over a planned module: the plain gradients."""
    model, plain = stack(), stack()
    ddp = DistributedDataParallel(model)
    x = batch()

    def step() -> None:
        ddp(x).square().sum().backward()

    plain(x).square().sum().backward()
    plan = planned(model, step, 0.5)
    with plan:
        step()
    assert_same(grads_of(model), grads_of(plain))
