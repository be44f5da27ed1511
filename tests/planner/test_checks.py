"""What planning checks before trusting a step, and what it leaves as it was (`_planner.checks`)."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

import tensorhooks as th
from tensorhooks._planner.apply import _BlockForward
from tensorhooks._planner.checks import budget_in_bytes


def mlp_block(width: int = 16) -> nn.Module:
    """Linear, GELU, Linear: saves its input and two wider tensors."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def stack(count: int = 3) -> tuple[nn.Sequential, Callable[[], None]]:
    """Blocks of (Linear, GELU, Linear) in float64, and a step that trains them."""
    torch.manual_seed(0)
    model = nn.Sequential(*(mlp_block() for _ in range(count))).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    return model, lambda: model(x).sum().backward()


class NormBlock(nn.Module):
    """Linear, BatchNorm (running statistics), dropout (random numbers): state a step changes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.norm(self.linear(x))))


def test_planning_leaves_state_dict_rng_and_grads_as_they_were() -> None:
    """After plan_activations and report(): state_dict, RNG and .grad are bitwise as before."""
    torch.manual_seed(0)
    model = nn.Sequential(*(NormBlock() for _ in range(3)))
    x = torch.randn(8, 16)

    def step() -> None:
        model(x).square().mean().backward()

    step()  # .grad present before planning, as in a training loop
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert int(state["0.norm.num_batches_tracked"]) == 1
    plan = th.plan_activations(model, step, 0.6)
    plan.report(rounds=1)
    after = model.state_dict()
    assert state.keys() == after.keys()
    for name, value in state.items():
        assert torch.equal(after[name], value), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, grad) for p, grad in zip(model.parameters(), grads, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_planning_on_cuda_leaves_its_generator_as_it_was() -> None:
    """The CUDA generator's state (dropout on the device) is put back too, with the buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(*(NormBlock() for _ in range(3))).cuda()
    x = torch.randn(8, 16, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()

    state = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.cuda.get_rng_state()
    th.plan_activations(model, step, 0.6)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in state.items())


def test_a_step_that_changes_parameters_is_refused() -> None:
    """An optimizer step inside step changes the parameters: planning says it cannot undo that."""
    model, step = stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def training_step() -> None:
        step()
        optimizer.step()

    with pytest.raises(th.PlanStateError, match=r"step changed the parameters \['0\.0\.weight'"):
        th.profile_step(model, training_step, rounds=1)


def test_blocks_listed_out_of_order_are_planned_in_run_order() -> None:
    """Blocks passed in another order than they run are profiled and planned in run order."""
    model, step = stack(4)
    listed = [model[2], model[0], model[3], model[1]]
    shuffled = th.profile_step(model, step, blocks=listed, rounds=1)
    ordered = th.profile_step(model, step, rounds=1)
    assert [block.name for block in shuffled.blocks] == ["0", "1", "2", "3"]
    assert [block.saved_bytes for block in shuffled.blocks] == [
        block.saved_bytes for block in ordered.blocks
    ]
    assert shuffled.fixed_bytes == ordered.fixed_bytes
    plan = th.plan_activations(model, step, 0.5, blocks=listed, profile=shuffled)
    same = th.plan_activations(model, step, 0.5, profile=ordered)
    assert plan.predicted_peak_bytes == same.predicted_peak_bytes
    with plan:
        step()
    assert plan.measured_peak_bytes == plan.predicted_peak_bytes


class TwoStacks(nn.Module):
    """An encoder and a decoder stack; the step may run the encoder alone."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(mlp_block() for _ in range(2))
        self.decoder = nn.ModuleList(mlp_block() for _ in range(2))

    def forward(self, x: torch.Tensor, *, decode: bool) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        for layer in self.decoder if decode else ():
            x = layer(x)
        return x


def test_default_blocks_are_every_stack_the_step_runs() -> None:
    """Both stacks are blocks; a stack the step never runs is left out of the default."""
    torch.manual_seed(0)
    model = TwoStacks()
    x = torch.randn(4, 16)
    both = th.profile_step(model, lambda: model(x, decode=True).sum().backward(), rounds=1)
    assert [block.name for block in both.blocks] == [
        "encoder.0",
        "encoder.1",
        "decoder.0",
        "decoder.1",
    ]
    encoder = th.profile_step(model, lambda: model(x, decode=False).sum().backward(), rounds=1)
    assert [block.name for block in encoder.blocks] == ["encoder.0", "encoder.1"]


def test_a_step_with_create_graph_is_refused() -> None:
    """A gradient penalty (create_graph=True) saves what the profile cannot price: refused."""
    model, _ = stack()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)

    def penalty_step() -> None:
        loss = model(x).square().sum()
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad.square().sum()).backward()

    with pytest.raises(th.PlanStateError, match=r"backward records a graph \(create_graph=True"):
        th.plan_activations(model, penalty_step, 0.5)


def test_a_step_without_backward_is_refused() -> None:
    """A step that only runs the forward would plan nothing: it is refused, saying why."""
    model, _ = stack()
    x = torch.randn(4, 16, dtype=torch.float64)
    with pytest.raises(th.PlanStateError, match=r"the step ran no backward; .*loss\.backward\(\)"):
        th.plan_activations(model, lambda: model(x).sum(), 0.5)


class WritesInput(nn.Module):
    """Doubles its input in place, then a Linear: fine unplanned, not when checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.linear(x)


def test_a_block_writing_its_input_names_the_block_and_the_op() -> None:
    """The first op writing the block's input: the error names the block, the op and the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList(WritesInput() for _ in range(2)))

    def step() -> None:
        x = model[0](torch.randn(4, 8))
        for block in model[1]:
            x = block(x)
        x.sum().backward()

    step()  # runs unplanned
    with pytest.raises(
        th.PlanStateError,
        match=r"block 0 \(WritesInput\) writes its input in place \(aten\.mul_\.Tensor\).*"
        r"out of place",
    ):
        th.profile_step(model, step, rounds=1)


class CacheBlock(nn.Module):
    """Appends to a cache it is handed (a KV cache) and reads all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        assert cache is not None
        cache.append(self.linear(x))
        return torch.cat(cache).tanh().sum(0, keepdim=True) * x


class CachingModel(nn.Module):
    """Two cache blocks sharing one cache per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x


def test_a_block_given_a_cache_names_use_cache() -> None:
    """A block handed a cache it writes fails in recomputation: the error names use_cache=False."""
    torch.manual_seed(0)
    model = CachingModel()
    x = torch.randn(4, 8)

    def step() -> None:
        model(x).sum().backward()

    step()  # runs unplanned
    with pytest.raises(
        th.PlanStateError, match=r"block 0 \(CacheBlock\) runs with a KV cache.*use_cache=False"
    ):
        th.profile_step(model, step, rounds=1)


def test_copies_inside_a_plan_are_plain_models() -> None:
    """A deepcopy (an EMA copy) and torch.save inside `with plan:` give models without the plan."""
    model, step = stack()
    plan = th.plan_activations(model, step, 0.5)
    buffer = io.BytesIO()
    with plan:
        ema = copy.deepcopy(model)
        torch.save(model, buffer)
        step()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        assert not any(isinstance(m.__dict__.get("forward"), _BlockForward) for m in copied)
        th.plan_activations(copied, step, 0.5, profile=plan.profile).apply().remove()
        x = torch.randn(4, 16, dtype=torch.float64)
        assert torch.equal(copied(x), model(x))
    assert "forward" not in model[0].__dict__


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.nan])
def test_profile_bandwidth_must_be_positive(bandwidth: float) -> None:
    """A replaced bandwidth of 0, below 0 or NaN is refused at replace(), naming it."""
    model, step = stack()
    profile = th.profile_step(model, step, rounds=1, unplanned=False)
    with pytest.raises(th.PlanArgumentValueError, match=r"bandwidth must be a positive number"):
        replace(profile, bandwidth=bandwidth)
    with pytest.raises(th.PlanArgumentValueError, match=r"fixed_bytes must be a finite number"):
        replace(profile, fixed_bytes=-1)


def test_with_a_removed_handle_is_refused() -> None:
    """`with handle:` after remove() would run unplanned: it raises on entry."""
    model, step = stack()
    handle = th.plan_activations(model, step, 0.5).apply()
    handle.remove()
    with pytest.raises(th.PlanStateError, match=r"already removed, so `with handle:` would run"):
        handle.__enter__()


def test_no_repeated_blocks_is_said_in_the_plan_and_the_budget_error() -> None:
    """A model without a stack of repeated layers: the plan and a budget error say so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(4, 8)

    def step() -> None:
        model(x).sum().backward()

    profile = th.profile_step(model, step, rounds=1)
    plan = th.plan_activations(model, step, 1.0, profile=profile)
    assert "no repeated blocks found" in str(plan)
    with pytest.raises(th.PlanBudgetError, match=r"no repeated blocks found.*blocks=\[\.\.\.\]"):
        th.plan_activations(model, step, 1, profile=profile)
    listed = th.plan_activations(model, step, 1.0, blocks=list(model), profile=profile)
    assert "no repeated blocks" not in str(listed)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("64 kb", 64_000),
        ("100B", 100),
        (1000, 1000),
        (0.5, 500),
    ],
)
def test_budgets_with_units(budget: object, expected: int) -> None:
    """Sizes with units, as torch users write them; KB..TB are decimal, KiB..TiB binary."""
    assert budget_in_bytes(budget, 1000, "plan_activations") == expected


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        ("8 parsecs", r"budget '8 parsecs' is not a size; .*\"512MiB\""),
        ("512", r"budget '512' is not a size"),
        ("-1GB", r"budget '-1GB' is not a size"),
        ("0GB", r"budget must be positive, got '0GB'"),
    ],
)
def test_bad_budget_strings(budget: str, match: str) -> None:
    """A string that is not a number with a unit names itself and the units it may use."""
    with pytest.raises(th.PlanArgumentValueError, match=match):
        budget_in_bytes(budget, 1000, "plan_activations")


def test_a_string_budget_plans() -> None:
    """plan_activations takes a budget with units."""
    model, step = stack()
    profile = th.profile_step(model, step, rounds=1)
    plan = th.plan_activations(model, step, "1MiB", profile=profile)
    assert plan.budget_bytes == 1 << 20


def test_planning_runs_the_step_twice_and_ties_alike_blocks() -> None:
    """A profile runs the step once a round, planning once more; alike blocks get equal times."""
    torch.manual_seed(0)
    narrow = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))
    model = nn.Sequential(*(mlp_block() for _ in range(3)), narrow).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)  # the first block is alike
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        model(x).sum().backward()

    th.plan_activations(model, step, 0.5, blocks=list(model))
    assert calls == 2  # the recorded step and the confirming one
    th.plan_activations(model, step, 0.5, blocks=list(model), confirm=False)
    assert calls == 3
    profile = th.profile_step(model, step, blocks=list(model), rounds=3)
    assert calls == 6
    first, *others, odd = profile.blocks
    for block in others:
        assert [op.seconds for op in block.ops] == [op.seconds for op in first.ops]
        assert block.recompute_seconds == first.recompute_seconds
        assert block.forward_seconds == first.forward_seconds
        assert block.backward_seconds == first.backward_seconds
        assert block.saved_bytes == first.saved_bytes  # bytes as measured, not smoothed
    assert odd.saved_bytes < first.saved_bytes
    assert [op.seconds for op in odd.ops] != [op.seconds for op in first.ops][: len(odd.ops)]


def scaled(profile: th.StepProfile, factor: float) -> th.StepProfile:
    """``profile`` with every time multiplied by ``factor`` (bytes as they were)."""
    blocks = tuple(
        replace(
            block,
            ops=tuple(replace(op, seconds=op.seconds * factor) for op in block.ops),
            forward_seconds=block.forward_seconds * factor,
            backward_seconds=block.backward_seconds * factor,
            recompute_seconds=block.recompute_seconds * factor,
        )
        for block in profile.blocks
    )
    times = {
        name: getattr(profile, name) * factor
        for name in (
            "after_forward_seconds",
            "after_backward_seconds",
            "checkpointed_step_seconds",
            "checkpoint_overhead_seconds",
            "policy_op_seconds",
            "cached_op_seconds",
        )
    }
    unplanned = profile.unplanned_step_seconds
    return replace(
        profile,
        blocks=blocks,
        unplanned_step_seconds=None if unplanned is None else unplanned * factor,
        **times,
    )


def test_alike_blocks_are_planned_alike_whatever_the_scale_of_their_times() -> None:
    """Ties among a stack's layers go to bytes, then block order, not to a float sum's last bits."""
    torch.manual_seed(0)
    model = nn.Sequential(*(mlp_block() for _ in range(12))).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    step = lambda: model(x).sum().backward()  # noqa: E731
    profile = th.profile_step(model, step, rounds=1)
    for budget in (0.3, 0.5, 0.7, 0.9):
        plans = {
            tuple(th.plan_activations(model, step, budget, profile=scaled(profile, f)).choices)
            for f in (0.37, 1.0, 1.3, 2.9, 7.1)
        }
        assert len(plans) == 1, budget
