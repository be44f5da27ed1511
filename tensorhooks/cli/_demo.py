"""``python -m tensorhooks demo``: torch's contexts and tensorhooks', side by side.

For each feature the demo runs torch's implementation and tensorhooks' on the case where they
differ (an identity pack hook and an in-place change, a write through a view, a failed backward,
threads, a graph dropped without backward, an unused parameter across two processes, a write
inside a checkpointed region, ``torch.autograd.grad`` through a checkpoint, an offload policy in
eager mode, parameters kept on the host), says what each did (the gradient right or wrong, the
state left behind, the bytes kept), and times a training step of a tiny transformer under both
(see NOTE [How tensorhooks times things]).

A feature is one function ``case(demo) -> Row | list[Row]`` in `CASES`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import graph as torch_graph
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tensorhooks
from tensorhooks._core.torch_compat import TorchDispatchMode

from ._harness import Spread, interleaved
from ._models import ModelConfig, TinyTransformer, backward, make_batch, mlp

__all__ = ["CASES", "Demo", "DemoConfig", "Outcome", "Row", "format_bytes", "run_demo"]

Context = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: the model timed, and how long."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rounds: int = 5
    steps: int = 2
    processes: bool = True  # run the two-process sync_gradients case


@dataclass(frozen=True)
class Outcome:
    """What one implementation did on a case: a short result, a sentence, and whether it is OK."""

    result: str
    detail: str
    good: bool


@dataclass(frozen=True)
class Row:
    """One case of one feature, under torch and under tensorhooks."""

    feature: str
    case: str
    torch: Outcome
    ours: Outcome
    timing: Spread | None = None  # step time, tensorhooks over torch, per round
    timed: str = ""  # what the timing measured


def format_bytes(count: float) -> str:
    """Bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**20)
        '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _first_line(error: BaseException, width: int = 60) -> str:
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return text if len(text) <= width else text[: width - 3] + "..."


class Demo:
    """What every case shares: the configuration, a model, a batch, and the step timer."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        torch.manual_seed(config.model.seed)
        self.model = TinyTransformer(config.model).to(config.model.device)
        self.batch = make_batch(config.model)

    @property
    def cuda(self) -> bool:
        """Whether the model runs on a CUDA device."""
        return self.config.model.device.startswith("cuda")

    def step(
        self, context: Context, model: TinyTransformer | None = None, *, inplace: bool = False
    ) -> Callable[[], None]:
        """One training step (forward + backward) of the tiny transformer under ``context``."""
        net = self.model if model is None else model

        def run() -> None:
            net.zero_grad(set_to_none=True)
            with context():
                loss = net(*self.batch, inplace=inplace)
                backward(loss)

        return run

    def ratio(self, theirs: Callable[[], None], ours: Callable[[], None]) -> Spread:
        """Step time of ``ours`` over ``theirs``, per round."""
        timings = interleaved(
            {"torch": theirs, "tensorhooks": ours},
            rounds=self.config.rounds,
            inner=self.config.steps,
            threads=torch.get_num_threads(),
        )
        return timings.ratio("tensorhooks", "torch")


# ---------------------------------------------------------------------------------------------
# saved_tensors_hooks


def _identity_pack_then_write(hooks: Callable[..., Any]) -> torch.Tensor:
    """An identity pack hook, then an in-place change of the saved tensor; returns the grad."""
    a = torch.ones(3, requires_grad=True)
    with hooks(lambda t: t, lambda t: t):
        b = a * 1
        y = (b * b).sum()  # saves b
    b.mul_(10)
    backward(y)
    assert a.grad is not None
    return a.grad


def _gradient_or_error(
    program: Callable[[], torch.Tensor],
    expected: torch.Tensor,
    *,
    raising_is_right: bool = True,
    right: str = "the gradient of the save-time values",
) -> Outcome:
    """The gradient ``program`` returns, right or wrong, or the error it raises.

    ``raising_is_right`` says whether an error is the right answer (no right gradient exists
    without a copy) or a refusal of a program whose gradient is well defined; ``right`` is the
    detail of a right gradient.
    """
    try:
        grad = program()
    except RuntimeError as error:
        if raising_is_right:
            return Outcome("raises", _first_line(error), good=True)
        return Outcome("refuses", _first_line(error, width=93), good=False)  # say what it refuses
    if torch.equal(grad, expected):
        return Outcome("right gradient", right, good=True)
    index = int((grad != expected).flatten().nonzero()[0])
    got, want = grad.flatten()[index].item(), expected.flatten()[index].item()
    return Outcome("WRONG gradient", f"silently {got:g} where {want:g} is right", good=False)


def saved_tensors_hooks_case(demo: Demo) -> Row:
    """An identity pack hook, then the saved tensor changed in place before backward."""
    expected = torch.full((3,), 2.0)

    def identity() -> contextlib.AbstractContextManager[Any]:
        return tensorhooks.saved_tensors_hooks(lambda t: t, lambda t: t)

    def torch_identity() -> contextlib.AbstractContextManager[Any]:
        return torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    return Row(
        "saved_tensors_hooks",
        "pack returns the tensor itself (lambda t: t); the saved tensor is then changed in "
        "place before backward",
        _gradient_or_error(
            partial(_identity_pack_then_write, torch_graph.saved_tensors_hooks), expected
        ),
        _gradient_or_error(
            partial(_identity_pack_then_write, tensorhooks.saved_tensors_hooks), expected
        ),
        demo.ratio(demo.step(torch_identity), demo.step(identity)),
        "identity hooks",
    )


# ---------------------------------------------------------------------------------------------
# disable_saved_tensors_hooks


def _enter_with_bad_message(
    disable: Callable[[Any], contextlib.AbstractContextManager[Any]],
) -> Outcome:
    try:
        with disable(123):
            pass
    except TypeError as error:
        named = "got 123" in str(error)
        detail = _first_line(error)
        return Outcome("names the argument" if named else "pybind error", detail, good=named)
    return Outcome("accepted", "a message that is not a string was accepted", good=False)


def disable_saved_tensors_hooks_case(demo: Demo) -> Row:
    """A message that is not a string."""
    message = "no saved-tensor hooks here"
    return Row(
        "disable_saved_tensors_hooks",
        "called with an error message that is not a string (123)",
        _enter_with_bad_message(torch_graph.disable_saved_tensors_hooks),
        _enter_with_bad_message(tensorhooks.disable_saved_tensors_hooks),
        demo.ratio(
            demo.step(partial(torch_graph.disable_saved_tensors_hooks, message)),
            demo.step(partial(tensorhooks.disable_saved_tensors_hooks, message)),
        ),
        "a step inside the region",
    )


# ---------------------------------------------------------------------------------------------
# save_on_cpu


class _Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """Weak references to every tensor an operator returns, to see what outlives a graph."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append(weakref.ref(tensor))
        return out


def _kept_after_drop(demo: Demo, context: Context) -> int:
    """Bytes of forward's tensors still alive once its graph is dropped, before a gc pass."""
    gc.collect()
    gc.disable()
    try:
        outputs = _Outputs()
        with torch.no_grad():
            demo.model.zero_grad(set_to_none=True)
        with context(), outputs:
            loss = demo.model(*demo.batch)
        del loss  # dropped without backward: an evaluation pass with grad enabled, say
        storages = {}
        for ref in outputs.made:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
    finally:
        gc.enable()
        gc.collect()


def _held_on_device(demo: Demo, context: Context) -> int:
    """Device bytes a forward pass leaves allocated for backward (CUDA only)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with context():
        loss = demo.model(*demo.batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    backward(loss)
    return held


def save_on_cpu_case(demo: Demo) -> Row:
    """A forward pass whose graph is dropped without backward."""
    pin = demo.cuda
    theirs = partial(torch_graph.save_on_cpu, pin_memory=pin)
    ours = partial(tensorhooks.save_on_cpu, pin_memory=pin)
    outcomes = []
    for context in (theirs, ours):
        kept = _kept_after_drop(demo, context)
        detail = (
            f"{format_bytes(kept)} of its tensors stay until the garbage collector runs"
            if kept
            else "nothing outlives the graph"
        )
        if demo.cuda:
            held = _held_on_device(demo, context)
            plain = _held_on_device(demo, contextlib.nullcontext)
            detail += f"; device memory held for backward {format_bytes(held)} (no offload: "
            detail += f"{format_bytes(plain)})"
        result = f"keeps {format_bytes(kept)}" if kept else "frees it at once"
        outcomes.append(Outcome(result, detail, good=kept == 0))
    return Row(
        "save_on_cpu",
        "a forward pass whose graph is dropped without backward (outputs saved by their own op, "
        "such as softmax, point back at their graph)",
        outcomes[0],
        outcomes[1],
        demo.ratio(demo.step(theirs), demo.step(ours)),
        f"a step under save_on_cpu(pin_memory={pin})",
    )


# ---------------------------------------------------------------------------------------------
# allow_mutation_on_saved_tensors


def _write_view_of_saved(context: Context) -> torch.Tensor:
    a = torch.ones(4, 6, requires_grad=True)
    with context():
        b = a * 1
        out = (b**2).sum()  # saves b
        b[1:].mul_(2)  # writes a view of it
        backward(out)
    assert a.grad is not None
    return a.grad


def allow_mutation_case(demo: Demo) -> Row:
    """A write through a view of a saved tensor."""
    expected = torch.full((4, 6), 2.0)
    return Row(
        "allow_mutation_on_saved_tensors",
        "b is saved for backward, then b[1:] (a view of it) is changed in place",
        _gradient_or_error(
            partial(_write_view_of_saved, torch_graph.allow_mutation_on_saved_tensors), expected
        ),
        _gradient_or_error(
            partial(_write_view_of_saved, tensorhooks.allow_mutation_on_saved_tensors), expected
        ),
        demo.ratio(
            demo.step(torch_graph.allow_mutation_on_saved_tensors, inplace=True),
            demo.step(tensorhooks.allow_mutation_on_saved_tensors, inplace=True),
        ),
        "a step with in-place residual adds",
    )


# ---------------------------------------------------------------------------------------------
# register_multi_grad_hook


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed part-way")


def _kept_after_failed_backward(register: Callable[..., Any]) -> Outcome:
    x = torch.ones(1 << 16, requires_grad=True)
    failing = _FailsInBackward.apply(x)  # type: ignore[no-untyped-call]  # untyped in torch
    a = x * 2  # a's gradient is computed (and buffered) before the failing node raises
    seen: list[weakref.ref[torch.Tensor]] = []
    a.register_hook(lambda grad: seen.append(weakref.ref(grad)))  # type: ignore[no-untyped-call]
    handle = register([a, x], lambda grads: None)
    with contextlib.suppress(RuntimeError):
        backward(a.sum() + failing.sum())
    gc.collect()
    alive = seen[0]() is not None
    handle.remove()
    if alive:
        size = format_bytes(x.nbytes)
        return Outcome(f"keeps {size}", f"a buffered {size} gradient, until remove()", good=False)
    return Outcome("keeps nothing", "the buffer is released when backward fails", good=True)


def _calls_under_threads(
    register: Callable[..., Any], threads: int = 4, each: int = 200
) -> Outcome:
    w1 = torch.ones(8, requires_grad=True)
    w2 = torch.ones(8, requires_grad=True)
    lock = threading.Lock()
    calls: list[bool] = []

    def fn(grads: Any) -> None:
        with lock:
            calls.append(all(grad is not None for grad in grads))

    handle = register([w1, w2], fn)

    def work(index: int) -> None:  # even threads use both weights, odd threads the first only
        for _ in range(each):
            backward((w1 * w2).sum() if index % 2 == 0 else (w1 * 2).sum())

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    handle.remove()
    total, full = threads * each, threads * each // 2
    detail = f"{len(calls)} of {total} calls, {calls.count(True)} of {full} with every gradient"
    if len(calls) == total and calls.count(True) == full:
        return Outcome("every call", detail, good=True)
    return Outcome(f"lost {total - len(calls)} calls", detail, good=False)


def register_multi_grad_hook_cases(demo: Demo) -> list[Row]:
    """State after a failed backward; calls when threads run backward at once."""
    models = {name: copy.deepcopy(demo.model) for name in ("torch", "tensorhooks")}
    registers = {
        "torch": torch_graph.register_multi_grad_hook,
        "tensorhooks": tensorhooks.register_multi_grad_hook,
    }
    handles = [
        registers[name](bucket, lambda grads: None)
        for name, model in models.items()
        for bucket in model.buckets()
    ]
    try:
        timing = demo.ratio(
            demo.step(contextlib.nullcontext, models["torch"]),
            demo.step(contextlib.nullcontext, models["tensorhooks"]),
        )
    finally:
        for handle in handles:
            handle.remove()
    return [
        Row(
            "register_multi_grad_hook",
            'mode "all"; backward raises after one tensor of the group got its gradient',
            _kept_after_failed_backward(torch_graph.register_multi_grad_hook),
            _kept_after_failed_backward(tensorhooks.register_multi_grad_hook),
            timing,
            "a step with one hook per block",
        ),
        Row(
            "register_multi_grad_hook",
            'mode "all"; four threads run backward at once over parts of one group',
            _calls_under_threads(torch_graph.register_multi_grad_hook),
            _calls_under_threads(tensorhooks.register_multi_grad_hook),
        ),
    ]


# ---------------------------------------------------------------------------------------------
# sync_gradients


class _OneUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _sync_worker(rank: int, directory: str, rounds: int, steps: int) -> None:
    """One of two gloo processes: DDP and sync_gradients on a model with an unused parameter."""
    import torch.distributed as dist  # noqa: PLC0415  # only the worker processes need it
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    torch.set_num_threads(1)
    init = f"file://{Path(directory) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.full((1, 4), float(rank + 1))
    outcomes: dict[str, Outcome] = {}
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_OneUnused())
    try:
        for _ in range(2):
            backward(ddp(x).sum())
        outcomes["torch"] = Outcome("trains", "no error", good=True)
    except RuntimeError as error:
        outcomes["torch"] = Outcome("raises at step 2", _first_line(error), good=False)
    torch.manual_seed(0)
    ours = _OneUnused()
    handle = tensorhooks.distributed.sync_gradients(ours)
    for _ in range(2):
        backward(ours(x).sum())
    grad = ours.used.weight.grad
    right = grad is not None and torch.allclose(grad, torch.full((1, 4), 2 * 1.5))
    detail = "2 steps, gradients averaged, the unused one left as None"
    outcomes["ours"] = Outcome("trains", detail, good=right and ours.unused.weight.grad is None)
    handle.remove()

    torch.manual_seed(0)
    base = mlp(4, 256)
    batch = torch.randn(16, 256)
    reference = DistributedDataParallel(copy.deepcopy(base))
    synced = copy.deepcopy(base)
    handle = tensorhooks.distributed.sync_gradients(synced)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            backward(model(batch).sum())
            model.zero_grad(set_to_none=True)

        return run

    timings = interleaved(
        {"torch": step(reference), "tensorhooks": step(synced)}, rounds=rounds, inner=steps
    )
    handle.remove()
    if rank == 0:
        torch.save(
            {"outcomes": outcomes, "timing": timings.ratio("tensorhooks", "torch")},
            Path(directory) / "result.pt",
        )
    dist.barrier()
    dist.destroy_process_group()


def sync_gradients_case(demo: Demo) -> Row:
    """Two local gloo processes; a parameter that gets no gradient."""
    case = "two gloo processes; one parameter gets no gradient (DDP's default settings)"
    if not demo.config.processes:
        skipped = Outcome("not run", "skipped (--no-processes)", good=True)
        return Row("distributed.sync_gradients", case, skipped, skipped)
    from torch.multiprocessing.spawn import spawn  # noqa: PLC0415  # only this case needs it

    with tempfile.TemporaryDirectory() as directory:
        args = (directory, demo.config.rounds, demo.config.steps)
        spawn(_sync_worker, args=args, nprocs=2, join=True)  # type: ignore[no-untyped-call]
        result = torch.load(Path(directory) / "result.pt", weights_only=False)
    outcomes = result["outcomes"]
    return Row(
        "distributed.sync_gradients",
        case,
        outcomes["torch"],
        outcomes["ours"],
        result["timing"],
        "a step of 4 x Linear(256, 256), against DDP",
    )


# ---------------------------------------------------------------------------------------------
# checkpoint


class _Checkpointed(nn.Module):
    """A transformer block run through a checkpoint function."""

    def __init__(self, block: nn.Module, checkpoint: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, causal: torch.Tensor, inplace: bool) -> torch.Tensor:
        """The block's forward, without keeping its activations."""
        return self.checkpoint(self.block, x, causal, inplace)


def _checkpointed(
    model: TinyTransformer, checkpoint: Callable[..., torch.Tensor]
) -> TinyTransformer:
    """A copy of ``model`` whose every block is checkpointed with ``checkpoint``."""
    copied = copy.deepcopy(model)
    for index, block in enumerate(copied.blocks):
        copied.blocks[index] = _Checkpointed(block, checkpoint)
    return copied


_torch_checkpoint = partial(torch_checkpoint.checkpoint, use_reentrant=False)


def _write_inside_region(checkpoint: Callable[..., torch.Tensor]) -> torch.Tensor:
    """A region that saves b and then changes it in place; returns the weight's gradient."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def region(a: torch.Tensor) -> torch.Tensor:
        b = a * 2
        c = b * w  # saves b
        b.add_(1)  # then changes it
        return c * b.sin()

    x = torch.ones(3, requires_grad=True)
    (grad,) = torch.autograd.grad(checkpoint(region, x).sum(), [w])
    return grad


def _grad_through(checkpoint: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``torch.autograd.grad`` of a checkpointed region with respect to its input."""
    x = torch.linspace(0.0, 1.0, 5, requires_grad=True)
    (grad,) = torch.autograd.grad(checkpoint(torch.sin, x).sum(), [x])
    return grad


class _CountOp(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base is untyped
    """How many times an operator runs."""

    def __init__(self, op: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.op = op
        self.runs = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.runs += func == self.op
        return func(*args, **(kwargs or {}))


def _offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


def _backward_matmuls(checkpoint: Callable[..., torch.Tensor], device: str) -> int:
    """Matmuls a backward runs when a policy asks to offload them (torch's contexts)."""
    torch.manual_seed(0)
    w1, w2 = (torch.randn(64, 64, device=device, requires_grad=True) for _ in range(2))
    x = torch.randn(32, 64, device=device, requires_grad=True)
    context_fn = partial(torch_checkpoint.create_selective_checkpoint_contexts, _offload_matmuls)
    y = checkpoint(lambda a: (a @ w1).relu() @ w2, x, context_fn=context_fn)
    counter = _CountOp(torch.ops.aten.mm.default)
    with counter:
        backward(y.sum())
    return counter.runs


def _matmuls_run_again(checkpoint: Callable[..., torch.Tensor], demo: Demo) -> Outcome:
    """Whether a backward runs again a matmul whose output the policy said to offload."""
    device = demo.config.model.device
    plain = _backward_matmuls(lambda function, *args, **kwargs: function(*args), device)
    again = _backward_matmuls(checkpoint, device) - plain
    if again:
        detail = f"{again} matmul run again in backward: the policy is read as recompute"
        return Outcome("recomputes", detail, good=False)
    where = "pinned host memory" if demo.cuda else "host memory (on CPU: where it was)"
    return Outcome("offloads", f"none run again: kept in {where}, read back", good=True)


def checkpoint_cases(demo: Demo) -> list[Row]:
    """A write inside the region; torch.autograd.grad; an offload policy in eager mode."""
    with torch_graph.allow_mutation_on_saved_tensors():  # torch's own answer for the write
        expected = _write_inside_region(lambda function, *args: function(*args))
    reference = torch.cos(torch.linspace(0.0, 1.0, 5))
    theirs = _checkpointed(demo.model, _torch_checkpoint)
    ours = _checkpointed(demo.model, tensorhooks.checkpoint)
    return [
        Row(
            "checkpoint",
            "use_reentrant=False; the region saves b, then changes b in place",
            _gradient_or_error(partial(_write_inside_region, _torch_checkpoint), expected),
            _gradient_or_error(partial(_write_inside_region, tensorhooks.checkpoint), expected),
            demo.ratio(
                demo.step(contextlib.nullcontext, theirs), demo.step(contextlib.nullcontext, ours)
            ),
            "every block checkpointed, against use_reentrant=False",
        ),
        Row(
            "checkpoint",
            "torch.autograd.grad through a checkpointed region (torch: use_reentrant=True, as "
            "DeepSpeed's and fairscale's checkpoints)",
            _gradient_or_error(
                partial(_grad_through, partial(torch_checkpoint.checkpoint, use_reentrant=True)),
                reference,
                raising_is_right=False,
            ),
            _gradient_or_error(
                partial(_grad_through, tensorhooks.checkpoint),
                reference,
                raising_is_right=False,
                right="the gradient without checkpointing",
            ),
        ),
        Row(
            "checkpoint",
            "selective: a policy says MUST_CPU_OFFLOAD for matmuls (torch's "
            "create_selective_checkpoint_contexts), eager mode",
            _matmuls_run_again(_torch_checkpoint, demo),
            _matmuls_run_again(tensorhooks.checkpoint, demo),
        ),
    ]


# ---------------------------------------------------------------------------------------------
# offload_parameters


class _HostTransfer:
    """A synchronous `tensorhooks.ParameterTransfer` whose "device" is the host itself.

    What the differences page uses to run offload_parameters without an accelerator: every copy
    is real (a block's parameters are fresh tensors while it runs), only none of them crosses a
    bus. On CUDA the demo uses `tensorhooks.CudaTransfer` instead.
    """

    device = torch.device("cpu")

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        return host.clone(), None

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        pass

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor.detach().clone(), None

    def synchronize(self, token: object) -> None:
        pass


def _streamed(model: nn.Module) -> list[nn.Parameter]:
    """The parameters offload_parameters streams: those of the model's blocks (its children)."""
    own = {id(param) for param in model.parameters(recurse=False)}
    return [param for param in model.parameters() if id(param) not in own]


def _device_bytes(params: list[nn.Parameter], host: set[int]) -> int:
    """Bytes of ``params`` whose data is not their host copy (a device copy)."""
    return sum(p.nbytes for p in params if p.untyped_storage().data_ptr() not in host)


def _grad_on_the_host(
    demo: Demo, model: TinyTransformer, handle: tensorhooks.ParameterOffloadHandle
) -> Outcome:
    """torch.autograd.grad through the offloaded model; where its parameters are, and when."""
    params = _streamed(model)
    host = {param.untyped_storage().data_ptr() for param in params}
    copied: list[bool] = []  # per block run: were its parameters device copies while it ran?

    def running(module: nn.Module, args: Any) -> None:
        copied.append(_device_bytes(list(module.parameters()), host) > 0)

    hooks = [block.register_forward_pre_hook(running) for block in handle.blocks]
    try:
        grads = torch.autograd.grad(model(*demo.batch), params)
    finally:
        for hook in hooks:
            hook.remove()
    expected = torch.autograd.grad(demo.model(*demo.batch), _streamed(demo.model))
    right = all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected, strict=True))
    kept = _device_bytes(params, host)
    detail = (
        f"torch.autograd.grad gives {'the' if right else 'a WRONG'} gradient; "
        f"{copied.count(True)} of {len(copied)} blocks ran on device copies; after it "
        f"{format_bytes(kept)} of {format_bytes(sum(p.nbytes for p in params))} of parameters "
        "stay on the device"
    )
    good = right and kept == 0 and all(copied)
    return Outcome("on the host" if kept == 0 else "kept", detail, good=good)


def offload_parameters_case(demo: Demo) -> Row:
    """Parameters on the host between uses; torch.autograd.grad through them."""
    ours = copy.deepcopy(demo.model)
    if demo.cuda:
        handle = tensorhooks.offload_parameters(ours, device=demo.config.model.device)
    else:
        handle = tensorhooks.offload_parameters(ours, transfer=_HostTransfer())
    try:
        outcome = _grad_on_the_host(demo, ours, handle)
        timing = demo.ratio(
            demo.step(contextlib.nullcontext), demo.step(contextlib.nullcontext, ours)
        )
    finally:
        handle.remove()
    resident = format_bytes(sum(p.nbytes for p in _streamed(demo.model)))
    theirs = Outcome(
        "no counterpart",
        "fairscale's OffloadModel (not installed here) refuses torch.autograd.grad (reentrant "
        f"backward); without offload all {resident} stay on the device",
        good=True,
    )
    transfer = "CUDA side streams" if demo.cuda else "synchronous copies on the host"
    return Row(
        "offload_parameters",
        "each block's parameters visit the device only while it runs; torch.autograd.grad "
        "over all of them",
        theirs,
        outcome,
        timing,
        f"every block streamed ({transfer}), against no offload",
    )


CASES: list[Callable[[Demo], Row | list[Row]]] = [
    saved_tensors_hooks_case,
    disable_saved_tensors_hooks_case,
    save_on_cpu_case,
    allow_mutation_case,
    register_multi_grad_hook_cases,
    sync_gradients_case,
    checkpoint_cases,
    offload_parameters_case,
]


def run_demo(
    config: DemoConfig,
    cases: list[Callable[[Demo], Row | list[Row]]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Run every case; return its rows.

    Args:
        config: the model timed and how long.
        cases: the cases to run (default: `CASES`).
        progress: called with each case's name once it is done.

    Returns:
        The rows, in the order of the cases.
    """
    demo = Demo(config)
    rows: list[Row] = []
    for case in CASES if cases is None else cases:
        done = case(demo)
        rows += done if isinstance(done, list) else [done]
        if progress is not None:
            progress(case.__name__)
    return rows
