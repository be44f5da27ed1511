"""Tensors a region reaches outside its arguments: changed before backward, rebound, written."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator

import pytest
import torch

import tensorhooks
from tensorhooks import (
    CheckpointError,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from tests.checkpoint.common import assert_same, torch_ckpt

Context = Callable[[], contextlib.AbstractContextManager[object]]
CONTEXTS: dict[str, Context] = {
    "plain": contextlib.nullcontext,
    "allow_mutation": tensorhooks.allow_mutation_on_saved_tensors,
}


def _double(seed: int, *shape: int, requires_grad: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return tensor.requires_grad_(requires_grad)


# The ways a region reaches a weight it then saves a view of, or reads.
READS: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "w.t()": lambda w: lambda h: (h @ w.t()).sin(),
    "w[0]": lambda w: lambda h: (h * w[0]).sin(),
    "w[:]": lambda w: lambda h: (h @ w[:]).sin(),
    "w": lambda w: lambda h: (h @ w).sin(),
}


@pytest.mark.parametrize("read", sorted(READS))
def test_weight_changed_before_backward_raises(read: str) -> None:
    """A closure's weight changed between forward and backward raises, naming the closure."""
    w = _double(0, 3, 3)
    x = _double(1, 4, 3)
    out = checkpoint(READS[read](w), x, use_reentrant=False)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(
        tensorhooks.SavedTensorModifiedError,
        match=r"(?s)modified by an inplace operation.*reads w from outside its arguments",
    ):
        torch.autograd.grad(out.sum(), [x])


@pytest.mark.parametrize("read", sorted(READS))
def test_weight_changed_before_backward_under_allow_mutation(read: str) -> None:
    """Inside allow_mutation_on_saved_tensors the save-time weight is used, as with no region."""
    w = _double(0, 3, 3)
    x = _double(1, 4, 3)
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = checkpoint(READS[read](w), x, use_reentrant=False)
        plain = READS[read](w)(x)
        with torch.no_grad():
            w.mul_(2)
        got = torch.autograd.grad(out.sum(), [x, w])
        expected = torch.autograd.grad(plain.sum(), [x, w])
    assert_same(got, expected)


def test_linear_weight_stepped_before_backward() -> None:
    """nn.Linear: a step before backward raises, or inside allow_mutation uses the old weight."""
    linear = torch.nn.Linear(3, 3).double()
    x = _double(1, 4, 3)
    out = checkpoint(linear, x, use_reentrant=False)
    with torch.no_grad():
        linear.weight.mul_(2)
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match=r"Linear\.weight"):
        torch.autograd.grad(out.sum(), [x])
    reference = copy.deepcopy(linear)
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = checkpoint(linear, x, use_reentrant=False)
        optimizer = torch.optim.SGD(linear.parameters(), lr=0.5)
        linear.weight.grad = torch.ones_like(linear.weight)
        optimizer.step()
        got = torch.autograd.grad(out.sum(), [x])
    assert_same(got, torch.autograd.grad(reference(x).sum(), [x]))


class _Counter(torch.nn.Module):
    """A module that counts its calls in a buffer and scales by the count."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_double(2, 4, requires_grad=False))
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return (h * self.weight * self.calls).sin()


class _SavedThenWritten(torch.nn.Module):
    """A module whose buffer is saved by an op, then written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_double(2, 4, requires_grad=False))
        self.register_buffer("scale", _double(3, 4, requires_grad=False))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = (h * self.weight * self.scale).sin()
        self.scale.mul_(0.5)
        return out


def _spectral() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4).double())


def _batch_norm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()


STATEFUL: dict[str, Callable[[], torch.nn.Module]] = {
    "counter": _Counter,
    "spectral_norm": _spectral,
    "batch_norm": _batch_norm,
}


def _state(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


@pytest.mark.parametrize("context", sorted(CONTEXTS))
@pytest.mark.parametrize("make", sorted(STATEFUL))
def test_state_written_by_the_region_matches_plain_autograd(make: str, context: str) -> None:
    """A region writing its module's state: plain autograd's gradient, the state written once."""
    module = STATEFUL[make]()
    reference = copy.deepcopy(module)
    x = _double(1, 6, 4)
    with CONTEXTS[context]():
        got = torch.autograd.grad(
            checkpoint(module, x, use_reentrant=False).sum(), [x, *module.parameters()]
        )
        expected = torch.autograd.grad(reference(x).sum(), [x, *reference.parameters()])
    assert_same(got, expected)
    assert_same(_state(module), _state(reference))


def test_buffer_saved_then_written_uses_the_saved_value() -> None:
    """A buffer saved by an op and then written by the region: the save-time value's gradient."""
    module = _SavedThenWritten()
    reference = copy.deepcopy(module)
    x = _double(1, 6, 4)
    got = torch.autograd.grad(checkpoint(module, x, use_reentrant=False).sum(), [x])
    with tensorhooks.allow_mutation_on_saved_tensors():
        expected = torch.autograd.grad(reference(x).sum(), [x])
    assert_same(got, expected)
    assert_same(_state(module), _state(reference))


def test_torch_checkpoint_gets_spectral_norm_wrong() -> None:
    """The reference point: torch's checkpoint runs the power iteration twice (wrong gradient)."""
    module = _spectral()
    reference = copy.deepcopy(module)
    x = _double(1, 6, 4)
    got = torch.autograd.grad(torch_ckpt(module, x).sum(), [x])
    expected = torch.autograd.grad(reference(x).sum(), [x])
    assert not torch.allclose(got[0], expected[0])


def test_weight_renormalised_by_the_region_matches_plain_autograd() -> None:
    """nn.Embedding(max_norm=...) renormalises its weight in forward: plain autograd's result."""
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Linear(4, 4))
    with torch.no_grad():
        module[0].weight.mul_(3)
    reference = copy.deepcopy(module)
    index = torch.tensor([1, 2, 3])
    got = torch.autograd.grad(
        checkpoint(module, index, use_reentrant=False).sum(), list(module.parameters())
    )
    expected = torch.autograd.grad(reference(index).sum(), list(reference.parameters()))
    assert_same(got, expected)
    assert_same(_state(module), _state(reference))


def test_weight_written_by_the_region_under_allow_mutation() -> None:
    """Inside allow_mutation_on_saved_tensors the same region gives plain autograd's gradients."""
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Linear(4, 4))
    with torch.no_grad():
        module[0].weight.mul_(3)
    reference = copy.deepcopy(module)
    index = torch.tensor([1, 2, 3])
    with tensorhooks.allow_mutation_on_saved_tensors():
        got = torch.autograd.grad(
            checkpoint(module, index, use_reentrant=False).sum(), list(module.parameters())
        )
        expected = torch.autograd.grad(reference(index).sum(), list(reference.parameters()))
    assert_same(got, expected)


@contextlib.contextmanager
def _no_state_left() -> Iterator[None]:
    yield
    assert tensorhooks.live_graph_tasks() == 0


def test_retain_graph_twice_with_written_state() -> None:
    """A second backward over a region that writes state recomputes from the same values."""
    module = _spectral()
    reference = copy.deepcopy(module)
    x = _double(1, 6, 4)
    with _no_state_left():
        loss = checkpoint(module, x, use_reentrant=False).sum()
        first = torch.autograd.grad(loss, [x], retain_graph=True)
        second = torch.autograd.grad(loss, [x])
    expected = torch.autograd.grad(reference(x).sum(), [x])
    assert_same(first, expected)
    assert_same(second, expected)


# A weight read from a closure, its storage freed after the forward pass and refilled before
# backward with its version counter put back, as FSDP does. Between the two, memory of the same
# size is filled with NaN and freed, so that the fresh storage most likely holds NaN until the
# refill: a copy taken of it then is NaN, not whatever the allocator happened to hand back.
def _refilled_weight_grads(
    run: Callable[..., torch.Tensor], twice: bool, step: bool
) -> list[torch.Tensor]:
    weight, x = _double(0, 4, 4), _double(1, 8)
    middle = x * 1.0

    def region(h: torch.Tensor) -> torch.Tensor:
        return (h + h) * weight.sum()

    loss = run(region, middle[1:3]).sum()
    with torch.no_grad():
        values = weight.clone()
        weight.untyped_storage().resize_(0)
        values.new_full(values.shape, float("nan"))  # allocated, filled and freed at once
        weight.untyped_storage().resize_(values.numel() * values.element_size())
        with torch.autograd._unsafe_preserve_version_counter(weight):
            weight.copy_(values)
    if step:  # a counted write after the refill: the region still reads the forward's value
        weight.grad = torch.ones_like(weight)
        torch.optim.Adam([weight], lr=0.25).step()
        weight.grad = None
    if twice:
        loss.backward(retain_graph=True)
        gc.collect()
    loss.backward()
    assert x.grad is not None
    return [x.grad]


@pytest.mark.parametrize("selective", [False, True], ids=["full", "must_save"])
@pytest.mark.parametrize("twice", [False, True], ids=["once", "retain_graph"])
@pytest.mark.parametrize("step", [False, True], ids=["", "step"])
def test_weight_refilled_read_again_or_stepped_under_allow_mutation(
    selective: bool, twice: bool, step: bool
) -> None:
    """Recomputation reads the refilled weight, never a copy of the freed storage.

    Inside allow_mutation_on_saved_tensors the region's weight is kept through the context's
    save guard; a refill that puts the version counter back is no write to autograd, and the
    weight itself must be read, as plain autograd's saved tensors are. Repeated: a copy of freed
    memory often holds the old values by chance.
    """
    context = (lambda: create_selective_checkpoint_contexts(mm_must_save)) if selective else None

    def region_call(function: Callable[..., torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        kwargs = {} if context is None else {"context_fn": context}
        return checkpoint(function, h, use_reentrant=False, **kwargs)

    expected = _refilled_weight_grads(lambda f, h: f(h), twice, step)
    for _ in range(3):
        with tensorhooks.allow_mutation_on_saved_tensors():
            got = _refilled_weight_grads(region_call, twice, step)
        gc.collect()
        assert_same(got, expected)


def mm_must_save(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """A selective policy saving every op's output."""
    return CheckpointPolicy.MUST_SAVE


def _copy_preserving_version(flat: torch.Tensor, values: torch.Tensor) -> None:
    # FSDP2's refill on one rank, or of parameters sharded on dimension 1.
    with torch.autograd._unsafe_preserve_version_counter(flat):
        flat.copy_(values)


@pytest.mark.parametrize("read", sorted(READS))
def test_weight_freed_and_refilled_under_allow_mutation(read: str) -> None:
    """A weight freed after forward and refilled uncounted is recomputed from its refill.

    FSDP2 frees its unsharded parameters after forward and writes them again before backward,
    putting their version counter back. Recomputation reads the refilled weight, as plain
    autograd does, not the copy the context took of the freed memory.
    """
    flat = _double(0, 16, requires_grad=False)
    values = flat.clone()
    weight = torch.nn.Parameter(flat.view(4, 4))
    x = _double(1, 2, 4)
    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = checkpoint(READS[read](weight), x, use_reentrant=False).pow(2).sum()
        n_bytes = flat.untyped_storage().nbytes()
        flat.untyped_storage().resize_(0)  # no operator sees it
        flat.untyped_storage().resize_(n_bytes)
        with torch.utils._python_dispatch._disable_current_modes():
            flat.data.fill_(float("nan"))  # what freed memory holds, written by no operator
        _copy_preserving_version(flat, values)
        got = torch.autograd.grad(loss, [x, weight])
    reference = torch.nn.Parameter(values.view(4, 4))
    expected = torch.autograd.grad(READS[read](reference)(x).pow(2).sum(), [x, reference])
    assert_same(got, expected)


class _Averaged(torch.nn.Module):
    """Keeps a running mean of its input in a buffer; reads it into its output if asked to."""

    def __init__(self, *, reads: bool) -> None:
        super().__init__()
        self.reads = reads
        self.weight = torch.nn.Parameter(_double(0, 4, 4))
        self.register_buffer("mean", torch.zeros(4, dtype=torch.float64))
        self.updates = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.updates:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(h.mean(0))
        out = h @ self.weight
        return (out - self.mean).sin() if self.reads else out.sin()


def _mean_after(run: Callable[..., torch.Tensor], module: torch.nn.Module) -> list[torch.Tensor]:
    x = _double(1, 3, 4)
    grads = torch.autograd.grad(run(module, x).sum(), [x, module.weight])
    return [*grads, module.mean.clone()]


class _Reader(_Averaged):
    """Another block type (another code): it only reads the buffer."""

    def __init__(self) -> None:
        super().__init__(reads=True)
        self.updates = False


def test_state_another_block_type_writes_is_copied_for_it() -> None:
    """A buffer one block type only read, then another writes and reads: plain's results.

    Copies are learned per block type: the writer's first call copies the buffer although the
    reader reached it before.
    """
    reader, writer = _Reader(), _Averaged(reads=True)
    writer.mean = reader.mean  # one buffer: read by one block type, written by the other
    plain = copy.deepcopy(writer)
    x = _double(1, 3, 4)
    checkpoint(reader, x, use_reentrant=False).sum().backward()  # an earlier step
    assert_same(
        _mean_after(lambda m, a: checkpoint(m, a, use_reentrant=False), writer),
        _mean_after(lambda m, a: m(a), plain),
    )


def test_state_a_later_block_writes_after_an_earlier_read_it() -> None:
    """A buffer an earlier region read and a later one wrote: the earlier one's backward refuses."""
    reader, writer = _Reader(), _Averaged(reads=True)
    writer.mean = reader.mean
    x = _double(1, 3, 4)
    out = checkpoint(writer, checkpoint(reader, x, use_reentrant=False), use_reentrant=False)
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match=r"reads _Reader\.mean"):
        out.sum().backward()


@pytest.mark.parametrize("reads", [False, True], ids=["written only", "written then read"])
def test_state_written_for_the_first_time_after_a_first_call(reads: bool) -> None:
    """A write data-dependent code makes for the first time: harmless unless read, then refused.

    Written only, recomputation writes a stand-in and the state is written once; read after a
    write that does not give its value again, backward raises CheckpointError naming it. The
    next call keeps its value first and gives plain autograd's results.
    """
    module = _Averaged(reads=reads)
    module.updates = False
    plain = copy.deepcopy(module)
    run_ours = lambda m, a: checkpoint(m, a, use_reentrant=False)  # noqa: E731
    _mean_after(run_ours, module)  # a first call that does not write the buffer
    _mean_after(lambda m, a: m(a), plain)
    module.updates = plain.updates = True
    if reads:
        with pytest.raises(CheckpointError, match=r"changed _Averaged\.mean in place"):
            _mean_after(run_ours, module)
        module.mean.copy_(plain.mean)  # the refused step's forward pass wrote it: start even
        _mean_after(lambda m, a: m(a), plain)
        module.mean.copy_(plain.mean)
    assert_same(_mean_after(run_ours, module), _mean_after(lambda m, a: m(a), plain))


def test_a_block_writing_what_it_saved_recomputes_once_from_its_second_call() -> None:
    """The positions a block's code changes after saving are learned: one recomputation then."""
    runs: list[bool] = []

    def block(a: torch.Tensor) -> torch.Tensor:
        runs.append(tensorhooks.is_recomputing())
        b = a * 2
        c = b.sin()  # saves b
        d = c * 3
        b.add_(1)  # then changes b
        return (d * b).tanh()

    x = _double(1, 4)
    with tensorhooks.allow_mutation_on_saved_tensors():
        expected = torch.autograd.grad(block(x).sum(), [x])
    for _ in range(2):
        runs.clear()
        with tensorhooks.allow_mutation_on_saved_tensors():
            got = torch.autograd.grad(checkpoint(block, x, use_reentrant=False).sum(), [x])
        assert_same(got, expected)
    assert runs == [False, True]  # the forward pass, and one recomputation


class _EmaThenWrite(torch.nn.Module):
    """Reads its EMA, updates it, then writes a value it saved: recomputed twice at first."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_double(0, 4, 4))
        self.register_buffer("ema", torch.ones(4, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = (h @ self.weight) * self.ema  # saves the EMA as the forward pass read it
        with torch.no_grad():
            self.ema.mul_(0.5).add_(h.mean(0) * 0.5 + 1)
        b = out * 2
        c = b.sin()  # saves b
        b.add_(1)  # then changes b: the first recomputation runs twice
        return c * b


def test_a_block_recomputed_twice_reads_its_state_as_at_the_call_both_times() -> None:
    """A first recomputation's second run reads the EMA as at the call (it read the first's)."""
    plain, ours = _EmaThenWrite(), _EmaThenWrite()
    x = _double(1, 3, 4)
    for _ in range(2):
        with tensorhooks.allow_mutation_on_saved_tensors():  # the save-time gradient
            expected = torch.autograd.grad(plain(x).sum(), [x, plain.weight])
        got = torch.autograd.grad(checkpoint(ours, x, use_reentrant=False).sum(), [x, ours.weight])
        assert_same(got, expected)
        assert_same(ours.ema, plain.ema)  # updated once a step


def test_a_read_only_buffer_is_copied_at_its_first_call_only() -> None:
    """No copy of a buffer a block only reads, once the block has run once."""
    module = _Averaged(reads=True)
    module.updates = False
    x = _double(1, 3, 4)

    def clones() -> int:
        # acc_events: a profiler of one cycle; without it torch 2.11 warns that cycles clear events
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu, acc_events=True) as prof:
            checkpoint(module, x, use_reentrant=False).sum().backward()
        return sum(event.name == "aten::clone" for event in prof.events())

    assert clones() >= 1  # the first call copies it, to learn whether the block writes it
    assert clones() == 0


def test_state_reached_deeper_saved_then_written_names_the_forward_pass() -> None:
    """State reached deeper than recorded, saved then written: raises, saying it was in forward.

    A buffer reached through a closure of a closure is not recorded by name, so nothing keeps
    its value from before the write: backward raises, as plain autograd does.
    """
    holder = torch.nn.Module()
    holder.register_buffer("ema", torch.ones(4, dtype=torch.float64))
    get = lambda: holder.ema  # noqa: E731  # one level deeper than checkpoint records
    x = _double(0, 3, 4)

    def region(h: torch.Tensor) -> torch.Tensor:
        out = h * get()  # saves the buffer
        with torch.no_grad():
            get().mul_(0.5)
        return out

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        region(x).sum().backward()  # plain autograd refuses too
    out = checkpoint(region, x, use_reentrant=False)
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match="in its forward pass"):
        out.sum().backward()


def _regathered_step() -> tuple[torch.Tensor, torch.Tensor]:
    """One step of a region gathering its weight; the weight's gradient and the expected one."""
    weight = _double(0, 4, 4)
    full = weight.detach().clone()
    x = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)

    def region(a: torch.Tensor) -> torch.Tensor:
        weight.data = full.clone()
        return ((a + weight) * 0.5).exp()

    with tensorhooks.allow_mutation_on_saved_tensors():
        out = checkpoint(region, x, use_reentrant=False)
        weight.grad = torch.ones_like(weight)
        torch.optim.Adam([weight], lr=0.25, foreach=False).step()
        weight.grad = None
        out.sum().backward()
    assert weight.grad is not None
    return weight.grad, 0.5 * torch.exp((x + full) * 0.5)


def test_a_weight_regathered_in_the_region_and_stepped_before_backward() -> None:
    """A gathered weight (``w.data = full.clone()``) stepped before backward: right gradient.

    Inside allow_mutation_on_saved_tensors. Recomputation's gather releases the storage the
    forward pass left, whose value the context kept: a tensor recomputation made next could get
    its address and read that value instead (a gradient off by up to 0.67, as the allocator
    chose).
    """
    for _ in range(20):  # the allocator's choice of address varies
        got, expected = _regathered_step()
        assert_same(got, expected)
