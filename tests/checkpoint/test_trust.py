"""Legitimate training code under checkpoint: plain autograd's results, or an error naming a change.

Each case runs one program three ways: plain autograd (each region a plain call), torch's
non-reentrant checkpoint, and tensorhooks.checkpoint. tensorhooks must give plain autograd's
gradients (and state after the step) without an error, or, only where the program changed what a
region read between its forward pass and backward, raise an error naming what changed. torch's
outcome is pinned beside it: where torch gives plain autograd's results, an error from
tensorhooks is a false alarm; where torch gives another gradient, the case is a silent wrong
gradient that recomputation alone produces.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError

import tensorhooks
from tensorhooks.checkpointing import checkpoint_module

Checkpoint = Callable[..., Any]
Results = list[torch.Tensor | None]


def _plain(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    for keyword in ("use_reentrant", "context_fn", "respect_saved_tensors_hooks"):
        kwargs.pop(keyword, None)
    return function(*args, **kwargs)


def _torch(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    kwargs.pop("respect_saved_tensors_hooks", None)  # a torch 2.14 keyword
    kwargs.setdefault("use_reentrant", False)
    return torch_checkpoint.checkpoint(function, *args, **kwargs)


def _ours(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("use_reentrant", False)
    return tensorhooks.checkpoint(function, *args, **kwargs)


CHECKPOINTS: dict[str, Checkpoint] = {"torch": _torch, "tensorhooks": _ours}


def _double(seed: int, *shape: int, requires_grad: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=generator, dtype=torch.float64)
    return tensor.requires_grad_(requires_grad)


def _linear(seed: int, features: int = 4) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(features, features, dtype=torch.float64)


def _assert_same(got: Results, expected: Results) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=index: f"{i}: {m}")


def _differs(got: Results, expected: Results) -> bool:
    return any(
        (a is None) != (b is None)
        or (a is not None and b is not None and (a.shape != b.shape or not torch.allclose(a, b)))
        for a, b in zip(got, expected, strict=True)
    )


def _detached(values: Any) -> Results:
    return [None if t is None else t.detach().clone() for t in values]


def _cases(variants: dict[str, str | None]) -> list[Any]:
    """(variant, implementation) parameters, for torch's checkpoint and tensorhooks'.

    Each variant maps to what tensorhooks' checkpoint did wrong before its recording of what a
    region reads was rebuilt by structure (kept as the case's history; None where it was right).
    """
    params = []
    for variant in variants:
        params.append(pytest.param(variant, "torch", id=f"{variant}-torch"))
        params.append(pytest.param(variant, "tensorhooks", id=f"{variant}-tensorhooks"))
    return params


def _judge(case: Callable[[Checkpoint], Results], implementation: str, torch_agrees: bool) -> None:
    """tensorhooks: plain autograd's results; torch: the same, or (not torch_agrees) others."""
    expected = case(_plain)
    got = case(CHECKPOINTS[implementation])
    if implementation == "torch" and not torch_agrees:
        assert _differs(got, expected), "torch's checkpoint gave plain autograd's results"
        return
    _assert_same(got, expected)


# --- 1. backward on another thread ------------------------------------------------------------

_THREAD = "recomputation on a worker thread takes the layer's bias for a replaced tensor"


def _on_threads(*functions: Callable[[], Any]) -> list[Any]:
    """Run each function on a thread of its own, at once; their results; re-raise an error."""
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def target(index: int) -> None:
        try:
            results[index] = functions[index]()
        except BaseException as error:  # re-raised on the calling thread
            errors.append(error)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(functions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _threaded(variant: str, checkpoint: Checkpoint) -> Results:
    l0, l1 = _linear(0), _linear(1)
    x = _double(2, 3, 4)
    wanted = [x, l0.weight, l1.weight, l1.bias]
    loss = checkpoint(l1, l0(x)).sum()
    if variant == "backward":
        _on_threads(loss.backward)
        return _detached(t.grad for t in wanted)
    if variant == "grad":
        return list(_on_threads(lambda: torch.autograd.grad(loss, wanted))[0])
    y = _double(3, 3, 4)
    other = checkpoint(l1, l0(y).tanh()).sum()
    first, second = _on_threads(
        lambda: torch.autograd.grad(loss, wanted),
        lambda: torch.autograd.grad(other, [y, l0.weight, l1.weight]),
    )
    return [*first, *second]


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases(dict.fromkeys(("backward", "grad", "two_threads"), _THREAD)),
)
def test_backward_on_another_thread(variant: str, implementation: str) -> None:
    """backward/autograd.grad on a worker thread, or two at once: plain autograd's gradients."""
    _judge(functools.partial(_threaded, variant), implementation, torch_agrees=True)


class _CudaBlock(nn.Module):
    """Batch norm, a mask built and kept, dropout: state and tensors a region makes, on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8, dtype=torch.float64)
        self.proj = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mask = _causal(h.shape[0]).to(h.device)
        h = nn.functional.dropout(self.proj(self.norm(h)), 0.25, training=True)
        return _attend(h, self.mask).tanh()


def _on_device(checkpoint: Checkpoint, device: str = "cuda") -> tuple[Results, Results]:
    """The gradients, and the buffers after the step, of three checkpointed blocks."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(_CudaBlock() for _ in range(3))).to(device)
    x = torch.randn(16, 8, dtype=torch.float64, device=device, requires_grad=True)
    h = x
    for block in blocks:
        h = checkpoint(block, h)
    h.pow(2).sum().backward()  # CUDA's backward runs on the device's worker thread
    state: Results = [t.detach().clone() for t in blocks.buffers()]
    return [x.grad, *(p.grad for p in blocks.parameters())], state


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_backward_on_the_device_thread() -> None:
    """On a GPU, where backward runs on a thread of its own: plain autograd's gradients.

    And its batch-norm statistics: torch's recomputation updates them a second time.
    """
    grads, state = _on_device(_plain)
    ours, our_state = _on_device(_ours)
    _assert_same(ours, grads)
    _assert_same(our_state, state)
    theirs, their_state = _on_device(_torch)
    _assert_same(theirs, grads)
    assert _differs(their_state, state)


# --- 2. tensors the region makes without grad and keeps -----------------------------------------


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu(1)  # True above the diagonal: masked


def _attend(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = (h @ h.mT).masked_fill(mask, float("-inf"))  # saves the mask
    return scores.softmax(-1) @ h


class _KeepsMask(nn.Module):
    """Builds a causal mask each call and keeps it on ``self.mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = _linear(0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mask = _causal(h.shape[0])
        return self.proj(_attend(h, self.mask))


class _CachesMask(nn.Module):
    """Caches a causal mask per sequence length, in a dict attribute or a buffer."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.proj = _linear(0)
        self.where = where
        self.masks: dict[int, torch.Tensor] = {}

    def mask(self, n: int) -> torch.Tensor:
        if self.where == "buffer":
            if not hasattr(self, f"mask{n}"):
                self.register_buffer(f"mask{n}", _causal(n), persistent=False)
            found: torch.Tensor = getattr(self, f"mask{n}")
            return found
        if n not in self.masks:
            self.masks[n] = _causal(n)
        return self.masks[n]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(_attend(h, self.mask(h.shape[0])))


def _closure_cache() -> Callable[[torch.Tensor], torch.Tensor]:
    proj = _linear(0)
    cache: dict[int, torch.Tensor] = {}

    def block(h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        if n not in cache:
            cache[n] = _causal(n)
        return proj(_attend(h, cache[n]))

    return block


class _KeepsScale(nn.Module):
    """Rebuilds a constant each call, into ``self.scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = _linear(0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.scale = torch.full((4,), 0.5, dtype=torch.float64)
        return self.proj(h).sin() * self.scale


def _closure_constant() -> Callable[[torch.Tensor], torch.Tensor]:
    proj = _linear(0)
    constants: dict[str, torch.Tensor] = {}

    def block(h: torch.Tensor) -> torch.Tensor:
        constants["scale"] = torch.full((4,), 0.5, dtype=torch.float64)
        return proj(h).sin() * constants["scale"]

    return block


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    mask: torch.Tensor


def _two_calls(block: Callable[[torch.Tensor], torch.Tensor], checkpoint: Checkpoint) -> Results:
    """Two regions of one block in one loss, on sequences of lengths 5 and 3."""
    x = _double(1, 5, 4)
    loss = checkpoint(block, x).sum() + checkpoint(block, x[:3] * 2).pow(2).sum()
    wanted = [x, *(p for p in _parameters(block))]
    return list(torch.autograd.grad(loss, wanted))


def _parameters(block: Any) -> list[torch.Tensor]:
    if isinstance(block, nn.Module):
        return list(block.parameters())
    cells = [cell.cell_contents for cell in block.__closure__ or ()]
    return [p for cell in cells if isinstance(cell, nn.Module) for p in cell.parameters()]


def _mask_output(form: str, checkpoint: Checkpoint) -> Results:
    proj = _linear(0)

    def block(h: torch.Tensor) -> Any:
        mask = _causal(h.shape[0])
        hidden = proj(_attend(h, mask))
        return (hidden, (mask,)) if form == "tuple" else _Output(hidden, mask)

    x = _double(1, 5, 4)
    out = checkpoint(block, x)
    hidden, mask = (out[0], out[1][0]) if form == "tuple" else (out.hidden, out.mask)
    loss = (hidden * (~mask[:, :4]).double()).sum()
    return [*torch.autograd.grad(loss, [x, *proj.parameters()]), mask.double()]


def _module_arguments(checkpoint: Checkpoint) -> Results:
    first, second = _linear(0), _linear(1)

    def block(h: torch.Tensor, a: nn.Module, b: nn.Module) -> Any:
        return h.sin(), [{"aux": b(a(h)).tanh()}]

    x = _double(1, 3, 4)
    out, [extra] = checkpoint(block, x, first, second)
    loss = out.sum() + extra["aux"].pow(2).sum()
    return list(torch.autograd.grad(loss, [x, *first.parameters(), *second.parameters()]))


KEPT: dict[str, Callable[[Checkpoint], Results]] = {
    "mask_on_attribute": lambda c: _two_calls(_KeepsMask(), c),
    "cache_in_attribute_dict": lambda c: _two_calls(_CachesMask("dict"), c),
    "cache_in_buffer": lambda c: _two_calls(_CachesMask("buffer"), c),
    "cache_in_closure_dict": lambda c: _two_calls(_closure_cache(), c),
    "constant_on_attribute": lambda c: _two_calls(_KeepsScale(), c),
    "constant_in_closure_dict": lambda c: _two_calls(_closure_constant(), c),
    "mask_in_nested_tuple": functools.partial(_mask_output, "tuple"),
    "mask_in_dataclass": functools.partial(_mask_output, "dataclass"),
    "modules_as_arguments": _module_arguments,
}


_REBUILT = "a tensor the second call rebuilt is taken for a replaced one in recomputation"
_NESTED_OUTPUT = "a mask returned inside a nested output is taken for a replaced tensor"
_KEPT_REASONS = {
    "mask_on_attribute": _REBUILT,
    "cache_in_attribute_dict": None,
    "cache_in_buffer": None,
    "cache_in_closure_dict": None,
    "constant_on_attribute": _REBUILT,
    "constant_in_closure_dict": _REBUILT,
    "mask_in_nested_tuple": _NESTED_OUTPUT,
    "mask_in_dataclass": _NESTED_OUTPUT,
    "modules_as_arguments": "a Parameter of a module argument is taken for a replaced tensor",
}


@pytest.mark.parametrize(("variant", "implementation"), _cases(_KEPT_REASONS))
def test_tensors_the_region_makes_and_keeps(variant: str, implementation: str) -> None:
    """Masks, caches and constants a region makes without grad and keeps: no false alarm."""
    _judge(KEPT[variant], implementation, torch_agrees=True)


# --- 3. .data swaps made during the forward pass ----------------------------------------------


class _MaxNorm(nn.Module):
    """A max-norm layer: renormalises its weight's rows through ``.data`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_double(0, 4, 4, requires_grad=False) * 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.weight.data = torch.renorm(self.weight.data, 2, 0, 1.0)
        return nn.functional.linear(h, self.weight).tanh()


def _gathered(layer: nn.Linear) -> nn.Linear:
    """ZeRO-3's way: parameters gathered in a pre-hook and released in a forward hook."""
    full = {name: p.detach().clone() for name, p in layer.named_parameters()}

    def gather(module: nn.Module, args: Any) -> None:
        for name, p in module.named_parameters():
            p.data = full[name].clone()

    def release(module: nn.Module, args: Any, output: Any) -> None:
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)

    layer.register_forward_pre_hook(gather)
    layer.register_forward_hook(release)
    layer.gather = functools.partial(gather, layer, ())  # type: ignore[assignment]
    release(layer, (), None)
    return layer


def _flattened(layer: nn.Linear) -> nn.Linear:
    """Parameters pointed into one flat buffer by a pre-hook, through ``.data`` (FSDP1's way)."""
    flat = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])

    def point(module: nn.Module, args: Any) -> None:
        offset = 0
        for p in module.parameters():
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    layer.register_forward_pre_hook(point)
    return layer


def _data_swapped(variant: str, checkpoint: Checkpoint) -> Results:
    x = _double(1, 3, 4)
    if variant == "max_norm":
        layer: nn.Module = _MaxNorm()
    elif variant == "gather_release":
        layer = _gathered(_linear(0))
    else:
        layer = _flattened(_linear(0))
    parameters = list(layer.parameters())
    loss = checkpoint(lambda h: layer(h.sin()).pow(2), x).sum()
    if variant == "gather_release":
        layer.gather()  # before backward, as ZeRO-3's pre-backward hook does
    grads = list(torch.autograd.grad(loss, [x, *parameters]))
    if variant == "gather_release":  # released again after backward: only the gradients
        return grads
    return [*grads, *_detached(parameters)]


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases(
        dict.fromkeys(
            ("max_norm", "gather_release", "flat_buffer"),
            "a .data swap made inside the region is refused as data replaced before backward",
        )
    ),
)
def test_data_swapped_in_forward(variant: str, implementation: str) -> None:
    """Idempotent ``.data`` swaps in forward (renorm, gather/release, a flat buffer): no alarm."""
    _judge(functools.partial(_data_swapped, variant), implementation, torch_agrees=True)


# --- 4. modules that write their own weights on a call ------------------------------------------

_RENORM = "an idempotent in-place renorm of a weight in forward raises CheckpointError"


class _RenormCopy(nn.Module):
    """Renormalises its weight in place under no_grad in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_double(0, 4, 4, requires_grad=False) * 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.copy_(torch.renorm(self.weight, 2, 0, 1.0))
        return nn.functional.linear(h, self.weight).tanh()


def _writes_weights(variant: str, checkpoint: Checkpoint) -> Results:
    x = _double(1, 3, 4)
    torch.manual_seed(0)
    if variant == "lazy_linear":
        layer: nn.Module = nn.LazyLinear(4, dtype=torch.float64)
        loss = checkpoint(lambda h: layer(h.sin()).pow(2), x).sum()
    elif variant == "embedding_max_norm":
        layer = nn.Embedding(6, 4, max_norm=1.0, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.mul_(3)
        index = torch.tensor([0, 2, 5])
        loss = checkpoint(lambda h, i: (layer(i) * h).tanh(), x, index).sum()
    else:
        layer = _RenormCopy()
        loss = checkpoint(lambda h: layer(h.sin()).pow(2), x).sum()
    parameters = list(layer.parameters())
    return [*torch.autograd.grad(loss, [x, *parameters]), *_detached(parameters)]


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases(
        {
            "lazy_linear": "the walk reads an UninitializedParameter's storage: ValueError",
            "embedding_max_norm": _RENORM,
            "renorm_copy": _RENORM,
        }
    ),
)
def test_weights_written_on_a_call(variant: str, implementation: str) -> None:
    """LazyLinear first called in a region, Embedding(max_norm), a no-grad renorm: no alarm."""
    _judge(functools.partial(_writes_weights, variant), implementation, torch_agrees=True)


# --- 5. nested regions --------------------------------------------------------------------------


def _grad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def wrapper(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(fn(x), [x], create_graph=True)
        return grad

    return wrapper


def _nested_tests(
    fn: Callable[[torch.Tensor], torch.Tensor], checkpoint: Checkpoint
) -> list[tuple[Callable[..., Any], tuple[Callable[..., Any], ...]]]:
    """PyTorch's test_nested_checkpoint: each function against itself wrapped in regions."""

    def c(f: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args: checkpoint(f, *args)

    g = _grad
    return [
        (fn, (c(fn), c(c(fn)))),
        (g(fn), (g(c(fn)), g(c(c(fn))))),
        (g(g(fn)), (g(c(g(fn))), c(g(g(c(fn)))), g(c(g(c(fn)))))),
        (g(g(g(fn))), (g(c(g(g(c(fn))))), g(c(g(c(g(c(fn)))))))),
    ]


def _sin_exp_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def _grads_inside(x: torch.Tensor) -> torch.Tensor:
    a, b = x.sin().exp().sin(), x.sin().exp().sin()
    torch.autograd.grad(a, [x])
    torch.autograd.grad(b, [x])
    return x.sin()


def _graph_dies(fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether every node of ``fn``'s graph is freed once its output is dropped."""

    class Handle:
        pass

    def scope() -> list[weakref.ref[Handle]]:
        out = fn(torch.randn((), dtype=torch.float64, requires_grad=True))
        refs, seen = [], set()
        queue = collections.deque([out.grad_fn])
        while queue:
            node = queue.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            handle = Handle()
            node.metadata["handle"] = handle
            refs.append(weakref.ref(handle))
            queue.extend(next_node for next_node, _ in node.next_functions)
        return refs

    return all(ref() is None for ref in scope())


NESTED = {"f": _sin_exp_sin, "g": _grads_inside}


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases({"f": None, "g": "autograd.grad inside nested regions: x taken for a replaced tensor"}),
)
def test_nested_regions_with_grad_between(variant: str, implementation: str) -> None:
    """Three levels of regions with autograd.grad(create_graph=True) between: plain's values."""
    x = _double(0)
    for expected_fn, actual_fns in _nested_tests(NESTED[variant], CHECKPOINTS[implementation]):
        expected = expected_fn(x)
        for actual_fn in actual_fns:
            torch.testing.assert_close(actual_fn(x), expected)
            assert _graph_dies(actual_fn)


def _nested_selective(checkpoint: Checkpoint) -> Results:
    w = _double(0, 4, 4)
    x = _double(1, 3, 4)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    contexts = functools.partial(tensorhooks.create_selective_checkpoint_contexts, policy)
    if checkpoint is _torch:
        contexts = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)

    def inner(h: torch.Tensor) -> torch.Tensor:
        return torch.mm(h.cos(), w).sin()

    def outer(h: torch.Tensor) -> torch.Tensor:
        out = checkpoint(inner, h.exp(), context_fn=contexts, respect_saved_tensors_hooks=True)
        return (out * h).tanh()

    return list(torch.autograd.grad(checkpoint(outer, x).sum(), [x, w]))


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases({"selective": "the inner region's saved input is taken for a replaced tensor"}),
)
def test_nested_selective_region_respecting_hooks(variant: str, implementation: str) -> None:
    """A selective region inside another, respect_saved_tensors_hooks=True: plain's gradients."""
    _judge(_nested_selective, implementation, torch_agrees=True)


# --- 6. a region reaching its block through the parent module ---------------------------------


class _Blocks(nn.Module):
    """Blocks with BatchNorm, each checkpointed through a closure over the whole model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()) for _ in range(3)
        ).double()
        self.checkpoint: Checkpoint = _plain

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.layers)):
            h = self.checkpoint(lambda a, i=i: self.layers[i](a), h)
        return h


def _through_the_parent(checkpoint: Checkpoint, *, state: bool) -> Results:
    model = _Blocks()
    model.checkpoint = checkpoint
    x = _double(1, 6, 4)
    grads = torch.autograd.grad(model(x).pow(2).sum(), [x, *model.parameters()])
    return [*grads, *(_detached(model.buffers()) if state else [])]


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases({"batch_norm": "a later block's num_batches_tracked, reached through self, raises"}),
)
def test_closure_over_the_parent_module(variant: str, implementation: str) -> None:
    """``lambda h: self.layers[i](h)`` over BatchNorm blocks: plain's gradients and statistics.

    torch's checkpoint gives plain autograd's gradients, and updates the running statistics
    twice (its recomputation runs BatchNorm again).
    """
    if implementation == "torch":
        expected = _through_the_parent(_plain, state=False)
        _assert_same(_through_the_parent(_torch, state=False), expected)
        with_state = _through_the_parent(_plain, state=True)
        assert _differs(_through_the_parent(_torch, state=True), with_state)
        return
    _assert_same(_through_the_parent(_ours, state=True), _through_the_parent(_plain, state=True))


# --- 7. state rebound on an attribute inside the region ---------------------------------------

_LAST_STATE = "silently wrong: recomputation reads the state the last call left, and rebinds it"


class _Recurrent(nn.Module):
    """A stateful RNN cell: reads ``self.hidden``, then rebinds it to the new state."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = _linear(0)
        self.hidden = torch.zeros(1, 4, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.cell(h) + self.hidden)
        self.hidden = out.detach()
        return out

    def state(self) -> Results:
        return [self.hidden]


class _RunningMean(nn.Module):
    """Rebinds ``self.mean`` to a running mean of its input, and uses it in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = _linear(0)
        self.mean = torch.zeros(4, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
        return self.proj(h - self.mean).tanh()

    def state(self) -> Results:
        return [self.mean.detach()]


class _Counted(nn.Module):
    """Counts its calls by rebinding ``self.step`` (a tensor or an int) and scales by it."""

    def __init__(self, step: torch.Tensor | int) -> None:
        super().__init__()
        self.proj = _linear(0)
        self.step = step

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.step = self.step + 1
        return self.proj(h * self.step).sin()

    def state(self) -> Results:
        return [torch.as_tensor(self.step, dtype=torch.float64)]


REBOUND: dict[str, Callable[[], Any]] = {
    "rnn_hidden": _Recurrent,
    "running_mean": _RunningMean,
    "tensor_counter": lambda: _Counted(torch.zeros((), dtype=torch.float64)),
    "int_counter": lambda: _Counted(0),
}


def _rebound(variant: str, checkpoint: Checkpoint) -> Results:
    module = REBOUND[variant]()
    x = _double(1, 3, 3, 4)
    loss = sum(checkpoint(module, x[step]).pow(2).sum() for step in range(3))
    assert isinstance(loss, torch.Tensor)
    grads = torch.autograd.grad(loss, [x, *module.parameters()])
    return [*grads, *module.state()]


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases(
        {
            "rnn_hidden": _LAST_STATE,
            "running_mean": _LAST_STATE,
            "tensor_counter": "an error that does not name the rebound counter",
            "int_counter": _LAST_STATE,
        }
    ),
)
def test_state_rebound_in_the_region(variant: str, implementation: str) -> None:
    """State rebound on an attribute (``self.h = ...``, an int counter): plain's results.

    Or, since the later calls rebind the state again before backward, an error naming the
    attribute. torch's recomputation reads the state left by the last call and rebinds it
    again: another gradient and another state after the step.
    """
    case = functools.partial(_rebound, variant)
    if implementation == "torch":
        _judge(case, implementation, torch_agrees=False)
        return
    try:
        got: Results | Exception = case(_ours)
    except (tensorhooks.SavedTensorModifiedError, CheckpointError) as error:
        got = error
    if isinstance(got, Exception):  # refused, naming what was rebound
        assert re.search(r"\.(hidden|mean|step)\b", str(got)), str(got)
        return
    _assert_same(got, case(_plain))


# --- 8. checkpoint_module with an in-place pre-hook before its region -----------------------------

_AGAIN = "silently wrong: the pre-hook writes the saved argument again in recomputation"


def _hooked(where: str, apply: Callable[[nn.Module], Any]) -> Results:
    layer = _linear(0)
    apply(layer)

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        args[0].sub_(0.5).mul_(2)

    if where == "prepend":
        handle = layer.register_forward_pre_hook(hook, prepend=True)
    else:
        handle = nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: hook(m, args) if m is layer else None
        )
    try:
        x = _double(1, 3, 4)
        out = layer(x * 1).tanh()
        return list(torch.autograd.grad(out.sum(), [x, *layer.parameters()]))
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("where", "implementation"),
    _cases(dict.fromkeys(("prepend", "global"), _AGAIN)),
)
def test_checkpoint_module_in_place_pre_hook(where: str, implementation: str) -> None:
    """A pre-hook writing the argument in place before the region: plain's gradient, or refused."""
    expected = _hooked(where, lambda module: module)
    if implementation == "torch":
        composable = pytest.importorskip("torch.distributed._composable")
        assert _differs(_hooked(where, composable.checkpoint), expected)
        return
    try:
        got: Results | CheckpointError = _hooked(where, checkpoint_module)
    except CheckpointError as error:
        got = error
    if isinstance(got, CheckpointError):  # refused, naming the hook
        assert "pre-hook of Linear" in str(got)
        return
    _assert_same(got, expected)


def _pre_hook_before(apply: Callable[[nn.Module], Any], *, input_grad: bool) -> Results:
    """A pre-hook returning new arguments, registered before the module is checkpointed."""
    weight = _double(0, 4, 4)

    class Projection(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(h, weight)

    module = Projection()
    module.register_forward_pre_hook(lambda m, args: tuple(a * 2.0 for a in args))
    apply(module)
    x = _double(1, 1, 4, requires_grad=input_grad)
    out = module(x)
    return list(torch.autograd.grad(out.sum(), [weight, x] if input_grad else [weight]))


@pytest.mark.parametrize(
    "input_grad",
    [
        pytest.param(True, id="input_requires_grad"),
        pytest.param(False, id="input_without_grad"),
    ],
)
def test_checkpoint_module_pre_hook_registered_before_it(input_grad: bool) -> None:
    """A pre-hook that runs inside the region (registered first) and doubles the argument.

    docs/differences.md promises plain autograd's gradient: the hook runs once per call, in the
    forward pass and in recomputation alike.
    """
    expected = _pre_hook_before(lambda module: module, input_grad=input_grad)
    _assert_same(_pre_hook_before(checkpoint_module, input_grad=input_grad), expected)


# --- 9 and 10. what a region read, changed between forward and backward: it must raise -----------


def _swapped(variant: str, checkpoint: Checkpoint) -> Results:
    a, b = _linear(0), _linear(1)
    x = _double(1, 3, 4)
    if variant == "dict":
        layers: Any = {"a": a, "b": b}
        out = checkpoint(lambda h: layers["a"](h).sin(), x)
        layers["a"], layers["b"] = layers["b"], layers["a"]
    elif variant == "module_list":
        layers = nn.ModuleList([a, b])
        out = checkpoint(lambda h: layers[0](h).sin(), x)
        layers[0], layers[1] = layers[1], layers[0]
    else:
        out = checkpoint(lambda h: a(h).sin(), x) + checkpoint(lambda h: b(h).cos(), x)
        a.weight, b.weight = b.weight, a.weight
    wanted = [x, *a.parameters(), *b.parameters()]
    return list(torch.autograd.grad(out.pow(2).sum(), wanted, allow_unused=True))


def _class_shift(shift: torch.Tensor) -> nn.Module:
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = _linear(0)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.proj(h + self.shift).tanh()

    Shifted.shift = shift  # type: ignore[attr-defined]  # a class-level tensor
    return Shifted()


class _AttributeShift(nn.Module):
    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.proj = _linear(0)
        self.shift = shift  # a plain attribute, no buffer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h + self.shift).tanh()


class _ClosureShift(nn.Module):
    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.proj = _linear(0)

        class Shifter(nn.Module):
            def forward(self, h: torch.Tensor) -> torch.Tensor:
                return h + shift  # a tensor of the submodule's closure

        self.shifter = Shifter()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.shifter(h)).tanh()


CHANGED: dict[str, Callable[[torch.Tensor], nn.Module]] = {
    "attribute": _AttributeShift,
    "class_attribute": _class_shift,
    "submodule_closure": _ClosureShift,
}


def _changed(variant: str, checkpoint: Checkpoint) -> Results:
    shift = torch.linspace(-1, 1, 4, dtype=torch.float64)
    module = CHANGED[variant](shift)
    x = _double(1, 3, 4)
    out = checkpoint(module, x)
    shift.add_(1)  # read by the region, not saved by plain autograd
    return list(torch.autograd.grad(out.pow(2).sum(), [x, *module.parameters()]))


def _must_raise(case: Callable[[Checkpoint], Results], implementation: str, match: str) -> None:
    """torch: a silently wrong gradient; tensorhooks: SavedTensorModifiedError matching."""
    expected = case(_plain)
    if implementation == "torch":
        assert _differs(case(_torch), expected)
        return
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match=match):
        case(_ours)


_REPLACED = r"recomputation read a different tensor|was replaced between"
_SWAPPED_IN = "silently wrong: recomputation runs the layer swapped in"


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases({"module_list": _SWAPPED_IN, "weights": None}),
)
def test_layers_swapped_before_backward_raise(variant: str, implementation: str) -> None:
    """Two layers of a ModuleList, or their weights, swapped before backward: it raises."""
    _must_raise(functools.partial(_swapped, variant), implementation, _REPLACED)


@pytest.mark.parametrize(("variant", "implementation"), _cases({"dict": _SWAPPED_IN}))
def test_layers_swapped_in_a_dict_are_read_as_they_were(variant: str, implementation: str) -> None:
    """Two layers of a dict the region holds, swapped before backward: the ones it ran run.

    An item of a container the region holds is a binding it read, set back for recomputation.
    """
    _judge(functools.partial(_swapped, variant), implementation, torch_agrees=False)


@pytest.mark.parametrize(
    ("variant", "implementation"),
    _cases(dict.fromkeys(CHANGED, "silently wrong: recomputation reads the tensor written since")),
)
def test_unsaved_tensor_changed_before_backward_raises(variant: str, implementation: str) -> None:
    """A plain attribute, class-level or closure tensor written before backward: raises, named."""
    _must_raise(functools.partial(_changed, variant), implementation, r"shift")


# --- 11. what a region writing a buffer leaves alive ------------------------------------------


class _Made(TorchDispatchMode):
    """Weak references to the storages every op makes while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[StorageWeakRef] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                self.refs.append(StorageWeakRef(tensor.untyped_storage()))
        return out

    def alive(self) -> int:
        return len({ref.cdata for ref in self.refs if not ref.expired()})


class _Average(nn.Module):
    """Keeps an exponential moving average of its output in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = _linear(0)
        self.register_buffer("average", torch.zeros(4, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.proj(h).tanh()
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * out.mean(0))
        return out


def _batch_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()).double()


WRITERS: dict[str, Callable[[], nn.Module]] = {"batch_norm": _batch_norm, "ema": _Average}


def _tensors_alive() -> int:
    # type(), not isinstance(): a deprecated torch object warns when its __class__ is read.
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


@contextlib.contextmanager
def _gc_disabled() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _step_leaves(variant: str, checkpoint: Checkpoint) -> tuple[int, int, Results]:
    """Storages and tensors a step leaves alive with gc off, and the module's state after."""
    module = WRITERS[variant]()
    x = _double(1, 6, 4)
    with _gc_disabled():
        before = _tensors_alive()
        with _Made() as made:
            loss = checkpoint(module, x).pow(2).sum()
            loss.backward()
            del loss
        leftovers = made.alive(), _tensors_alive() - before
    return (*leftovers, _detached(module.buffers()))


@pytest.mark.parametrize(
    "variant",
    [
        "batch_norm",
        "ema",
    ],
)
def test_region_writing_a_buffer_leaves_nothing_behind(variant: str) -> None:
    """With gc off, a step keeps no more alive than torch's; the state is plain autograd's."""
    ours_storages, ours_tensors, ours_state = _step_leaves(variant, _ours)
    torch_storages, torch_tensors, _ = _step_leaves(variant, _torch)
    _, _, plain_state = _step_leaves(variant, _plain)
    assert ours_storages <= torch_storages
    assert ours_tensors <= torch_tensors
    _assert_same(ours_state, plain_state)
