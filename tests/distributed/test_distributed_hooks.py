"""sync_gradients with users' gradient hooks: averaged as DistributedDataParallel averages them."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from tensorhooks import (
    GradientSyncError,
    ParameterOffloadHandle,
    SyncArgumentTypeError,
    SyncArgumentValueError,
    offload_parameters,
)
from tensorhooks.distributed import GradientSyncHandle, sync_gradients
from tests.params_device import HostCloneTransfer

from .test_distributed import (
    TOLERANCE,
    Net,
    _max_grad_difference,
    run_ranks,
    run_worker,
    world_of_one,  # noqa: F401  # a fixture: pytest finds it by name in this module
)


def _scale(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda grad: grad * factor


def _clip(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-0.05, 0.05)


def _scale_in_place(param: torch.Tensor) -> None:
    assert param.grad is not None
    param.grad.mul_(0.25)


def _shift_in_place(param: torch.Tensor) -> None:
    assert param.grad is not None
    param.grad.add_(1.0)


def _hook_before(model: Net) -> None:
    """Hooks registered before sync_gradients (or DDP) is set up."""
    model.out.weight.register_hook(_scale(0.5))


def _hook_after(model: Net) -> None:
    """Tensor hooks and post-accumulate-grad hooks registered after, some changing .grad."""
    model.inp.weight.register_hook(_clip)
    for layer in (model.inp, model.left, model.right, model.out):
        layer.bias.register_hook(_scale(3.0))
    model.left.weight.register_post_accumulate_grad_hook(_scale_in_place)
    model.right.bias.register_post_accumulate_grad_hook(_scale_in_place)
    model.out.bias.register_post_accumulate_grad_hook(_shift_in_place)
    model.out.weight.register_hook(_clip)


# --- scenarios run by each of two gloo ranks ------------------------------------------------------


def _batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, dtype=torch.float64, generator=generator)


def _scenario_user_hooks(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ours = Net().double()
    reference = copy.deepcopy(ours)
    _hook_before(ours)
    _hook_before(reference)
    handle = sync_gradients(ours, bucket_cap_mb=0.002)  # several buckets, some of one tensor
    ddp = DistributedDataParallel(reference, find_unused_parameters=True, bucket_cap_mb=0.002)
    _hook_after(ours)
    _hook_after(reference)
    report = {"max_diff": 0.0, "none_mismatch": 0, "max_grad": 0.0, "compared": 0}
    for step in range(3):
        if step == 1:  # a local step first: its hooks' results are averaged by the next one
            with handle.no_sync(), ddp.no_sync():
                ours(_batch(rank, 10)).pow(2).mean().backward()
                ddp(_batch(rank, 10)).pow(2).mean().backward()
        ours(_batch(rank, step)).pow(2).mean().backward()
        ddp(_batch(rank, step)).pow(2).mean().backward()
        diff, mismatched, largest = _max_grad_difference(ours, ddp.module)
        report["max_diff"] = max(report["max_diff"], diff)
        report["none_mismatch"] += mismatched
        report["max_grad"] = max(report["max_grad"], largest)
        report["compared"] += 1
        for model in (ours, ddp.module):
            model.zero_grad(set_to_none=True)
    handle.remove()
    return report


def _scenario_doubling_hook(rank: int) -> dict[str, Any]:
    """One weight, one bucket, a hook registered after: 3.0 on both ranks, as with DDP."""
    grads = []
    for wrap in ("ours", "ddp"):
        model = nn.Linear(1, 1, bias=False)
        nn.init.ones_(model.weight)
        if wrap == "ours":
            handle = sync_gradients(model)
            model.weight.register_hook(_scale(2.0))
            model(torch.full((1, 1), float(rank + 1))).sum().backward()
            handle.remove()
        else:
            ddp = DistributedDataParallel(model)
            model.weight.register_hook(_scale(2.0))
            ddp(torch.full((1, 1), float(rank + 1))).sum().backward()
        assert model.weight.grad is not None
        grads.append(model.weight.grad.item())
    return {"ours": grads[0], "ddp": grads[1]}


class CheckpointedNet(nn.Module):
    """Two blocks under torch's checkpoint between layers outside it, as in decoder stacks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.use_reentrant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(_block, block, h, use_reentrant=self.use_reentrant)
        out: torch.Tensor = self.head(h)
        return out


def _block(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(h))


def _scenario_reentrant(rank: int) -> dict[str, Any]:
    """DDP(static_graph=True) runs reentrant checkpoint; ours refuses it, then runs without."""
    torch.manual_seed(0)
    ours = CheckpointedNet().double()
    ddp = DistributedDataParallel(copy.deepcopy(ours), static_graph=True)
    handle = sync_gradients(ours)
    refused = ""
    try:
        ours(_batch(rank, 0)).sum().backward()
    except GradientSyncError as error:
        refused = str(error)
    ours.zero_grad(set_to_none=True)
    ours.use_reentrant = False
    report = {"max_diff": 0.0, "none_mismatch": 0, "max_grad": 0.0, "compared": 0}
    for step in range(2):  # DDP's static graph differs between its first and later steps
        ours(_batch(rank, step)).sum().backward()
        ddp(_batch(rank, step)).sum().backward()
        for mine, theirs in zip(ours.parameters(), ddp.module.parameters(), strict=True):
            if mine.grad is None or theirs.grad is None:
                report["none_mismatch"] += (mine.grad is None) != (theirs.grad is None)
                continue
            report["max_diff"] = max(
                report["max_diff"], (mine.grad - theirs.grad).abs().max().item()
            )
            report["max_grad"] = max(report["max_grad"], theirs.grad.abs().max().item())
        report["compared"] += 1
        for model in (ours, ddp.module):
            model.zero_grad(set_to_none=True)
    handle.remove()
    # Only the checkpointed blocks synchronised: each nested backward synchronises on its own.
    ours.zero_grad(set_to_none=True)
    ours.use_reentrant = True
    handle = sync_gradients(list(ours.blocks.parameters()), bucket_cap_mb=25.0)
    ours(_batch(rank, 0)).sum().backward()
    ddp(_batch(rank, 0)).sum().backward()
    handle.remove()
    inside = max(
        (mine.grad - theirs.grad).abs().max().item()  # type: ignore[operator]  # both set
        for mine, theirs in zip(
            ours.blocks.parameters(), ddp.module.blocks.parameters(), strict=True
        )
    )
    return {**report, "refused": refused, "inside_max_diff": inside}


def _offload_and_sync(
    model: nn.Module, *, offload_first: bool
) -> tuple[ParameterOffloadHandle, GradientSyncHandle]:
    """Stream ``model``'s parameters (host-clone device) and synchronise them, in either order."""
    if offload_first:
        offloaded = offload_parameters(model, transfer=HostCloneTransfer())
        return offloaded, sync_gradients(model, bucket_cap_mb=0.002)
    synced = sync_gradients(model, bucket_cap_mb=0.002)
    return offload_parameters(model, transfer=HostCloneTransfer()), synced


def _scenario_offloaded(rank: int) -> dict[str, Any]:
    """offload_parameters + sync_gradients, both orders, against DDP on a resident model."""
    report = {"max_diff": 0.0, "none_mismatch": 0, "max_grad": 0.0, "compared": 0}
    for offload_first in (True, False):
        torch.manual_seed(0)
        ours = Net().double()
        ddp = DistributedDataParallel(
            copy.deepcopy(ours), find_unused_parameters=True, bucket_cap_mb=0.002
        )
        offloaded, synced = _offload_and_sync(ours, offload_first=offload_first)
        for step in range(3):
            if step == 1:  # a local step first: the next one averages the accumulated sum
                with synced.no_sync(), ddp.no_sync():
                    ours(_batch(rank, 10)).pow(2).mean().backward()
                    ddp(_batch(rank, 10)).pow(2).mean().backward()
            options = {"branch": step == 2, "left_first": step != 1}
            ours(_batch(rank, step), **options).pow(2).mean().backward()
            ddp(_batch(rank, step), **options).pow(2).mean().backward()
            diff, mismatched, largest = _max_grad_difference(ours, ddp.module)
            report["max_diff"] = max(report["max_diff"], diff)
            report["none_mismatch"] += mismatched
            report["max_grad"] = max(report["max_grad"], largest)
            report["compared"] += 1
            if step != 0:  # step 0's grads stay: the next steps accumulate onto host .grad
                for model in (ours, ddp.module):
                    model.zero_grad(set_to_none=True)
        synced.remove()
        offloaded.remove()
    return report


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "user_hooks": _scenario_user_hooks,
    "doubling_hook": _scenario_doubling_hook,
    "reentrant": _scenario_reentrant,
    "offloaded": _scenario_offloaded,
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """This module's scenarios, run once by two gloo ranks on localhost."""
    return run_ranks("tests.distributed.test_distributed_hooks", tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow
class TestUserHooksTwoRanks:
    """Two gloo ranks against DistributedDataParallel with the same hooks."""

    def test_averages_what_hooks_produce_as_ddp_does(self, two_ranks: list[dict[str, Any]]) -> None:
        """Tensor hooks before and after, in-place post-accumulate hooks: DDP's grads to 1e-9."""
        for report in two_ranks:
            hooks = report["user_hooks"]
            assert hooks["compared"] == 3
            assert hooks["none_mismatch"] == 0
            assert hooks["max_grad"] > 0
            assert hooks["max_diff"] <= TOLERANCE

    def test_hook_on_a_single_parameter_bucket(self, two_ranks: list[dict[str, Any]]) -> None:
        """The reproducer: ``g * 2`` registered after, inputs 1 and 2: 3.0 on both ranks."""
        for report in two_ranks:
            assert report["doubling_hook"] == {"ours": 3.0, "ddp": 3.0}

    def test_reentrant_checkpoint_refused_with_advice(
        self, two_ranks: list[dict[str, Any]]
    ) -> None:
        """Reentrant checkpoint is refused naming use_reentrant=False; that then equals DDP's."""
        for report in two_ranks:
            reentrant = report["reentrant"]
            assert "use_reentrant=True) does this" in reentrant["refused"]
            assert "Pass use_reentrant=False" in reentrant["refused"]
            assert "static_graph=True" in reentrant["refused"]
            assert reentrant["compared"] == 2
            assert reentrant["none_mismatch"] == 0
            assert reentrant["max_grad"] > 0
            assert reentrant["max_diff"] <= TOLERANCE
            assert reentrant["inside_max_diff"] <= TOLERANCE

    def test_offloaded_parameters_averaged_as_ddp(self, two_ranks: list[dict[str, Any]]) -> None:
        """offload_parameters + sync_gradients (both orders): DDP's grads, in host .grad."""
        for report in two_ranks:
            offloaded = report["offloaded"]
            assert offloaded["compared"] == 6
            assert offloaded["none_mismatch"] == 0
            assert offloaded["max_grad"] > 0
            assert offloaded["max_diff"] <= TOLERANCE


# --- argument errors, checked before the process group ------------------------------------------


class TestArgumentsBeforeProcessGroup:
    """Wrong arguments are named even when no process group exists (none is set up yet here)."""

    @pytest.mark.parametrize("cap", [float("nan"), float("inf"), float("-inf")])
    def test_bucket_cap_mb_not_finite(self, cap: float) -> None:
        """NaN and infinities are refused by name, not by int()'s own error."""
        with pytest.raises(
            SyncArgumentValueError,
            match=rf"bucket_cap_mb must be a finite number of MiB, got {cap!r}; the default",
        ):
            sync_gradients(nn.Linear(1, 1), bucket_cap_mb=cap)

    @pytest.mark.parametrize("wrong", ["model", b"model"])
    def test_module_name_instead_of_module(self, wrong: str | bytes) -> None:
        """A string is not iterated character by character: the message says what to pass."""
        with pytest.raises(
            SyncArgumentTypeError,
            match=r"got the (str|bytes) b?'model'; pass the module object itself",
        ) as caught:
            sync_gradients(wrong)  # type: ignore[arg-type]  # the mistake under test
        assert isinstance(caught.value, TypeError)

    def test_wrong_first_argument_without_process_group(self) -> None:
        """A missing process group does not mask a wrong first argument."""
        assert not dist.is_initialized()
        with pytest.raises(SyncArgumentTypeError, match="got 42 of type int"):
            sync_gradients(42)  # type: ignore[arg-type]  # the mistake under test
        frozen = nn.Linear(1, 1).requires_grad_(False)
        with pytest.raises(SyncArgumentValueError, match="no tensor requires grad"):
            sync_gradients(frozen)
        with pytest.raises(SyncArgumentValueError, match="has no default process group"):
            sync_gradients(nn.Linear(1, 1))


# --- one process: the hooks' results are kept -----------------------------------------------------


def _plain_grads(register: Callable[[Net], None], **options: bool) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    model = Net().double()
    register(model)
    model(_batch(0, 0), **options).pow(2).mean().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.usefixtures("world_of_one")
class TestUserHooksOneRank:
    """In a world of one, averaging must leave exactly what the hooks made of ``.grad``."""

    @pytest.mark.parametrize("bucket_cap_mb", [0.002, 25.0])
    def test_every_hook_result_is_kept(self, bucket_cap_mb: float) -> None:
        """Hooks before and after sync_gradients, in-place post-accumulate hooks: all kept."""
        expected = _plain_grads(lambda model: (_hook_before(model), _hook_after(model)))
        torch.manual_seed(0)
        model = Net().double()
        _hook_before(model)
        handle = sync_gradients(model, bucket_cap_mb=bucket_cap_mb)
        _hook_after(model)
        model(_batch(0, 0)).pow(2).mean().backward()
        handle.remove()
        for param, want in zip(model.parameters(), expected, strict=True):
            if want is None:
                assert param.grad is None
            else:
                torch.testing.assert_close(param.grad, want, rtol=0, atol=0)

    def test_post_accumulate_hook_that_replaces_grad(self) -> None:
        """A post-accumulate hook assigning a new ``.grad`` is averaged, not the accumulated one."""
        model = nn.Linear(1, 1, bias=False)

        def replace(param: torch.Tensor) -> None:
            param.grad = torch.full_like(param, 7.0)

        handle = sync_gradients(model)
        model.weight.register_post_accumulate_grad_hook(replace)
        model(torch.ones(1, 1)).sum().backward()
        handle.remove()
        assert model.weight.grad is not None
        assert model.weight.grad.item() == 7.0


@pytest.mark.usefixtures("world_of_one")
class TestRemoveDuringBackward:
    """handle.remove() called while a backward call synchronises."""

    def test_names_the_call_and_when_to_call_it(self) -> None:
        """The message says remove() came too early, not concurrency or checkpointing."""
        torch.manual_seed(0)
        model = Net().double()
        handle = sync_gradients(model, bucket_cap_mb=0.002)
        h = torch.tanh(model.inp(_batch(0, 0)))
        # Runs after the buckets of out, left and right have been launched.
        h.register_hook(lambda grad: handle.remove())
        y = model.out(torch.tanh(model.left(h)) + torch.tanh(model.right(h)))
        with pytest.raises(
            GradientSyncError,
            match=r"handle\.remove\(\) was called while backward call \(graph task \d+\) is "
            r"synchronising these parameters; call remove\(\) after backward has returned",
        ):
            y.sum().backward()
        handle.remove()  # after the failed backward: waits for what it launched, then removes
        model(_batch(0, 1)).sum().backward()
        assert model.out.bias.grad is not None


@pytest.mark.usefixtures("world_of_one")
class TestReentrantCheckpoint:
    """torch.utils.checkpoint(use_reentrant=True) runs a nested backward per block."""

    def test_refused_at_the_first_backward(self) -> None:
        """The first synchronised backward raises, naming use_reentrant=False; then it works."""
        torch.manual_seed(0)
        model = CheckpointedNet().double()
        expected = copy.deepcopy(model)
        expected.use_reentrant = False
        expected(_batch(0, 0)).sum().backward()
        handle = sync_gradients(model, bucket_cap_mb=25.0)  # one bucket for every parameter
        with pytest.raises(
            GradientSyncError,
            match=r"reached these parameters while another backward call that reached them "
            r"\(graph task \d+\) is still running\. torch\.utils\.checkpoint\(\.\.\., "
            r"use_reentrant=True\) does this.*Pass use_reentrant=False",
        ):
            model(_batch(0, 0)).sum().backward()
        model.zero_grad(set_to_none=True)
        model.use_reentrant = False
        model(_batch(0, 0)).sum().backward()
        handle.remove()
        for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


@pytest.mark.usefixtures("world_of_one")
class TestOffloadedParametersOneRank:
    """sync_gradients on parameters that offload_parameters streams: .grad lands at the end."""

    @pytest.mark.parametrize("offload_first", [True, False])
    def test_grads_are_those_of_a_plain_model(self, offload_first: bool) -> None:
        """Either order: accumulation, no_sync and unused parameters give the plain grads."""
        torch.manual_seed(0)
        ours = Net().double()
        plain = copy.deepcopy(ours)
        offloaded, synced = _offload_and_sync(ours, offload_first=offload_first)
        assert len(synced.buckets) > 1
        with synced.no_sync():
            ours(_batch(0, 10)).pow(2).mean().backward()
        plain(_batch(0, 10)).pow(2).mean().backward()
        for step in range(2):
            ours(_batch(0, step), branch=step == 1).pow(2).mean().backward()
            plain(_batch(0, step), branch=step == 1).pow(2).mean().backward()
            for (name, mine), theirs in zip(
                ours.named_parameters(), plain.parameters(), strict=True
            ):
                if theirs.grad is None:
                    assert mine.grad is None, name
                    continue
                assert mine.grad is not None, name
                assert mine.grad.abs().max() > 0, name
                torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0, msg=name)
        synced.remove()
        offloaded.remove()


if __name__ == "__main__":
    run_worker(SCENARIOS, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
