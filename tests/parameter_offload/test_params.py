"""Tests of offload_parameters: streaming logic on a stand-in device, errors, CUDA when present.

The key streaming tests take the ``transfer`` fixture and run twice: on the host stand-in, and
(marked ``cuda``, skipped without a device) on a CUDA device through the real `CudaTransfer`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks as th
from tests.params_device import HostCloneTransfer, TrackingCudaTransfer, TrackingTransfer

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODIFIED = "modified by an inplace operation"


@pytest.fixture(
    params=["host-clone", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]
)
def transfer(request: pytest.FixtureRequest) -> TrackingTransfer:
    """A fresh tracked transfer: the host stand-in, or CUDA's own copies when a device is here."""
    if request.param == "cuda":
        return TrackingCudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    return HostCloneTransfer()


def tolerance(transfer: TrackingTransfer) -> dict[str, float]:
    """Bit for bit on the host; on CUDA the host optimizer rounds unlike the resident one's."""
    if transfer.device.type == "cpu":
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 1e-4, "atol": 1e-5}


def block(width: int = 8) -> nn.Module:
    # LayerNorm saves its weight itself (not a view) for backward: the hardest case.
    return nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh())


def stack(blocks: int = 4, width: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(block(width) for _ in range(blocks)))


def batch(rows: int = 3, width: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


class Watcher:
    """Which blocks have "device" copies alive, checked at every copy, wait and block boundary."""

    def __init__(self, transfer: TrackingTransfer, handle: th.ParameterOffloadHandle) -> None:
        self.transfer = transfer
        self.block_of: dict[int, int] = {}
        for index, module in enumerate(handle.blocks):
            for tensor in [*module.parameters(), *module.buffers()]:
                self.block_of[tensor.data_ptr()] = index
        self.peak = 0
        transfer.on_event = self.probe
        for module in handle.blocks:
            module.register_forward_pre_hook(lambda *_: self.probe())
            module.register_forward_hook(self._watch_output)

    def blocks_alive(self) -> set[int]:
        return {self.block_of[p] for p in self.transfer.alive() if p in self.block_of}

    def probe(self) -> None:
        self.peak = max(self.peak, len(self.blocks_alive()))

    def _watch_output(self, _module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        self.probe()
        if output.requires_grad:
            output.register_hook(lambda _grad: self.probe())

    def load_order(self) -> list[int]:
        """The block of each copy to the device, consecutive repeats merged."""
        order: list[int] = []
        for pointer in self.transfer.loads:
            index = self.block_of[pointer]
            if not order or order[-1] != index:
                order.append(index)
        return order


def offload(
    model: nn.Module, transfer: TrackingTransfer | None = None, **kwargs: Any
) -> tuple[th.ParameterOffloadHandle, TrackingTransfer, Watcher]:
    if transfer is None:
        transfer = HostCloneTransfer()
    handle = th.offload_parameters(model, transfer=transfer, **kwargs)
    transfer.loads.clear()
    return handle, transfer, Watcher(transfer, handle)


def assert_same_grads(
    ours: nn.Module, resident: nn.Module, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Ours (host grads) equal the resident model's, wherever that one lives."""
    for (name, a), b in zip(ours.named_parameters(), resident.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None, name
        else:
            assert a.grad is not None, name
            expected = b.grad.to(a.grad.device)
            torch.testing.assert_close(a.grad, expected, rtol=rtol, atol=atol, msg=name)


def assert_same_values(
    ours: nn.Module, resident: nn.Module, rtol: float = 0.0, atol: float = 0.0
) -> None:
    for (name, a), b in zip(ours.state_dict().items(), resident.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b.to(a.device), rtol=rtol, atol=atol, msg=name)


def assert_all_on_host(handle: th.ParameterOffloadHandle, watcher: Watcher) -> None:
    watcher.transfer.settle()
    assert watcher.blocks_alive() == set()
    for module in handle.blocks:
        for tensor in [*module.parameters(), *module.buffers()]:
            assert tensor.device.type == "cpu"
            assert tensor.data_ptr() in watcher.block_of


def await_failed_task(watcher: Watcher, timeout: float = 10.0) -> None:
    """On a device, wait (bounded) for the engine to drop a graph task that raised.

    On the host the engine drops it on the calling thread before backward returns; a device
    thread may drop it a moment later, and the task's blocks go with it (see NOTE [Releasing
    graph-task state]). The caller asserts afterwards, so a timeout still fails the test.
    """
    if watcher.transfer.device.type == "cpu":
        return
    deadline = time.monotonic() + timeout
    while (th.live_graph_tasks() or watcher.blocks_alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.transfer.settle()


class TestStreaming:
    @pytest.mark.parametrize("prefetch", [0, 1, 2])
    def test_adamw_training_matches_resident(
        self, prefetch: int, transfer: TrackingTransfer
    ) -> None:
        """Several AdamW steps give the resident model's grads and values (bit for bit on host)."""
        ours, resident = stack(), stack().to(transfer.device)
        handle, _, watcher = offload(ours, transfer, prefetch=prefetch)
        close = tolerance(transfer)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=0.1)
        opt_resident = torch.optim.AdamW(resident.parameters(), lr=0.1)
        for step in range(4):
            x = batch(seed=step).to(transfer.device)
            for model, opt in ((ours, opt_ours), (resident, opt_resident)):
                opt.zero_grad()
                model(x).square().sum().backward()
            assert_same_grads(ours, resident, **close)
            opt_ours.step()
            opt_resident.step()
            assert_same_values(ours, resident, **close)
        assert all(p.device.type == "cpu" for p in ours.parameters())
        assert_all_on_host(handle, watcher)
        handle.remove()

    @pytest.mark.parametrize("prefetch", [0, 1, 2])
    def test_at_most_one_plus_prefetch_blocks_on_the_device(
        self, prefetch: int, transfer: TrackingTransfer
    ) -> None:
        """At every copy, wait and block boundary, forward and backward: <= 1 + prefetch blocks."""
        ours = stack(blocks=6)
        handle, _, watcher = offload(ours, transfer, prefetch=prefetch)
        out = ours(batch().to(transfer.device))
        forward_peak = watcher.peak
        assert watcher.blocks_alive() == set()  # the graph keeps no device copy
        out.sum().backward()
        assert forward_peak == 1 + prefetch
        assert watcher.peak == 1 + prefetch
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_parameters_stay_the_same_objects_on_the_host(self) -> None:
        """Parameters keep their identity; between uses they and their grads are host tensors."""
        ours = stack()
        params = list(ours.parameters())
        opt = torch.optim.SGD(params, lr=0.5)  # built before offloading: keeps working
        handle, _, watcher = offload(ours)
        assert list(ours.parameters()) == params
        ours(batch()).sum().backward()
        assert all(p.grad is not None and p.grad.device.type == "cpu" for p in params)
        before = [p.detach().clone() for p in params]
        opt.step()
        assert all(not torch.equal(a, b) for a, b in zip(params, before, strict=True))
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_backward_loads_blocks_in_reverse_order(self, transfer: TrackingTransfer) -> None:
        """Forward loads blocks 0..n-1; backward loads them back n-1..0, each once."""
        ours = stack(blocks=5)
        handle, _, watcher = offload(ours, transfer, prefetch=1)
        out = ours(batch().to(transfer.device))
        assert watcher.load_order() == [0, 1, 2, 3, 4]
        transfer.loads.clear()
        out.sum().backward()
        assert watcher.load_order() == [4, 3, 2, 1, 0]
        assert len(transfer.loads) == len(list(ours.parameters())) + len(list(ours.buffers()))
        handle.remove()

    def test_parameter_changed_before_backward_raises(self) -> None:
        """A parameter changed in place between forward and backward raises autograd's error."""
        ours = stack()
        handle, _, watcher = offload(ours)
        out = ours(batch())
        with torch.no_grad():
            ours[3][1].weight.add_(1.0)
        with pytest.raises(th.SavedTensorModifiedError, match=MODIFIED):
            out.sum().backward()
        assert_all_on_host(handle, watcher)
        assert all(p.grad is None for p in ours.parameters())
        handle.remove()

    def test_saved_weight_read_outside_backward(self) -> None:
        """Reading a saved weight from the graph outside backward gives a transient copy."""
        ours = stack()
        handle, _, watcher = offload(ours)
        out = ours(batch())
        node = out.grad_fn
        while "LayerNorm" not in type(node).__name__:
            node = node.next_functions[0][0]
        weight = node._saved_weight
        torch.testing.assert_close(weight, ours[3][1].weight.detach(), rtol=0, atol=0)
        assert watcher.blocks_alive() == {3}
        del weight
        assert watcher.blocks_alive() == set()
        out.sum().backward()
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_forward_without_grad_releases_every_block(self) -> None:
        """Under no_grad (evaluation) each block still visits the device only while it runs."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        with torch.no_grad():
            torch.testing.assert_close(ours(batch()), resident(batch()), rtol=0, atol=0)
        assert watcher.peak == 2
        assert_all_on_host(handle, watcher)
        handle.remove()


class TestBackwardVariants:
    def test_autograd_grad_returns_the_gradients(self) -> None:
        """autograd.grad(loss, params) returns the resident grads and leaves .grad alone."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        x = batch()
        got = torch.autograd.grad(ours(x).sum(), list(ours.parameters()))
        expected = torch.autograd.grad(resident(x).sum(), list(resident.parameters()))
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert all(p.grad is None for p in ours.parameters())
        assert watcher.peak <= 2
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_autograd_grad_of_an_input(self) -> None:
        """autograd.grad w.r.t. the input needs the weights but accumulates nothing."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        x, y = batch().requires_grad_(), batch().requires_grad_()
        (got,) = torch.autograd.grad(ours(x).sum(), [x])
        (expected,) = torch.autograd.grad(resident(y).sum(), [y])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert all(p.grad is None for p in ours.parameters())
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_backward_inputs_fills_only_those(self) -> None:
        """backward(inputs=...) fills the grads of those parameters only, as resident."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        x = batch()
        ours(x).sum().backward(inputs=[ours[1][0].weight, ours[3][1].bias])
        resident(x).sum().backward(inputs=[resident[1][0].weight, resident[3][1].bias])
        assert_same_grads(ours, resident)
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_gradient_accumulation_adds_on_the_host(self) -> None:
        """Micro-batches accumulate into the host .grad, as resident."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        for seed in range(3):
            ours(batch(seed=seed)).sum().backward()
            resident(batch(seed=seed)).sum().backward()
        assert_same_grads(ours, resident)
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_retain_graph_backward_twice(self) -> None:
        """A retained graph brings the blocks back for the second backward."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        out, expected = ours(batch()).sum(), resident(batch()).sum()
        for _ in range(2):
            out.backward(retain_graph=True)
            expected.backward(retain_graph=True)
        assert_same_grads(ours, resident)
        assert watcher.peak <= 2
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_failed_backward_leaves_nothing_behind(self, transfer: TrackingTransfer) -> None:
        """A backward that raises leaves every block on the host, no state, .grad unchanged."""

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
                return t.clone()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                raise ValueError("boom")

        ours = stack()
        handle, _, watcher = offload(ours, transfer)
        ours(batch().to(transfer.device)).sum().backward()
        before = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
        hidden = ours[:2](batch().to(transfer.device))
        out = ours[2:](Boom.apply(hidden))
        with pytest.raises(ValueError, match="boom"):
            out.sum().backward()
        await_failed_task(watcher)
        assert th.live_graph_tasks() == 0
        assert_all_on_host(handle, watcher)
        after = [p.grad for p in ours.parameters()]
        for a, b in zip(after, before, strict=True):
            assert a is not None
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        handle.remove()

    @pytest.mark.parametrize("where", ["inside a block", "after a block"])
    def test_failed_forward_releases_prefetched_copies(self, where: str) -> None:
        """A forward raising inside or after block 1 leaves no device copy alive."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours, prefetch=2)

        def fail(*_: Any) -> None:
            raise KeyError(where)

        if where == "inside a block":
            hook = ours[1][2].register_forward_pre_hook(fail)  # the Tanh of block 1
        else:
            hook = ours[1].register_forward_hook(fail)  # runs after offload's own hook
        with pytest.raises(KeyError, match=where):
            ours(batch())
        hook.remove()
        assert watcher.blocks_alive() == set()  # blocks 2 and 3 were staged
        assert_all_on_host(handle, watcher)
        ours(batch()).sum().backward()
        resident(batch()).sum().backward()
        assert_same_grads(ours, resident)
        handle.remove()

    def test_block_that_does_not_run_keeps_no_staged_copy(self) -> None:
        """A block staged by the one before it but not run (a branch) has no copy after forward."""

        class Branches(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.first, self.second, self.branch = block(), block(), block()

            def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
                x = self.second(self.first(x))
                return self.branch(x) if branch else x  # type: ignore[no-any-return]

        ours = Branches()
        handle, _, watcher = offload(ours)
        out = ours(batch())
        assert watcher.blocks_alive() == set()  # the branch was staged by the second block
        out.sum().backward()
        ours(batch(), branch=True).sum().backward()
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_backward_over_a_graph_built_before_remove_raises(self) -> None:
        """After remove(), backward through a graph built under the handle raises; nothing moves."""
        ours, resident = stack(), stack()
        handle, _, _ = offload(ours)
        loss = ours(batch()).sum()
        handle.remove()
        restored = [t.data_ptr() for t in [*ours.parameters(), *ours.buffers()]]
        with pytest.raises(
            th.ParameterOffloadStateError,
            match=r"this graph was built while the parameters were offloaded, and "
            r"handle\.remove\(\) was called since; run backward before remove\(\)",
        ):
            loss.backward()
        assert [t.data_ptr() for t in [*ours.parameters(), *ours.buffers()]] == restored
        assert all(p.grad is None for p in ours.parameters())
        assert th.live_graph_tasks() == 0
        ours(batch()).sum().backward()  # a graph built after remove() is plain autograd's
        resident(batch()).sum().backward()
        assert_same_grads(ours, resident)


class CheckpointedBlock(nn.Module):
    """A block whose forward runs under tensorhooks.checkpoint: backward recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.is_device_copy: Callable[[torch.Tensor], bool] | None = None
        self.seen: list[tuple[bool, bool, bool]] = []
        """(recomputing, weight is a device copy, norm weight is a device copy) at each run."""

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_device_copy is not None:
            on_device = self.is_device_copy
            self.seen.append(
                (th.is_recomputing(), on_device(self.linear.weight), on_device(self.norm.weight))
            )
        return torch.tanh(self.norm(self.linear(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return th.checkpoint(self.layers, x, use_reentrant=False)  # type: ignore[no-any-return]


class TestComposition:
    @pytest.mark.parametrize("prefetch", [0, 1])
    def test_checkpoint_inside_a_block_recomputes_with_device_copies(self, prefetch: int) -> None:
        """A checkpoint inside a block recomputes with the device copies; grads as resident."""

        def model() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(*(CheckpointedBlock() for _ in range(4)))

        ours, resident = model(), model()
        handle, transfer, watcher = offload(ours, prefetch=prefetch)
        for module in ours:
            module.is_device_copy = transfer.is_device_copy
        x = batch()
        out = ours(x).square().sum()
        transfer.loads.clear()
        out.backward()
        resident(x).square().sum().backward()
        seen = [entry for module in ours for entry in module.seen]
        assert [recomputing for recomputing, _, _ in seen] == [False, True] * 4
        assert all(linear and norm for _, linear, norm in seen), seen
        assert_same_grads(ours, resident)
        assert watcher.load_order() == [3, 2, 1, 0]  # each block brought back once
        assert watcher.peak <= 1 + prefetch
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_module_shared_by_two_blocks(self) -> None:
        """A submodule inside two blocks that do not contain one another is shared, as tied."""

        def model() -> nn.Sequential:
            torch.manual_seed(0)
            shared = nn.LayerNorm(8)
            return nn.Sequential(
                nn.Sequential(nn.Linear(8, 8), shared),
                nn.Tanh(),
                nn.Sequential(nn.Linear(8, 8), shared),
            )

        ours, resident = model(), model()
        handle, _, watcher = offload(ours, blocks=[ours[0], ours[2]])
        for _ in range(2):
            ours(batch()).square().sum().backward()
            resident(batch()).square().sum().backward()
        assert_same_grads(ours, resident)
        assert_all_on_host(handle, watcher)
        handle.remove()


class TestModels:
    def test_tied_weights_between_blocks(self) -> None:
        """A weight shared by two blocks (embedding and head) streams once and gets one grad."""

        def tied() -> nn.Sequential:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(10, 8), block(), block(), nn.Linear(8, 10))
            model[3].weight = model[0].weight
            return model

        ours, resident = tied(), tied()
        handle, _, watcher = offload(ours)
        tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=0.1)
        opt_resident = torch.optim.AdamW(resident.parameters(), lr=0.1)
        for _ in range(2):
            ours(tokens).logsumexp(-1).sum().backward()
            resident(tokens).logsumexp(-1).sum().backward()
            assert_same_grads(ours, resident)
            opt_ours.step()
            opt_resident.step()
        assert_same_values(ours, resident)
        assert ours[3].weight is ours[0].weight
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_frozen_parameters(self) -> None:
        """Frozen blocks and parameters stream too and get no grad."""
        ours, resident = stack(), stack()
        for model in (ours, resident):
            model[0].requires_grad_(False)
            model[2][1].weight.requires_grad_(False)
        handle, _, watcher = offload(ours)
        ours(batch()).sum().backward()
        resident(batch()).sum().backward()
        assert_same_grads(ours, resident)
        assert watcher.peak <= 2
        assert_all_on_host(handle, watcher)
        handle.remove()

    @pytest.mark.parametrize("train", [True, False])
    def test_buffers_move_with_their_block(self, train: bool) -> None:
        """BatchNorm's running statistics are updated in training and saved in evaluation."""

        def model() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in "ab"))

        ours, resident = model(), model()
        ours.train(train)
        resident.train(train)
        handle, _, watcher = offload(ours)
        for seed in range(2):
            ours(batch(seed=seed)).sum().backward()
            resident(batch(seed=seed)).sum().backward()
        assert_same_grads(ours, resident)
        assert_same_values(ours, resident)
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_autocast(self) -> None:
        """Under autocast the casts of weights are recomputed in backward, not kept."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        for model in (ours, resident):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(batch())
            out.float().sum().backward()
        assert_same_grads(ours, resident)
        assert watcher.peak <= 2
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_outer_saved_tensor_hooks_get_the_activations(self) -> None:
        """An enclosing pair (save_on_cpu) still packs activations, but never a parameter."""
        ours, resident = stack(), stack()
        handle, _, watcher = offload(ours)
        packed: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            packed.append(tensor)
            return tensor.clone()

        with th.saved_tensors_hooks(pack, lambda t: t):
            out = ours(batch())
        out.sum().backward()
        resident(batch()).sum().backward()
        assert_same_grads(ours, resident)
        params = {id(p) for p in ours.parameters()}
        assert packed
        assert all(id(t) not in params and id(t._base) not in params for t in packed)
        with th.save_on_cpu():
            ours(batch()).sum().backward()
        assert_all_on_host(handle, watcher)
        handle.remove()

    def test_default_blocks_split_module_lists(self) -> None:
        """Default blocks: the children, each item of a ModuleList child its own block."""

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Linear(8, 8)
                self.layers = nn.ModuleList(block() for _ in range(3))
                self.head = nn.Linear(8, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = self.embed(x)
                for layer in self.layers:
                    x = layer(x)
                return self.head(x)  # type: ignore[no-any-return]

        ours = Model()
        handle, _, _ = offload(ours)
        assert handle.blocks == (ours.embed, *ours.layers, ours.head)
        handle.remove()
        handle, _, _ = offload(ours.layers)
        assert handle.blocks == tuple(ours.layers)
        handle.remove()

    def test_remove_puts_everything_back(self) -> None:
        """remove() leaves plain resident parameters with their grads, and no hooks."""
        ours, resident = stack(), stack()
        params = list(ours.parameters())
        handle, transfer, _ = offload(ours)
        ours(batch()).sum().backward()
        handle.remove()
        handle.remove()
        transfer.loads.clear()
        ours(batch()).sum().backward()
        assert transfer.loads == []
        for _ in range(2):
            resident(batch()).sum().backward()
        assert list(ours.parameters()) == params
        assert_same_grads(ours, resident)
        assert_same_values(ours, resident)


class TestErrors:
    @pytest.mark.parametrize(
        ("blocks", "match"),
        [
            (lambda m: [nn.Linear(2, 2)], r"blocks\[0\] \(Linear\) is not a submodule"),
            (lambda m: [m[0], m[0]], r"blocks\[1\] is blocks\[0\] again"),
            (lambda m: [m[0], m[0][0]], r"blocks\[1\] \(Linear\) is inside blocks\[0\]"),
            (lambda m: [], "no blocks in Sequential"),
        ],
    )
    def test_bad_blocks(self, blocks: Callable[[nn.Module], list[nn.Module]], match: str) -> None:
        """Blocks that are not disjoint submodules raise ParameterOffloadValueError."""
        model = stack()
        with pytest.raises(th.ParameterOffloadValueError, match=match):
            th.offload_parameters(model, blocks=blocks(model), transfer=HostCloneTransfer())
        assert isinstance(th.ParameterOffloadValueError(), ValueError)

    @pytest.mark.parametrize("prefetch", [-1, 1.5, True])
    def test_bad_prefetch(self, prefetch: Any) -> None:
        """A prefetch that is not an int >= 0 is refused."""
        with pytest.raises(th.ParameterOffloadValueError, match="prefetch must be an int >= 0"):
            th.offload_parameters(stack(), prefetch=prefetch, transfer=HostCloneTransfer())

    def test_not_modules(self) -> None:
        """A module or block that is not an nn.Module raises a TypeError."""
        with pytest.raises(th.ParameterOffloadTypeError, match=r"module must be an nn\.Module"):
            th.offload_parameters(torch.ones(2), transfer=HostCloneTransfer())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"blocks\[0\] is 3 of type int"):
            th.offload_parameters(stack(), blocks=[3], transfer=HostCloneTransfer())  # type: ignore[list-item]


@pytest.mark.cuda
@requires_cuda
class TestCuda:
    def test_adamw_training_matches_resident(self) -> None:
        """On a CUDA device: grads and values match the resident model; memory is released."""
        ours, resident = stack(width=64), stack(width=64).cuda()
        handle = th.offload_parameters(ours, device="cuda")
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=0.01)
        opt_resident = torch.optim.AdamW(resident.parameters(), lr=0.01)
        for step in range(3):
            x = batch(width=64, seed=step).cuda()
            ours(x).square().sum().backward()
            resident(x).square().sum().backward()
            for a, b in zip(ours.parameters(), resident.parameters(), strict=True):
                assert a.device.type == "cpu"
                assert a.grad is not None
                assert b.grad is not None
                torch.testing.assert_close(a.grad, b.grad.cpu())
            opt_ours.step()
            opt_resident.step()
            opt_ours.zero_grad()
            opt_resident.zero_grad()
        handle.remove()
        assert th.live_graph_tasks() == 0

    def test_autocast_backward_and_grad_of_the_input(self) -> None:
        """Under bf16 autocast: backward() lands the resident grads; autograd.grad of the input."""
        ours, resident = stack(width=64), stack(width=64).cuda()
        handle = th.offload_parameters(ours, device="cuda")
        x = batch(width=64).cuda().requires_grad_()
        input_grads = []
        for model in (ours, resident):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(x).float().sum().backward()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                input_grads.append(torch.autograd.grad(model(x).float().sum(), x)[0])
        for a, b in zip(ours.parameters(), resident.parameters(), strict=True):
            assert a.grad is not None
            assert b.grad is not None
            torch.testing.assert_close(a.grad, b.grad.cpu())
        torch.testing.assert_close(*input_grads)
        handle.remove()

    def test_autograd_grad_of_streamed_parameters_raises(self) -> None:
        """autograd.grad over parameters streamed to a real device raises (a documented limit).

        Returning a parameter to the host resets autograd's weak link from it to the gradient
        accumulator the forward's graph uses (the device changed), so the engine cannot reach
        that accumulator from the parameter: see docs/offload_parameters.md.
        """
        model = stack(width=64)
        handle = th.offload_parameters(model, device="cuda")
        out = model(batch(width=64).cuda()).sum()
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(out, list(model.parameters()))
        handle.remove()


def test_copy_module_is_unaffected() -> None:
    """A deep copy taken before offloading keeps its own resident parameters."""
    model = stack()
    twin = copy.deepcopy(model)
    handle, _, _ = offload(model)
    twin(batch()).sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    handle.remove()
