from __future__ import annotations

import copy
import gc
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tensorhooks
from tensorhooks.distributed import sync_gradients
from tests.strategies import bucket_cap_bytes, distributed_params

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
TOLERANCE = 1e-9
MIB = 1024 * 1024


# --- a model with every situation the multi-process scenarios need ------------------------------


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises, to fail a backward part-way on every rank alike."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


class Net(nn.Module):
    """Two parallel paths (their order is chosen per call), a branch used on demand, a spare."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)
        self.branch = nn.Linear(16, 3)
        self.spare = nn.Parameter(torch.randn(4))  # never used

    def forward(
        self, x: torch.Tensor, *, left_first: bool = True, branch: bool = False, fail: bool = False
    ) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if fail:
            h = _FailOnce.apply(h)
        # The path created last runs first in backward, so the order sets which buckets
        # complete first.
        if left_first:
            left = torch.tanh(self.left(h))
            right = torch.tanh(self.right(h))
        else:
            right = torch.tanh(self.right(h))
            left = torch.tanh(self.left(h))
        y = self.out(left + right)
        if branch:
            y = y + self.branch(h)
        return y


def _max_grad_difference(ours: nn.Module, reference: nn.Module) -> tuple[float, int, float]:
    """Largest |difference| of .grad, count of None mismatches, and the largest |grad|."""
    diff, mismatched, largest = 0.0, 0, 0.0
    for mine, theirs in zip(ours.parameters(), reference.parameters(), strict=True):
        if (mine.grad is None) != (theirs.grad is None):
            mismatched += 1
        elif mine.grad is not None and theirs.grad is not None:
            diff = max(diff, (mine.grad - theirs.grad).abs().max().item())
            largest = max(largest, theirs.grad.abs().max().item())
    return diff, mismatched, largest


class _Pair:
    """The same model twice: one under sync_gradients, one under DDP(find_unused_parameters)."""

    def __init__(self, rank: int, bucket_cap_mb: float = 0.002) -> None:
        torch.manual_seed(0)
        self.ours = Net().double()
        self.ddp = DistributedDataParallel(
            copy.deepcopy(self.ours), find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb
        )
        # ~2 KiB buckets: several buckets, so launch order and overlap are exercised.
        self.handle = sync_gradients(self.ours, bucket_cap_mb=bucket_cap_mb)
        self.rank = rank
        self.opts = [
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for model in (self.ours, self.ddp.module)
        ]
        self.report = {"max_diff": 0.0, "none_mismatch": 0, "max_grad": 0.0, "compared": 0}

    def batch(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * step + self.rank)
        return torch.randn(8, 6, dtype=torch.float64, generator=generator)

    def backward(self, step: int, *, ours: bool = True, ddp: bool = True, **options: bool) -> None:
        x = self.batch(step)
        if ours:
            self.ours(x, **options).pow(2).mean().backward()
        if ddp:
            self.ddp(x, **options).pow(2).mean().backward()

    def compare(self) -> None:
        diff, mismatched, largest = _max_grad_difference(self.ours, self.ddp.module)
        self.report["max_diff"] = max(self.report["max_diff"], diff)
        self.report["none_mismatch"] += mismatched
        self.report["max_grad"] = max(self.report["max_grad"], largest)
        self.report["compared"] += 1

    def step(self) -> None:
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def _scenario_steps(rank: int) -> dict[str, Any]:
    pair = _Pair(rank)
    for step in range(4):
        pair.backward(step)
        pair.compare()
        pair.step()
    pair.handle.remove()
    return pair.report


def _scenario_accumulation(rank: int) -> dict[str, Any]:
    pair = _Pair(rank)
    step = 0
    # The branch is used under no_sync only: not at all, on rank 0, on both ranks. Its bucket
    # completes in the synchronised step (the output layer shares it) with the branch unused.
    for branch in (False, rank == 0, True):
        for _ in range(2):
            with pair.handle.no_sync(), pair.ddp.no_sync():
                pair.backward(step, branch=branch)
            step += 1
            pair.compare()  # local grads: neither side communicated
        pair.backward(step)
        step += 1
        pair.compare()
        pair.step()
    pair.handle.remove()
    return pair.report


def _scenario_unused(rank: int) -> dict[str, Any]:
    # ~100-byte buckets: the branch's and the spare's parameters get buckets of their own, which
    # complete on some ranks and on others never fire at all.
    pair = _Pair(rank, bucket_cap_mb=1e-4)
    # The branch: used on rank 0 only, on both, on none; then on none with its .grad kept.
    for step, branch in enumerate((rank == 0, True, False, rank == 1)):
        pair.backward(step, branch=branch)
        pair.compare()
        pair.step()
    pair.backward(10, branch=True)
    pair.opts[0].step()
    pair.opts[1].step()  # .grad kept: the next, unused step must leave the branch's untouched
    pair.backward(11, branch=False)
    pair.compare()
    pair.step()
    # The branch used under no_sync on rank 0 only: its buckets never complete in the
    # synchronised step, yet what rank 0 accumulated is averaged.
    with pair.handle.no_sync(), pair.ddp.no_sync():
        pair.backward(12, branch=rank == 0)
    pair.backward(13, branch=False)
    pair.compare()
    pair.step()
    pair.backward(14, branch=False)  # that use is forgotten: the branch's .grad stays None
    pair.compare()
    pair.handle.remove()
    return pair.report


def _scenario_reordered(rank: int) -> dict[str, Any]:
    pair = _Pair(rank)
    completed: list[list[int]] = []
    launched: list[list[int]] = []
    original_complete = pair.handle._on_bucket_complete
    original_all_reduce = dist.all_reduce

    def recording_complete(index: int, grads: Any) -> None:
        completed[-1].append(index)
        original_complete(index, grads)

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launched[-1].append(tensor.numel())
        return original_all_reduce(tensor, *args, **kwargs)

    pair.handle._on_bucket_complete = recording_complete  # type: ignore[method-assign]  # a spy
    dist.all_reduce = recording_all_reduce  # type: ignore[assignment]  # a spy, restored below
    try:
        for step in range(3):
            completed.append([])
            launched.append([])
            # Buckets complete in a different order on each rank; launches must still match.
            pair.backward(step, left_first=(rank + step) % 2 == 0)
            pair.compare()
            pair.step()
    finally:
        dist.all_reduce = original_all_reduce
    sizes = [bucket.flat.numel() for bucket in pair.handle._buckets]
    pair.handle.remove()
    return {**pair.report, "completed": completed, "launched": launched, "sizes": sizes}


def _scenario_failed(rank: int) -> dict[str, Any]:
    pair = _Pair(rank)
    pair.backward(0)
    pair.compare()
    pair.step()
    try:
        pair.backward(1, ddp=False, fail=True)
    except RuntimeError as error:
        failed = "backward failed on purpose" in str(error)
    else:
        failed = False
    live_after_failure = tensorhooks.live_graph_tasks()
    pair.opts[0].zero_grad(set_to_none=True)
    for step in (2, 3):
        pair.backward(step)
        pair.compare()
        pair.step()
    pair.handle.remove()
    return {**pair.report, "failed": failed, "live_after_failure": live_after_failure}


def _scenario_in_backward(rank: int) -> dict[str, Any]:
    pair = _Pair(rank)
    launches: list[list[Any]] = []
    original = dist.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launches.append(
            [
                torch._C._current_graph_task_id(),
                torch._C._current_autograd_node() is not None,
                tensor.numel(),
            ]
        )
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce  # type: ignore[assignment]  # a spy, restored below
    try:
        pair.backward(0, ddp=False)
    finally:
        dist.all_reduce = original
    pair.backward(0, ours=False)
    pair.compare()
    buckets = len(pair.handle.buckets)
    pair.handle.remove()
    return {**pair.report, "launches": launches, "buckets": buckets}


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "steps": _scenario_steps,
    "accumulation": _scenario_accumulation,
    "unused": _scenario_unused,
    "reordered": _scenario_reordered,
    "failed": _scenario_failed,
    "in_backward": _scenario_in_backward,
}


def run_worker(
    scenarios: dict[str, Callable[[int], dict[str, Any]]], rank: int, port: int, out_dir: str
) -> None:
    """One rank of `run_ranks`: join the gloo group, run ``scenarios``, write their results."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        results = {name: scenario(rank) for name, scenario in scenarios.items()}
    finally:
        # DDP and handles sit in reference cycles: free them (and the gloo work they hold)
        # while the interpreter is whole, or gloo's threads can abort the exit.
        gc.collect()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    # Skip interpreter shutdown: torch 2.13's gloo threads can abort it (see the example's end).
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(module: str, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``python -m module RANK PORT OUT_DIR`` as two gloo ranks; return each rank's results."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(rank), str(port), str(out_dir)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        outputs.append(output)
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every multi-process scenario, run once by two gloo ranks on localhost."""
    return run_ranks("tests.distributed.test_distributed", tmp_path_factory.mktemp("ranks"))


def _check_report(report: dict[str, Any], compared: int) -> None:
    assert report["compared"] == compared
    assert report["none_mismatch"] == 0
    assert report["max_grad"] > 0
    assert report["max_diff"] <= TOLERANCE


@pytest.mark.slow
class TestSyncGradientsTwoRanks:
    """Two gloo ranks on localhost against DistributedDataParallel(find_unused_parameters=True)."""

    def test_matches_ddp_over_several_steps(self, two_ranks: list[dict[str, Any]]) -> None:
        """Averaged float64 grads equal DDP's to 1e-9 over four optimizer steps."""
        for report in two_ranks:
            _check_report(report["steps"], compared=4)

    def test_matches_ddp_with_no_sync_accumulation(self, two_ranks: list[dict[str, Any]]) -> None:
        """no_sync grads and the averages after it, of parameters used only there too, match DDP."""
        for report in two_ranks:
            _check_report(report["accumulation"], compared=9)

    def test_matches_ddp_with_unused_parameters(self, two_ranks: list[dict[str, Any]]) -> None:
        """Parameters unused on some or all ranks end as DDP leaves them, None included."""
        for report in two_ranks:
            _check_report(report["unused"], compared=7)

    def test_matches_ddp_when_buckets_complete_in_different_orders(
        self, two_ranks: list[dict[str, Any]]
    ) -> None:
        """Buckets completing in a different order on each rank are still launched in order."""
        out_of_order = 0
        for report in two_ranks:
            reordered = report["reordered"]
            _check_report(reordered, compared=3)
            for completed, launched in zip(
                reordered["completed"], reordered["launched"], strict=True
            ):
                assert sorted(completed) == list(range(len(reordered["sizes"])))
                assert launched == reordered["sizes"]
                out_of_order += completed != sorted(completed)
        # The scenario does make buckets complete out of order, on one rank at a time.
        assert out_of_order == 3

    def test_failed_backward_leaves_nothing_pending(self, two_ranks: list[dict[str, Any]]) -> None:
        """A backward that raises after launching buckets is followed by correct steps."""
        for report in two_ranks:
            failed = report["failed"]
            assert failed["failed"]
            assert failed["live_after_failure"] == 0
            _check_report(failed, compared=3)

    def test_all_reduces_start_inside_backward(self, two_ranks: list[dict[str, Any]]) -> None:
        """Every bucket's all_reduce is launched from a hook while autograd runs a node."""
        for report in two_ranks:
            in_backward = report["in_backward"]
            _check_report(in_backward, compared=1)
            launches = in_backward["launches"]
            assert len(launches) == in_backward["buckets"] > 1
            assert all(task_id != -1 and in_node for task_id, in_node, _ in launches)
            assert len({task_id for task_id, _, _ in launches}) == 1
        # Both ranks launched buckets of the same sizes in the same order.
        sizes = [
            [numel for _, _, numel in report["in_backward"]["launches"]] for report in two_ranks
        ]
        assert sizes[0] == sizes[1]

    def test_example_trains_under_torchrun(self, tmp_path: Path) -> None:
        """examples/train_ddp_torchrun.py runs on two gloo ranks started by torchrun."""
        torchrun = Path(sys.executable).with_name("torchrun")
        launcher = (
            [str(torchrun)]
            if torchrun.exists()
            else [sys.executable, "-m", "torch.distributed.run"]
        )
        result = subprocess.run(
            [
                *launcher,
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(_free_port()),
                str(ROOT / "examples" / "train_ddp_torchrun.py"),
                "--steps",
                "3",
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "step 2: loss" in result.stdout, output
        assert "replicas identical after 3 steps" in result.stdout, output


# --- one process: a world of one gloo rank -------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A default gloo process group of one rank for the module's single-process tests."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()


class _AllReduceSpy:
    """Counts torch.distributed.all_reduce calls while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = dist.all_reduce

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._original(tensor, *args, **kwargs)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _AllReduceSpy:
    """Count the all-reduces launched during the test."""
    recorder = _AllReduceSpy()
    monkeypatch.setattr(dist, "all_reduce", recorder)
    return recorder


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _loss(model: Net, seed: int, **options: bool) -> torch.Tensor:
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return model(x, **options).pow(2).mean()


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same(left: list[torch.Tensor | None], right: list[torch.Tensor | None]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)


@pytest.mark.usefixtures("world_of_one")
class TestSyncGradients:
    """sync_gradients in one process: bucketing, results, argument errors."""

    def test_buckets_follow_reverse_registration_order(self) -> None:
        """Buckets hold parameters in reverse registration order, closed before the cap."""
        model = _net()
        handle = sync_gradients(model, bucket_cap_mb=0.002)
        names = {id(p): name for name, p in model.named_parameters()}
        assert [[names[id(p)] for p in bucket] for bucket in handle.buckets] == [
            # 24 + 384 + 24 + 384 + 128 bytes; right.weight's 2048 would pass 2097.
            ["branch.bias", "branch.weight", "out.bias", "out.weight", "right.bias"],
            ["right.weight"],
            ["left.bias"],
            ["left.weight"],
            ["inp.bias", "inp.weight", "spare"],  # own parameters come first in parameters()
        ]
        handle.remove()

    def test_first_bucket_is_closed_once_it_holds_one_mib(self) -> None:
        """The first bucket stops growing at 1 MiB, later ones at bucket_cap_mb."""
        params = [nn.Parameter(torch.zeros(MIB // 4 * 3 // 5)) for _ in range(6)]  # 0.6 MiB each
        handle = sync_gradients(params)
        assert handle.buckets == ((params[5], params[4]), tuple(params[3::-1]))
        handle.remove()

    def test_parameter_larger_than_cap_gets_its_own_bucket(self) -> None:
        """A parameter over the cap is not split and shares no bucket."""
        params = [nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(1000))]
        params.append(nn.Parameter(torch.zeros(10)))
        handle = sync_gradients(params, bucket_cap_mb=100 / MIB)
        assert [[p.numel() for p in bucket] for bucket in handle.buckets] == [[10], [1000], [10]]
        handle.remove()

    @given(params=distributed_params(), cap_bytes=bucket_cap_bytes())
    def test_bucket_assignment_properties(self, params: list[nn.Parameter], cap_bytes: int) -> None:
        """Buckets partition the trainable parameters by dtype, greedily, within their caps."""
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return
        handle = sync_gradients(params, bucket_cap_mb=cap_bytes / MIB)
        try:
            buckets = handle.buckets
        finally:
            handle.remove()
        index = {id(p): i for i, p in enumerate(params)}
        placed = [index[id(p)] for bucket in buckets for p in bucket]
        assert sorted(placed) == sorted(index[id(p)] for p in trainable)
        firsts = [index[id(bucket[0])] for bucket in buckets]
        assert firsts == sorted(firsts, reverse=True)
        seen: set[torch.dtype] = set()
        for bucket in buckets:
            positions = [index[id(p)] for p in bucket]
            assert positions == sorted(positions, reverse=True)
            assert len({p.dtype for p in bucket}) == 1
            dtype = bucket[0].dtype
            nbytes = sum(p.numel() * p.element_size() for p in bucket)
            assert nbytes <= cap_bytes or len(bucket) == 1
            later = [p for p in trainable if p.dtype == dtype and index[id(p)] < positions[-1]]
            if later:
                # Greedy: the next parameter of the same dtype did not fit, or the first bucket
                # of the dtype was full at 1 MiB.
                full = dtype not in seen and nbytes >= MIB
                assert full or nbytes + later[-1].numel() * later[-1].element_size() > cap_bytes
            seen.add(dtype)

    def test_frozen_and_repeated_parameters_are_skipped(self) -> None:
        """Tensors that do not require grad are left out; a tensor given twice is synced once."""
        frozen = torch.zeros(3)
        trained = nn.Parameter(torch.zeros(3))
        handle = sync_gradients([frozen, trained, trained])
        assert handle.buckets == ((trained,),)
        handle.remove()

    def test_world_of_one_leaves_grads_as_plain_backward(self, spy: _AllReduceSpy) -> None:
        """With one rank, grads equal plain autograd's, with accumulation and unused params."""
        ours, plain = _net(), _net()
        handle = sync_gradients(ours, bucket_cap_mb=0.002)
        for seed, options in enumerate(({}, {"branch": True}, {"left_first": False}, {})):
            for model in (ours, plain):
                _loss(model, seed, **options).backward()
            _assert_same(_grads(ours), _grads(plain))
        assert spy.calls == 4 * len(handle.buckets)
        handle.remove()

    def test_mixed_dtypes_get_separate_buckets(self, spy: _AllReduceSpy) -> None:
        """float32 and float64 parameters are averaged in buckets of their own dtype."""

        def build() -> nn.ModuleList:
            torch.manual_seed(0)
            return nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, 2).double(), nn.Linear(2, 1)])

        def loss(model: nn.ModuleList) -> torch.Tensor:
            h = model[0](torch.ones(2, 3)).double()
            return model[2](model[1](h).float()).sum()

        ours, plain = build(), build()
        handle = sync_gradients(ours)
        assert [{p.dtype for p in bucket} for bucket in handle.buckets] == [
            {torch.float32},
            {torch.float64},
        ]
        loss(ours).backward()
        loss(plain).backward()
        _assert_same(_grads(ours), _grads(plain))
        assert spy.calls == 2
        handle.remove()

    def test_matches_ddp_in_world_of_one(self) -> None:
        """Results equal DDP(find_unused_parameters=True) with one rank, spare grad None."""
        ours = _net()
        ddp = DistributedDataParallel(_net(), find_unused_parameters=True)
        handle = sync_gradients(ours)
        for seed, options in enumerate(({}, {"branch": True}, {})):
            _loss(ours, seed, **options).backward()
            _loss(ddp, seed, **options).backward()  # type: ignore[arg-type]
            _assert_same(_grads(ours), _grads(ddp.module))
        assert ours.spare.grad is None
        handle.remove()
        del ddp
        gc.collect()

    def test_parameter_unused_everywhere_keeps_its_grad(self) -> None:
        """A .grad of a parameter no rank used is left as it was, the same tensor."""
        model = _net()
        handle = sync_gradients(model)
        kept = torch.full_like(model.branch.weight, 3.0)
        model.branch.weight.grad = kept
        _loss(model, 0).backward()
        assert model.branch.weight.grad is kept
        assert torch.equal(kept, torch.full_like(kept, 3.0))
        handle.remove()

    def test_autograd_grad_is_not_synchronised(self, spy: _AllReduceSpy) -> None:
        """torch.autograd.grad with parameters as inputs launches nothing and leaves .grad."""
        model = _net()
        handle = sync_gradients(model)
        grads = torch.autograd.grad(_loss(model, 0), list(model.out.parameters()))
        assert len(grads) == 2
        assert spy.calls == 0
        assert all(p.grad is None for p in model.parameters())
        handle.remove()

    def test_backward_with_inputs_averages_those_inputs(self, spy: _AllReduceSpy) -> None:
        """backward(inputs=...) averages the inputs' grads and leaves the others None."""
        model, plain = _net(), _net()
        handle = sync_gradients(model)
        _loss(model, 0).backward(inputs=list(model.out.parameters()))
        _loss(plain, 0).backward(inputs=list(plain.out.parameters()))
        _assert_same(_grads(model), _grads(plain))
        assert spy.calls == len(handle.buckets)
        handle.remove()

    def test_sparse_gradient_raises(self) -> None:
        """A sparse gradient fails backward with a message naming the layout."""
        embedding = nn.Embedding(10, 3, sparse=True)
        handle = sync_gradients(embedding)
        with pytest.raises(tensorhooks.GradientSyncError, match=r"layout torch\.sparse_coo"):
            embedding(torch.tensor([1, 2])).sum().backward()
        handle.remove()

    def test_reentrant_checkpoint_raises_then_recovers(self) -> None:
        """A nested backward on synced parameters raises; a plain backward then works."""
        from torch.utils.checkpoint import checkpoint

        model = _net()
        handle = sync_gradients(model)

        def run(x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda t: torch.tanh(model.inp(t)), x, use_reentrant=True)
            return model.out(torch.tanh(model.left(h))).sum()

        x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
        with pytest.raises(tensorhooks.GradientSyncError, match=r"use_reentrant=True\) does this"):
            run(x).backward()
        model.zero_grad()
        plain = _net()
        _loss(model, 0).backward()
        _loss(plain, 0).backward()
        _assert_same(_grads(model), _grads(plain))
        handle.remove()

    def test_already_synchronised_parameters_raise(self) -> None:
        """Syncing parameters twice raises; after remove() they can be synced again."""
        model = _net()
        handle = sync_gradients(model)
        with pytest.raises(
            tensorhooks.SyncArgumentValueError,
            match=r"parameter 0 \(shape \(16, 6\)\) is already synchronised by another handle",
        ):
            sync_gradients(model.inp.parameters())
        handle.remove()
        sync_gradients(model.inp.parameters()).remove()

    @pytest.mark.parametrize(
        ("argument", "error", "message"),
        [
            (
                torch.zeros(2, requires_grad=True),
                tensorhooks.SyncArgumentTypeError,
                "got a single Tensor; wrap it",
            ),
            (
                [nn.Parameter(torch.zeros(1)), "w"],
                tensorhooks.SyncArgumentTypeError,
                "parameter 1 is 'w' of type str",
            ),
            (5, tensorhooks.SyncArgumentTypeError, "got 5 of type int"),
            ([torch.zeros(2)], tensorhooks.SyncArgumentValueError, "no tensor requires grad"),
            (
                [torch.zeros(2, requires_grad=True) * 2],
                tensorhooks.SyncArgumentValueError,
                r"parameter 0 \(shape \(2,\)\) is not a leaf tensor \(grad_fn=MulBackward0\)",
            ),
        ],
    )
    def test_invalid_parameters_raise(self, argument: Any, error: type, message: str) -> None:
        """Wrong module_or_params values raise errors naming the value seen."""
        with pytest.raises(error, match=message) as info:
            sync_gradients(argument)
        assert not isinstance(
            info.value, tensorhooks.HookArgumentTypeError
        )  # not named after hooks

    @pytest.mark.parametrize(
        ("cap", "error", "message"),
        [
            (0, tensorhooks.SyncArgumentValueError, "bucket_cap_mb must be positive .* got 0"),
            (
                -1.5,
                tensorhooks.SyncArgumentValueError,
                "bucket_cap_mb must be positive .* got -1.5",
            ),
            (
                1e-9,
                tensorhooks.SyncArgumentValueError,
                "bucket_cap_mb must be positive .* got 1e-09",
            ),
            (
                "25",
                tensorhooks.SyncArgumentTypeError,
                "bucket_cap_mb must be a number of MiB, got '25' of type str",
            ),
        ],
    )
    def test_invalid_bucket_cap_raises(self, cap: Any, error: type, message: str) -> None:
        """A bucket cap that is not a positive size raises."""
        with pytest.raises(error, match=message):
            sync_gradients(_net(), bucket_cap_mb=cap)

    def test_invalid_process_group_raises(self) -> None:
        """A process_group that is not a ProcessGroup raises a TypeError of sync_gradients."""
        with pytest.raises(
            tensorhooks.SyncArgumentTypeError,
            match=r"process_group must be a torch\.distributed\.ProcessGroup or None, got 'world'",
        ):
            sync_gradients(_net(), "world")  # type: ignore[arg-type]

    def test_process_outside_the_group_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A process that is not in the group (world size -1 there) is told so."""
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: -1)
        with pytest.raises(
            tensorhooks.SyncArgumentValueError,
            match=r"global rank 0\) is not a member of process_group \(world size -1\)",
        ):
            sync_gradients(_net())

    def test_uninitialised_default_group_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a default process group the error says to call init_process_group."""
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        with pytest.raises(
            tensorhooks.SyncArgumentValueError,
            match=r"has no default process group; call torch.distributed.init_process_group",
        ):
            sync_gradients(_net())


@pytest.mark.usefixtures("world_of_one")
class TestNoSync:
    """GradientSyncHandle.no_sync: skipping communication for gradient accumulation."""

    def test_accumulates_then_averages_the_sum(self, spy: _AllReduceSpy) -> None:
        """Grads accumulated under no_sync are part of the next synced step's result."""
        ours, plain = _net(), _net()
        handle = sync_gradients(ours)
        with handle.no_sync():
            _loss(ours, 0).backward()
            _loss(ours, 1).backward()
        assert spy.calls == 0
        _loss(ours, 2).backward()
        assert spy.calls == len(handle.buckets)
        for seed in range(3):
            _loss(plain, seed).backward()
        _assert_same(_grads(ours), _grads(plain))
        handle.remove()

    def test_nests_and_restores_after_an_exception(self, spy: _AllReduceSpy) -> None:
        """Nested blocks skip communication until the outermost exits, even by an exception."""
        model = _net()
        handle = sync_gradients(model)
        with handle.no_sync():
            with pytest.raises(KeyError), handle.no_sync():
                raise KeyError("inner")
            _loss(model, 0).backward()
        assert spy.calls == 0
        _loss(model, 0).backward()
        assert spy.calls == len(handle.buckets)
        handle.remove()

    def test_applies_to_the_handle_from_any_thread(self, spy: _AllReduceSpy) -> None:
        """A block entered on another thread covers backward calls on this one."""
        model = _net()
        handle = sync_gradients(model)
        entered, release = threading.Event(), threading.Event()

        def hold() -> None:
            with handle.no_sync():
                entered.set()
                release.wait(timeout=30)

        thread = threading.Thread(target=hold)
        thread.start()
        entered.wait(timeout=30)
        _loss(model, 0).backward()
        release.set()
        thread.join()
        assert spy.calls == 0
        _loss(model, 0).backward()
        assert spy.calls == len(handle.buckets)
        handle.remove()

    def test_is_decided_once_per_backward(self, spy: _AllReduceSpy) -> None:
        """Entering no_sync part-way through a backward does not stop that backward's sync."""
        model = _net()
        handle = sync_gradients(model, bucket_cap_mb=0.002)
        context = handle.no_sync()
        x = torch.randn(2, 6, dtype=torch.float64)
        h = torch.tanh(model.inp(x))
        h.register_hook(lambda grad: context.__enter__())
        model.out(torch.tanh(model.left(h))).sum().backward()
        assert spy.calls == len(handle.buckets)
        context.__exit__(None, None, None)
        handle.remove()


@pytest.mark.usefixtures("world_of_one")
class TestRemove:
    """GradientSyncHandle.remove: stopping synchronisation."""

    def test_stops_communication_and_is_idempotent(self, spy: _AllReduceSpy) -> None:
        """After remove() no all-reduce is launched; a second remove() does nothing."""
        model = _net()
        handle = sync_gradients(model)
        handle.remove()
        handle.remove()
        _loss(model, 0).backward()
        assert spy.calls == 0
        assert model.out.weight.grad is not None


if __name__ == "__main__":
    run_worker(SCENARIOS, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def _compiled_backward_counts(sync: bool) -> tuple[dict[str, int], list[torch.Tensor]]:
    """Dynamo's graphs and breaks for a compiled step that runs backward; the gradients."""
    import warnings

    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    handle = sync_gradients(model) if sync else None

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(step, backend="aot_eager")(torch.randn(4, 8))
    counts = {
        "graph_break": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
    }
    if handle is not None:
        handle.remove()
    dynamo.reset()
    return counts, [param.grad.clone() for param in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.usefixtures("world_of_one")
def test_backward_in_a_compiled_function_compiles_none_of_sync_gradients_hooks() -> None:
    """Its accumulator hooks run eagerly: no graph or break beyond the plain step's, same grads.

    Compiled, they added a graph and a break per step (each hook a frame of its own).
    """
    plain, plain_grads = _compiled_backward_counts(sync=False)
    synced, synced_grads = _compiled_backward_counts(sync=True)
    assert synced["unique_graphs"] <= plain["unique_graphs"], (synced, plain)
    assert synced["graph_break"] <= plain["graph_break"], (synced, plain)
    for mine, theirs in zip(synced_grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs)  # a world of one: the average is the gradient
