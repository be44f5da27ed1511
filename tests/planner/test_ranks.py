"""plan_activations under FSDP2: the budget counts activations only, one plan for every rank.

The two-rank tests run this module under torchrun (`tests.distributed.torchrun.launch`, this
module as each rank): one launch runs every case, and the tests read what each rank reported.
"""

from __future__ import annotations

import gc
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tensorhooks as th
from tensorhooks._core.torch_compat import storage_key
from tensorhooks._planner import preset_plan
from tensorhooks._planner.accounting import module_keys
from tensorhooks._planner.ranks import agreed, figures
from tests.distributed.torchrun import (
    WORLD_SIZE,
    cpu_mesh,
    full_grads,
    launch,
    max_difference,
    run_rank,
)

TOLERANCE = 1e-9
FRACTIONS = (0.5, 0.65, 0.8, 1.0)


class Block(nn.Module):
    """A residual MLP block: what FSDP2 shards one ``fully_shard`` at a time."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def make_model(hidden: int, blocks: int = 4, width: int = 16) -> nn.Sequential:
    """The same float64 model on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, hidden) for _ in range(blocks))).double()


def sharded(model: nn.Module, mesh: Any, **options: Any) -> nn.Module:
    """``model`` with each block and the root under ``fully_shard(..., **options)``."""
    for block in model:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def batches(sizes: list[int], width: int = 16) -> list[torch.Tensor]:
    """One input per rank, of ``sizes[rank]`` rows."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(size, width, dtype=torch.float64, generator=generator) for size in sizes]


def taken_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter's gradient, whole (gathered under FSDP2, a collective), then cleared."""
    grads = full_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


# --- one rank of the torchrun launch ---------------------------------------------------------


def _case(rank: int, mesh: Any, hidden: int, sizes: list[int], budgets: int) -> dict[str, Any]:
    """Plan a sharded model at a sweep of budgets; each plan's peak and gradients, on this rank.

    The loss of each rank is its rows' sum scaled by world/rows-in-all, so FSDP2's average over
    the ranks is the one-process loss over every row, whatever the split.
    """
    single = make_model(hidden)
    model = sharded(make_model(hidden), mesh)
    inputs = batches(sizes)
    scale = WORLD_SIZE / sum(sizes)
    local = inputs[rank]

    def step() -> None:
        (model(local).square().sum() * scale).backward()

    single(torch.cat(inputs)).square().sum().div(sum(sizes)).backward()
    reference = taken_grads(single)
    profile = th.profile_step(model, step, blocks=list(model), rounds=1)
    plans = []
    least = th.plan_activations(model, step, 1.0, blocks=list(model), profile=profile)
    for budget in [least.least_peak_bytes, *FRACTIONS][:budgets]:
        plan = th.plan_activations(model, step, budget, blocks=list(model), profile=profile)
        with plan:
            step()
        max_diff, none_mismatch, max_grad = max_difference(taken_grads(model), reference)
        plans.append(
            {
                "budget": plan.budget_bytes,
                "measured": plan.measured_peak_bytes,
                "predicted": plan.predicted_peak_bytes,
                "plan": zlib.crc32(str(plan).encode()),
                "max_diff": max_diff,
                "none_mismatch": none_mismatch,
                "max_grad": max_grad,
            }
        )
    return {"plans": plans, "profile_peak": profile.checkpointed_peak_bytes}


def _mismatch(rank: int, mesh: Any) -> dict[str, Any]:
    """Rank 1 profiles three of the four blocks: every rank refuses to plan."""
    model = sharded(make_model(32), mesh)
    local = batches([6, 6])[rank]
    blocks = list(model)[: 4 - rank]
    try:
        th.profile_step(model, lambda: model(local).sum().backward(), blocks=blocks, rounds=1)
    except th.PlanStateError as error:
        return {"error": str(error)}
    return {"error": None}


def _failure(rank: int, mesh: Any) -> dict[str, Any]:
    """Profiling raises on rank 1 only (its blocks are not the model's): how each rank ends."""
    model = sharded(make_model(16), mesh)
    local = batches([6, 6])[rank]
    blocks = [nn.Linear(2, 2)] if rank == 1 else list(model)

    def step() -> None:
        model(local).sum().backward()

    started = time.monotonic()
    try:
        th.profile_step(model, step, blocks=blocks, rounds=1)
    except Exception as error:  # reported to the test, which checks its class
        return {
            "error": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - started,
        }
    return {"error": None}


def _explained(rank: int, mesh: Any) -> dict[str, Any]:
    """Each rank explains its own step (uneven shards and inputs), then plans for 60% of it."""
    model = sharded(make_model(47), mesh)
    local = batches([9, 5])[rank]

    def step() -> None:
        model(local).square().sum().backward()

    explanation = th.explain(model, step, 0.6, blocks=list(model))
    plan = explanation.plan
    assert plan is not None
    with plan:
        step()
    kept = preset_plan(model, step, "keep", profile=plan.profile)
    with kept:  # every block kept: this rank's own peak with no checkpointing
        step()
    choices = [(b.checkpoint, b.saved, b.offloaded, b.offload_input) for b in plan.blocks]
    return {
        "peak": explanation.peak_bytes,
        "unplanned": kept.measured_peak_bytes,
        "attributed": explanation.attributed_fraction,
        "lints": [lint.code for lint in explanation.lints],
        "budget": explanation.budget_bytes,
        "plan": zlib.crc32(repr(choices).encode()),  # not its timings: each rank's own
        "measured": plan.measured_peak_bytes,
    }


def cases(rank: int, world: int) -> dict[str, Any]:
    """One rank of the torchrun launch: every case."""
    assert world == WORLD_SIZE
    mesh = cpu_mesh()
    return {
        # hidden 48 splits evenly; 47 leaves rank 1 a smaller shard of every up-projection, and
        # the ranks' inputs differ in length too.
        "even": _case(rank, mesh, 48, [8, 8], budgets=5),
        "uneven": _case(rank, mesh, 47, [9, 5], budgets=5),
        "failed": _failure(rank, mesh),
        # After a failure the ranks are still in step: the next collective matches.
        "mismatch": _mismatch(rank, mesh),
        "explained": _explained(rank, mesh),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case, run once by two gloo ranks under torchrun."""
    return launch("tests.planner.test_ranks", tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow
class TestTwoRanks:
    """Two gloo ranks, each block and the root under fully_shard, against one process."""

    @pytest.mark.parametrize("case", ["even", "uneven"])
    def test_measured_peak_within_budget_on_every_rank(
        self, two_ranks: list[dict[str, Any]], case: str
    ) -> None:
        """At every budget of the sweep (the least peak included) each rank holds <= budget."""
        for rank in two_ranks:
            plans = rank[case]["plans"]
            assert len(plans) == 5
            for plan in plans:
                assert 0 < plan["measured"] <= plan["budget"], plan

    @pytest.mark.parametrize("case", ["even", "uneven"])
    def test_gradients_equal_one_process(self, two_ranks: list[dict[str, Any]], case: str) -> None:
        """Every plan's gradients, gathered whole, equal one process's on all rows to 1e-9."""
        for rank in two_ranks:
            for plan in rank[case]["plans"]:
                assert plan["max_grad"] > 0
                assert plan["none_mismatch"] == 0
                assert plan["max_diff"] <= TOLERANCE, plan

    @pytest.mark.parametrize("case", ["even", "uneven"])
    def test_every_rank_gets_the_same_plan(
        self, two_ranks: list[dict[str, Any]], case: str
    ) -> None:
        """The ranks agree on one profile, so each budget gives one plan and one prediction."""
        first, second = (rank[case] for rank in two_ranks)
        assert first["profile_peak"] == second["profile_peak"]
        for ours, theirs in zip(first["plans"], second["plans"], strict=True):
            assert (ours["plan"], ours["budget"], ours["predicted"]) == (
                theirs["plan"],
                theirs["budget"],
                theirs["predicted"],
            )

    def test_uneven_inputs_plan_for_the_larger(self, two_ranks: list[dict[str, Any]]) -> None:
        """The rank with fewer rows holds less than the agreed prediction; the larger meets it."""
        smaller, larger = (rank["uneven"]["plans"][-1] for rank in reversed(two_ranks))
        assert smaller["measured"] < larger["measured"] <= larger["predicted"]

    def test_ranks_profiling_other_blocks_raise(self, two_ranks: list[dict[str, Any]]) -> None:
        """Profiles of another structure on some rank: every rank raises, none plans alone."""
        for rank in two_ranks:
            error = rank["mismatch"]["error"]
            assert error is not None
            assert "another structure" in error

    def test_a_failure_on_one_rank_raises_on_every_rank(
        self, two_ranks: list[dict[str, Any]]
    ) -> None:
        """Rank 1 raises while profiling: its own error there, PlanStateError naming it on 0.

        At once, not after the process group's timeout (120 s in the launch).
        """
        first, second = (rank["failed"] for rank in two_ranks)
        assert first["error"] == "PlanStateError", first
        assert "rank 1 raised while profiling" in first["message"]
        assert second["error"] == "PlanArgumentValueError", second
        assert "not a submodule" in second["message"]
        assert first["seconds"] < 60
        assert second["seconds"] < 60

    def test_explain_measures_each_ranks_own_peak(self, two_ranks: list[dict[str, Any]]) -> None:
        """Each rank explains its own peak, gathered parameters left out, all of it attributed."""
        for rank in two_ranks:
            explained = rank["explained"]
            assert explained["peak"] == explained["unplanned"]
            assert explained["attributed"] >= 0.95
            assert explained["lints"] == []
        first, second = (rank["explained"]["peak"] for rank in two_ranks)
        assert first > second  # 9 rows against 5

    def test_explain_plans_one_budget_for_every_rank(self, two_ranks: list[dict[str, Any]]) -> None:
        """A fraction is of the largest peak over the ranks: one budget, one plan, which fits."""
        first, second = (rank["explained"] for rank in two_ranks)
        assert (first["budget"], first["plan"]) == (second["budget"], second["plan"])
        assert first["budget"] == int(0.6 * max(first["peak"], second["peak"]))
        for explained in (first, second):
            assert explained["measured"] <= explained["budget"]


# --- one process: a gloo group of one rank ----------------------------------------------------


@pytest.fixture(scope="module")
def mesh_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A gloo process group of one rank, and its device mesh."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    gc.collect()
    dist.destroy_process_group()


def _workload(mesh: Any, **options: Any) -> tuple[nn.Module, Callable[[], None]]:
    model = sharded(make_model(48), mesh, **options)
    (x,) = batches([8])

    def step() -> None:
        model(x).square().sum().backward()

    return model, step


def test_profile_without_fully_shard_is_unchanged() -> None:
    """With no fully_shard in the model, agreeing is a no-op returning the profile itself."""
    model = make_model(8, blocks=2)
    x = torch.randn(4, 16, dtype=torch.float64)
    profile = th.profile_step(model, lambda: model(x).sum().backward(), rounds=1)
    assert agreed(profile, model) is profile


def test_signature_is_the_structure_not_the_device() -> None:
    """Ranks on cuda:0 and cuda:1 agree; a profile of other blocks does not."""
    model = make_model(8, blocks=2)
    x = torch.randn(4, 16, dtype=torch.float64)
    profile = th.profile_step(model, lambda: model(x).sum().backward(), rounds=1)
    numbers, signature = figures(profile)
    other_device = figures(replace(profile, device="cuda:1"))
    assert other_device == (numbers, signature)
    assert figures(replace(profile, blocks=profile.blocks[:1]))[1] != signature
    slower = replace(profile, checkpointed_step_seconds=profile.checkpointed_step_seconds * 2)
    assert figures(slower)[1] == signature  # a figure is agreed on, not compared


def test_gathered_parameters_are_not_activations(mesh_of_one: Any) -> None:
    """After a forward, the buffers FSDP2 gathers parameters into count as the model's."""
    model, step = _workload(mesh_of_one)
    before = module_keys(model)
    step()
    after = module_keys(model)
    gathered = after - before
    # One buffer per parameter (weight and bias of two linears in each of four blocks).
    assert len(gathered) == 16
    weight = model[0].up.weight
    model[0].unshard()
    assert weight is not model[0].up.weight  # the unsharded parameter is registered now
    assert storage_key(model[0].up.weight) in gathered
    model[0].reshard()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reshard_after_forward": False},
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)},
    ],
    ids=["default", "kept-unsharded", "float32-params"],
)
def test_plans_within_budget_on_one_rank(mesh_of_one: Any, options: dict[str, Any]) -> None:
    """On a mesh of one, the measured peak stays within every budget of the sweep."""
    model, step = _workload(mesh_of_one, **options)
    profile = th.profile_step(model, step, rounds=1)
    assert agreed(profile, model) == profile  # the worst case over one rank is its own
    for budget in FRACTIONS:
        plan = th.plan_activations(model, step, budget, profile=profile)
        with plan:
            step()
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= plan.budget_bytes


if __name__ == "__main__":
    run_rank(cases)
