"""offload_parameters when the model changes under it: the resident model is the reference.

Every change a user makes to a streamed model (between steps, inside a block's forward, in a
post-accumulate-grad hook) either gives exactly the resident model's parameters and gradients
(float64, on the host stand-in device) or is refused with a `ParameterOffloadStateError` /
`ParameterOffloadValueError` that says what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks as th
from tensorhooks._parameter_offload.slots import Slot
from tests.params_device import HostCloneTransfer

F64 = torch.float64


def model(seed: int = 0, dtype: torch.dtype = F64, blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = (nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh()) for _ in range(blocks))
    return nn.Sequential(*layers).to(dtype)


def batch(seed: int = 1, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def step(module: nn.Module, x: torch.Tensor) -> None:
    module(x).square().sum().backward()


def offloaded(
    build: Callable[[], nn.Module] = model, **kwargs: Any
) -> tuple[nn.Module, nn.Module, th.ParameterOffloadHandle]:
    """A model streamed through the host stand-in, and its resident twin."""
    ours, resident = build(), build()
    handle = th.offload_parameters(ours, transfer=HostCloneTransfer(), **kwargs)
    return ours, resident, handle


def assert_same(ours: nn.Module, resident: nn.Module) -> None:
    """Values, dtypes and gradients bit for bit; ours on the host."""
    for (name, a), b in zip(ours.named_parameters(), resident.parameters(), strict=True):
        assert a.device.type == "cpu", name
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0, msg=name)
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None and b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    for (name, a), b in zip(ours.named_buffers(), resident.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _assign(m: nn.Module) -> None:
    m[1][0].weight.data = torch.full((6, 6), 0.25, dtype=F64)


def _vector(m: nn.Module) -> None:
    count = sum(p.numel() for p in m.parameters())
    values = torch.linspace(-1, 1, count, dtype=F64)
    torch.nn.utils.vector_to_parameters(values, m.parameters())


def _in_place(m: nn.Module) -> None:
    with torch.no_grad():
        m[2][1].weight.mul_(3.0)
        m[0][0].bias.data.add_(1.0)  # through .data: no version bump, written on the host


def _load_state_dict(m: nn.Module) -> None:
    m.load_state_dict({k: torch.ones_like(v) * 0.5 for k, v in m.state_dict().items()})


def _new_shape_and_dtype(m: nn.Module) -> None:
    m[1][0].weight.data = torch.eye(6, dtype=torch.float32).to(F64).t().contiguous()
    m[1][0].bias.data = torch.zeros(6, dtype=F64)


CHANGES = {
    "param.data =": _assign,
    "vector_to_parameters": _vector,
    "in-place under no_grad": _in_place,
    "load_state_dict": _load_state_dict,
    "param.data = (transposed)": _new_shape_and_dtype,
}


class TestBetweenSteps:
    @pytest.mark.parametrize("change", list(CHANGES))
    def test_value_changes_are_the_new_values(self, change: str) -> None:
        """A value changed between steps is what the next step uses and what remove() keeps."""
        ours, resident, handle = offloaded()
        for m in (ours, resident):
            step(m, batch(1))
            CHANGES[change](m)
            m.zero_grad()
            step(m, batch(2))
        assert_same(ours, resident)
        handle.remove()
        assert_same(ours, resident)

    def test_remove_keeps_a_change_made_after_the_last_step(self) -> None:
        """remove() right after param.data = ... keeps the new value (not the old host copy)."""
        ours, resident, handle = offloaded()
        for m in (ours, resident):
            step(m, batch())
            _vector(m)
        handle.remove()
        assert_same(ours, resident)

    @pytest.mark.parametrize("convert", ["double", "to(float64)"])
    def test_dtype_change_after_wrapping(self, convert: str) -> None:
        """model.double() / model.to(float64) after wrapping: float64 steps as resident ones."""
        ours, resident, handle = offloaded(lambda: model(dtype=torch.float32))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, resident)]
        for m, opt in zip((ours, resident), opts, strict=True):
            step(m, batch(dtype=torch.float32))
            m.double() if convert == "double" else m.to(F64)
            for seed in range(2):
                opt.zero_grad()
                step(m, batch(seed))
                opt.step()
        assert all(p.dtype == F64 and p.grad is not None for p in ours.parameters())
        assert_same(ours, resident)
        handle.remove()
        assert_same(ours, resident)

    def test_buffers_converted_with_the_model(self) -> None:
        """model.double() replaces BatchNorm's buffer objects: the new ones are streamed."""

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)) for _ in "ab"))

        ours, resident, handle = offloaded(build)
        for m in (ours, resident):
            step(m, batch(dtype=torch.float32))
            m.double()
            step(m, batch(2))
            step(m, batch(3))
        assert ours[0][1].running_mean.dtype == F64
        assert_same(ours, resident)
        handle.remove()
        assert_same(ours, resident)

    def test_requires_grad_turned_off_and_on(self) -> None:
        """Freezing and unfreezing parameters between steps gives the resident gradients."""
        ours, resident = model(), model()
        for m in (ours, resident):
            m[0].requires_grad_(False)  # frozen when wrapped
        transfer = HostCloneTransfer()
        handle = th.offload_parameters(ours, transfer=transfer)
        for m in (ours, resident):
            step(m, batch(1))
            m.zero_grad()
            m[0].requires_grad_(True)
            m[2][0].weight.requires_grad_(False)
            step(m, batch(2))
        # Every gradient went through the transfer (on a GPU: to the host), unfrozen ones too.
        assert transfer.to_host_copies == 8 + 11  # 4 frozen in the first step, 1 in the second
        assert ours[0][0].weight.grad is not None
        assert ours[2][0].weight.grad is None
        assert_same(ours, resident)
        handle.remove()

    def test_parameter_object_replaced_is_refused(self) -> None:
        """load_state_dict(assign=True) puts new objects in: the next forward refuses it clearly."""
        ours, _, handle = offloaded()
        step(ours, batch())
        state = {k: v.clone() for k, v in ours.state_dict().items()}
        ours.load_state_dict(state, assign=True)
        with pytest.raises(
            th.ParameterOffloadStateError,
            match=r"0\.0\.weight is no longer the parameter offload_parameters streams.*"
            r"call handle\.remove\(\) before replacing parameters",
        ):
            ours(batch())
        assert th.live_graph_tasks() == 0
        handle.remove()
        step(ours, batch())  # plain autograd on the new objects

    def test_data_replaced_between_forward_and_backward_is_refused(self) -> None:
        """param.data = ... after forward: backward raises instead of using either value."""
        ours, _, handle = offloaded()
        loss = ours(batch()).sum()
        ours[1][1].weight.data = torch.ones(6, dtype=F64)
        with pytest.raises(
            th.ParameterOffloadStateError,
            match=r"backward needs 1\.1\.weight as it was in forward, but its data was replaced",
        ):
            loss.backward()
        assert all(p.grad is None for p in ours.parameters())
        step(ours, batch())  # the next step uses the new value
        torch.testing.assert_close(ours[1][1].weight.detach(), torch.ones(6, dtype=F64))
        handle.remove()


class Renormalised(nn.Module):
    """A linear layer that renormalises its rows under no_grad before each use."""

    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6, dtype=F64))
        self.assign = assign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norm = self.weight.norm(dim=1, keepdim=True)
            if self.assign:
                self.weight.data = self.weight.data / norm
            else:
                self.weight.div_(norm)
        return torch.tanh(x @ self.weight.t())


class TestWritesInsideAForward:
    def test_embedding_max_norm(self) -> None:
        """nn.Embedding(max_norm=...) renormalises rows in forward: the host weight gets them."""

        def build() -> nn.Module:
            torch.manual_seed(0)
            embed = nn.Embedding(10, 6, max_norm=0.5)
            embed.weight.data.mul_(4.0)
            return nn.Sequential(embed, nn.Sequential(nn.Linear(6, 6), nn.Tanh())).double()

        ours, resident, handle = offloaded(build)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, resident)]
        tokens = torch.tensor([[1, 2, 3], [3, 4, 9]])
        for m, opt in zip((ours, resident), opts, strict=True):
            for _ in range(2):
                opt.zero_grad()
                step(m, tokens)
                opt.step()
        assert ours[0].weight[1].norm() <= 0.5 + 1e-12
        assert_same(ours, resident)
        handle.remove()

    @pytest.mark.parametrize("assign", [False, True], ids=["div_", "data ="])
    def test_module_renormalising_its_weight(self, assign: bool) -> None:
        """A module writing its weight under no_grad (in place or by .data =) keeps the write."""

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(Renormalised(assign), Renormalised(assign))

        ours, resident, handle = offloaded(build)
        for m in (ours, resident):
            for seed in range(2):
                step(m, batch(seed))
        assert_same(ours, resident)
        handle.remove()
        assert_same(ours, resident)

    def test_buffer_assigned_by_the_module(self) -> None:
        """A module replacing its buffer in forward (self.count = self.count + 1) is followed."""

        class Counting(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(6, 6, dtype=F64)
                self.register_buffer("count", torch.zeros((), dtype=F64))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                self.count = self.count + 1
                return self.linear(x) * self.count

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(Counting(), Counting())

        ours, resident, handle = offloaded(build)
        for m in (ours, resident):
            for seed in range(3):
                step(m, batch(seed))
        assert float(ours[0].count) == 3.0
        assert_same(ours, resident)
        handle.remove()


class TestOptimizerInBackward:
    @pytest.mark.parametrize("order", ["registered before wrapping", "registered after wrapping"])
    def test_steps_as_resident(self, order: str) -> None:
        """The optimizer-in-backward recipe updates the host parameters as resident, any order."""
        ours, resident = model(), model()
        seen: list[tuple[str, str | None]] = []

        def install(m: nn.Module, record: bool) -> None:
            optimizers = {p: torch.optim.AdamW([p], lr=0.1) for p in m.parameters()}

            def hook(param: torch.Tensor) -> None:
                if record:
                    grad = param.grad
                    seen.append((param.device.type, None if grad is None else grad.device.type))
                optimizers[param].step()
                optimizers[param].zero_grad()

            for param in m.parameters():
                param.register_post_accumulate_grad_hook(hook)

        if order == "registered before wrapping":
            install(ours, record=True)
        handle = th.offload_parameters(ours, transfer=HostCloneTransfer())
        if order == "registered after wrapping":
            install(ours, record=True)
        install(resident, record=False)
        for m in (ours, resident):
            for seed in range(3):
                step(m, batch(seed))
        assert seen
        assert set(seen) == {("cpu", "cpu")}
        assert all(p.grad is None for p in ours.parameters())
        assert_same(ours, resident)
        handle.remove()

    def test_a_hook_that_keeps_the_gradient(self) -> None:
        """A post-accumulate hook that scales .grad in place: the host .grad holds the result."""
        ours, resident, handle = offloaded()

        def halve(param: torch.Tensor) -> None:
            assert param.grad is not None
            param.grad.mul_(0.5)

        for m in (ours, resident):
            for param in m.parameters():
                param.register_post_accumulate_grad_hook(halve)
            step(m, batch(1))
            step(m, batch(2))  # accumulates into what the first left
        assert_same(ours, resident)
        handle.remove()


class TestRemove:
    def test_sparse_gradient(self) -> None:
        """remove() with a sparse .grad puts every parameter back and keeps the gradient."""

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(
                nn.Embedding(10, 6, sparse=True), nn.Sequential(nn.Linear(6, 6), nn.Tanh())
            ).double()

        ours, resident, handle = offloaded(build)
        tokens = torch.tensor([[1, 2], [2, 7]])
        for m in (ours, resident):
            step(m, tokens)
            step(m, tokens)
        grad = ours[0].weight.grad
        assert grad is not None
        assert grad.is_sparse
        handle.remove()
        handle.remove()
        for a, b in zip(ours.parameters(), resident.parameters(), strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
            assert a.grad is not None
            assert b.grad is not None
            torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(), rtol=0, atol=0)

    def test_one_failure_does_not_stop_the_others(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A tensor that cannot be put back: the others are, the error is raised, retry works."""
        ours, resident = model(), model()
        transfer = HostCloneTransfer()
        handle = th.offload_parameters(ours, transfer=transfer)
        failing = ours[0][1].weight
        restore = Slot.restore
        attempts: list[Slot] = []

        def flaky(slot: Slot, transfer: Any) -> None:
            attempts.append(slot)
            if slot.tensor is failing and len([s for s in attempts if s.tensor is failing]) == 1:
                raise MemoryError("no room")
            restore(slot, transfer)

        monkeypatch.setattr(Slot, "restore", flaky)
        with pytest.raises(MemoryError, match="no room"):
            handle.remove()
        assert len(attempts) == len(list(ours.parameters())) + len(list(ours.buffers()))
        transfer.loads.clear()
        for m in (ours, resident):
            step(m, batch())
        assert transfer.loads == []  # unhooked: plain autograd, the failed one on the host
        assert_same(ours, resident)
        handle.remove()  # retries the one that failed
        assert [s.tensor for s in attempts[-1:]] == [failing]
        handle.remove()  # then nothing is left to do
        assert attempts[-1].tensor is failing
        assert_same(ours, resident)

    def test_applied_twice_is_refused(self) -> None:
        """A second offload_parameters over streamed tensors is refused until remove()."""
        ours, resident, handle = offloaded()
        with pytest.raises(
            th.ParameterOffloadValueError,
            match=r"0\.0\.weight is already streamed by another offload_parameters handle; "
            r"call that handle's remove\(\) first",
        ):
            th.offload_parameters(ours, transfer=HostCloneTransfer())
        with pytest.raises(th.ParameterOffloadValueError, match="already streamed"):
            th.offload_parameters(ours[1], transfer=HostCloneTransfer())
        step(ours, batch())
        step(resident, batch())
        handle.remove()
        again = th.offload_parameters(ours, transfer=HostCloneTransfer())
        step(ours, batch(2))
        step(resident, batch(2))
        assert_same(ours, resident)
        again.remove()
