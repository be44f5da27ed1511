"""Every feature under FSDP2 (fully_shard) and DDP: one process's gradients, or a refusal."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import tensorhooks as th
from tensorhooks import (
    HookArgumentValueError,
    ParameterOffloadValueError,
    SyncArgumentValueError,
)
from tensorhooks.distributed import sync_gradients

from .fsdp2_ranks import CHECKPOINTS, CONTEXTS, PLAN_BUDGETS, SHARDINGS
from .test_distributed import world_of_one  # noqa: F401  # a fixture: found by name
from .torchrun import ROOT, cpu_mesh, full_grads, launch, run_script

SEED = "105"
# float64 on two ranks against one process: only the order of additions differs.
RELATIVE_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every drawn case, run once by two gloo ranks started by torchrun."""
    # A seed whose draws cover every feature (test_draws_cover_every_feature_and_order says so).
    return launch("tests.distributed.fsdp2_ranks", tmp_path_factory.mktemp("fsdp2"), SEED)


def _check(report: dict[str, Any]) -> None:
    assert report["none_mismatch"] == 0, report
    assert report["max_grad"] > 0, report
    assert report["max_diff"] <= RELATIVE_TOLERANCE * max(1.0, report["max_grad"]), report


@pytest.mark.slow
class TestTwoRanks:
    """Drawn models and feature combinations on two gloo ranks against one process."""

    def test_fully_shard_gives_one_process_gradients(self, ranks: list[dict[str, Any]]) -> None:
        """Blocks and root sharded, or the root alone: each drawn case has one process's grads."""
        for report in ranks:
            for case in report["fsdp2"]:
                _check(case)

    def test_ddp_gives_one_process_gradients(self, ranks: list[dict[str, Any]]) -> None:
        """DistributedDataParallel around the model: the same, for the drawn combinations."""
        for report in ranks:
            for case in report["ddp"]:
                _check(case)

    def test_plans_hold_their_budget_on_every_rank(self, ranks: list[dict[str, Any]]) -> None:
        """Drawn cases under plan_activations: each rank held at most the shared budget."""
        for report in ranks:
            planned = [case for case in report["fsdp2"] + report["ddp"] if case["plan"] is not None]
            assert planned
            for case in planned:
                assert 0 < case["measured"] <= case["budget"], case
        # One plan for every rank under FSDP2: the same budget on both.
        budgets = [[case["budget"] for case in report["fsdp2"]] for report in ranks]
        assert budgets[0] == budgets[1]

    def test_ranks_ran_the_same_cases(self, ranks: list[dict[str, Any]]) -> None:
        """Both ranks drew the same cases (a collective would hang otherwise, but say so)."""
        strip = ("max_diff",)
        first, second = (
            [{k: v for k, v in case.items() if k not in strip} for case in report["fsdp2"]]
            for report in ranks
        )
        assert [case["seed"] for case in first] == [case["seed"] for case in second]

    def test_draws_cover_every_feature_and_order(self, ranks: list[dict[str, Any]]) -> None:
        """The seed draws every checkpoint kind, context, sharding, plan budget, order, grad()."""
        cases = ranks[0]["fsdp2"]
        assert {case["checkpoint"] for case in cases} == set(CHECKPOINTS)
        assert {case["context"] for case in cases} == set(CONTEXTS)
        assert {case["sharding"] for case in cases} == set(SHARDINGS)
        assert {case["plan"] for case in cases} == {None, *PLAN_BUDGETS}
        assert any(case["plan"] is not None for case in ranks[0]["ddp"])
        # The mutation context saving weights that FSDP2 frees and gathers again, through each
        # of its two copies (dimension 0, dimension 1), outside any checkpoint region.
        for sharding in ("blocks", "blocks_on_dim_1"):
            assert any(
                c["context"] == "mutation" and c["sharding"] == sharding and not c["checkpoint"]
                for c in cases
            )
        assert {case["checkpoint_outside"] for case in cases if case["checkpoint"]} == {
            True,
            False,
        }
        assert any(case["writes_saved"] for case in cases)
        assert any(case["grad_of_input"] for case in cases)
        assert any(case["activation"] == "relu_" for case in cases)

    def test_transformers_recipe_gives_one_process_gradients(
        self, ranks: list[dict[str, Any]]
    ) -> None:
        """docs/scaling-out.md's GPT-2 recipe, plain and under allow_mutation_on_saved_tensors."""
        pytest.importorskip("transformers")
        for report in ranks:
            assert [case["context"] for case in report["transformers"]] == [None, "mutation"]
            for case in report["transformers"]:
                _check(case)

    def test_example_trains_under_torchrun(self, tmp_path: Path) -> None:
        """examples/train_fsdp2_torchrun.py trains under a plan within budget on both ranks."""
        output = run_script(ROOT / "examples" / "train_fsdp2_torchrun.py", tmp_path, "--steps", "3")
        assert "activation plan on cpu, no host link" in output, output
        assert "step 2: loss" in output, output
        peaks = re.findall(r"rank (\d): activation peak ([\d,]+) bytes, budget ([\d,]+)", output)
        assert [rank for rank, _, _ in peaks] == ["0", "1"], output
        for _, peak, budget in peaks:
            assert 0 < int(peak.replace(",", "")) <= int(budget.replace(",", "")), output
        assert "trained 3 steps on 2 ranks, cpu" in output, output


# --- one process: FSDP2 over a world of one gloo rank --------------------------------------------


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 2)).double()


def _sharded(model: nn.Module) -> nn.Module:
    mesh = cpu_mesh()
    for layer in model:  # type: ignore[attr-defined]  # a Sequential
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch() -> torch.Tensor:
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.usefixtures("world_of_one")
class TestRefusals:
    """What cannot work under fully_shard refuses at once, naming what to use."""

    def test_sync_gradients_refuses_a_sharded_model(self) -> None:
        """FSDP2 reduces gradients itself: the module and its parameters are both refused."""
        model = _sharded(_model())
        with pytest.raises(SyncArgumentValueError, match=r"sharded by FSDP2.*already averaged"):
            sync_gradients(model)
        with pytest.raises(SyncArgumentValueError, match="set_requires_gradient_sync"):
            sync_gradients(list(model.parameters()))

    def test_offload_parameters_points_at_cpu_offload_policy(self) -> None:
        """offload_parameters on a sharded model names FSDP2's CPUOffloadPolicy."""
        model = _sharded(_model())
        with pytest.raises(ParameterOffloadValueError, match=r"CPUOffloadPolicy\(\)"):
            th.offload_parameters(model, device="cpu")

    def test_multi_grad_hook_on_sharded_parameters_refused(self) -> None:
        """Sharded parameters never get an autograd grad: refused, naming the hook to use."""
        model = _sharded(_model())
        with pytest.raises(HookArgumentValueError, match="register_post_accumulate_grad_hook"):
            th.register_multi_grad_hook(list(model.parameters()), lambda grads: None)

    def test_torch_multi_grad_hook_never_fires_there(self) -> None:
        """The difference: torch's hook on the same parameters silently makes zero calls."""
        model = _sharded(_model())
        calls: list[int] = []
        handle = torch.autograd.graph.register_multi_grad_hook(
            list(model.parameters()), lambda grads: calls.append(1)
        )
        model(_batch()).sum().backward()
        handle.remove()
        assert calls == []
        assert all(param.grad is not None for param in model.parameters())

    def test_post_accumulate_grad_hooks_fire_once_each(self) -> None:
        """What the refusal points at does fire, once per sharded parameter, grads set."""
        model = _sharded(_model())
        seen: list[bool] = []
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
        model(_batch()).sum().backward()
        assert seen == [True] * len(list(model.parameters()))

    def test_plain_tensors_are_still_accepted(self) -> None:
        """A sharded model elsewhere does not make plain tensors refused."""
        _sharded(_model())
        leaf = torch.ones(2, requires_grad=True)
        calls: list[int] = []
        handle = th.register_multi_grad_hook([leaf], lambda grads: calls.append(1))
        (leaf * 2).sum().backward()
        handle.remove()
        assert calls == [1]


@pytest.mark.usefixtures("world_of_one")
class TestMutationOneRank:
    """allow_mutation_on_saved_tensors where FSDP2 refills parameters with copy_ (one rank)."""

    @pytest.mark.parametrize("write", [False, True])
    def test_gradients_are_the_unsharded_model_s(self, write: bool) -> None:
        """Freed and refilled weights are read as FSDP2 refilled them; a real write is cloned."""
        reference, model = _model(), _sharded(_model())

        def loss(net: nn.Module) -> torch.Tensor:
            h = net[1](net[0](_batch()))  # type: ignore[index]  # a Sequential
            out = net[2](h)  # type: ignore[index]  # saves h
            if write:
                h.mul_(3.0)
            return net[3](out + h).pow(2).sum()  # type: ignore[index]

        with th.allow_mutation_on_saved_tensors():
            loss(reference).backward()
        with th.allow_mutation_on_saved_tensors():
            loss(model).backward()
        for got, expected in zip(full_grads(model), full_grads(reference), strict=True):
            assert got is not None
            assert expected is not None
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
