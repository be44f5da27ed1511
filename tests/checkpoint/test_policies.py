"""Selective checkpointing: per-op save, recompute and offload; views, in-place ops, leaks."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks
from tensorhooks import CheckpointError, CheckpointPolicy, checkpoint
from tests.checkpoint.common import (
    LiveBytes,
    OpCounter,
    assert_same,
    block_of,
    grads,
    input_tensor,
    mm_policy,
    weights,
)
from tests.simdevice import simulated_device

aten = torch.ops.aten


@pytest.mark.parametrize("factory", ["tensorhooks", "torch"])
@pytest.mark.parametrize(
    ("choice", "mm_runs"),
    [
        (CheckpointPolicy.MUST_SAVE, 0),
        (CheckpointPolicy.PREFER_SAVE, 0),
        (CheckpointPolicy.MUST_CPU_OFFLOAD, 0),
        (CheckpointPolicy.PREFER_CPU_OFFLOAD, 0),
        (CheckpointPolicy.MUST_RECOMPUTE, 2),
        (CheckpointPolicy.PREFER_RECOMPUTE, 2),
    ],
)
def test_ops_run_again_per_policy(choice: CheckpointPolicy, mm_runs: int, factory: str) -> None:
    """An op marked SAVE or CPU_OFFLOAD is not run in recomputation; RECOMPUTE ones run again."""
    make = (
        tensorhooks.create_selective_checkpoint_contexts
        if factory == "tensorhooks"
        else torch_checkpoint.create_selective_checkpoint_contexts
    )
    w1, w2 = weights()
    x = input_tensor()
    out = checkpoint(
        block_of(w1, w2),
        x,
        context_fn=functools.partial(make, mm_policy(choice)),
        use_reentrant=False,
    )
    with OpCounter() as counter:
        got = torch.autograd.grad(out.sum(), [x, w1, w2])
    # The backward of each of the two mms runs two mms; recomputation adds the block's two.
    backward_mms = 4
    assert counter.counts.get(aten.mm.default, 0) == backward_mms + mm_runs
    assert_same(got, grads(lambda: block_of(w1, w2)(x), [x, w1, w2]))


def test_op_list_saves_the_listed_ops() -> None:
    """A list of ops saves those and recomputes the rest."""
    w1, w2 = weights()
    x = input_tensor()
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default, aten.sin.default]
    )
    out = checkpoint(block_of(w1, w2), x, context_fn=context_fn, use_reentrant=False)
    with OpCounter() as counter:
        out.sum().backward()
    assert counter.counts.get(aten.sin.default, 0) == 0
    assert counter.counts.get(aten.exp.default, 0) == 1


def test_offloaded_outputs_go_through_save_on_cpu() -> None:
    """CPU_OFFLOAD packs the op's output with save_on_cpu's machinery and copies it back."""
    w1, w2 = weights()
    x = input_tensor()
    with simulated_device():
        offload = tensorhooks.save_on_cpu(pin_memory=True, min_offload_bytes=0)
        context_fn = functools.partial(
            tensorhooks.create_selective_checkpoint_contexts,
            mm_policy(CheckpointPolicy.MUST_CPU_OFFLOAD),
            offload=offload,
        )
        out = checkpoint(block_of(w1, w2), x, context_fn=context_fn, use_reentrant=False)
        copied_in_forward = tensorhooks.save_on_cpu.stats("cpu").bytes_to_host
        got = torch.autograd.grad(out.sum(), [x, w1, w2])
        copied_back = tensorhooks.save_on_cpu.stats("cpu").bytes_to_device
    mm_bytes = 2 * 4 * 6 * 8  # the block's two mm outputs
    assert copied_in_forward == mm_bytes
    assert copied_back == mm_bytes
    assert_same(got, grads(lambda: block_of(w1, w2)(x), [x, w1, w2]))


def test_offload_on_a_cpu_tensor_keeps_it_and_checks_its_version() -> None:
    """On CPU an offloaded output stays put; changing it later in the region raises, as SAVE."""
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        a = torch.mm(h, w1)
        b = a.sin()
        a.mul_(2)
        return b @ w2 + a

    for choice in (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.MUST_SAVE):
        context_fn = functools.partial(
            tensorhooks.create_selective_checkpoint_contexts, mm_policy(choice)
        )
        out = checkpoint(block, x, context_fn=context_fn, use_reentrant=False)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_allow_cache_entry_mutation_recomputes_a_written_output() -> None:
    """allow_cache_entry_mutation=True: a saved output the region writes is recomputed, not reused.

    torch hands the written value back and the write is applied a second time.
    """
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        a = torch.mm(h, w1)
        a.mul_(2)
        return a.sin() @ w2

    for make in (
        tensorhooks.create_selective_checkpoint_contexts,
        torch_checkpoint.create_selective_checkpoint_contexts,
    ):
        context_fn = functools.partial(make, [aten.mm.default], True)
        assert_same(
            grads(
                lambda context_fn=context_fn: checkpoint(
                    block, x, context_fn=context_fn, use_reentrant=False
                ),
                [x, w1],
            ),
            grads(lambda: block(x), [x, w1]),
        )


def test_saved_output_written_in_region_under_allow_mutation() -> None:
    """Inside allow_mutation_on_saved_tensors a SAVE'd output written later keeps its value."""
    w1, w2 = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        a = torch.mm(h, w1)
        b = a.sin()
        a.mul_(2)
        return b @ w2 + a.exp()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    with tensorhooks.allow_mutation_on_saved_tensors():
        loss = checkpoint(block, x, context_fn=context_fn, use_reentrant=False).sum()
        first = torch.autograd.grad(loss, [x, w1], retain_graph=True)
        second = torch.autograd.grad(loss, [x, w1])
        expected = torch.autograd.grad(block(x).sum(), [x, w1])
    assert_same(first, expected)
    assert_same(second, expected)


def test_selective_retain_graph_twice() -> None:
    """A selectively checkpointed region can be backwarded twice (torch raises)."""
    w1, w2 = weights()
    x = input_tensor()
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    loss = checkpoint(block_of(w1, w2), x, context_fn=context_fn, use_reentrant=False).sum()
    first = torch.autograd.grad(loss, [x, w1], retain_graph=True)
    second = torch.autograd.grad(loss, [x, w1])
    assert_same(first, second)


def test_selective_mismatch_raises_checkpoint_error() -> None:
    """Recomputation running an op the forward pass did not run raises CheckpointError."""
    w1, _ = weights()
    x = input_tensor()
    flip = {"on": False}
    on = flip.get  # a reader: recomputation reads the closure's own bindings as at the call

    def block(h: torch.Tensor) -> torch.Tensor:
        a = torch.mm(h, w1).sin()
        return a.cos().cos() if on("on") else a.exp()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    out = checkpoint(block, x, context_fn=context_fn, early_stop=False, use_reentrant=False)
    flip["on"] = True
    with pytest.raises(CheckpointError, match="not in the forward pass"):
        out.sum().backward()


@pytest.mark.parametrize(
    ("argument", "error", "message"),
    [
        ([aten.mm], tensorhooks.CheckpointArgumentValueError, "update the OpOverloadPacket"),
        (3, tensorhooks.CheckpointArgumentTypeError, "a function or a list"),
    ],
)
def test_selective_contexts_reject_bad_policies(
    argument: Any, error: type[Exception], message: str
) -> None:
    """Only OpOverload lists and callables are policies."""
    with pytest.raises(error, match=message):
        tensorhooks.create_selective_checkpoint_contexts(argument)


def test_policy_returning_garbage_raises() -> None:
    """A policy that returns something other than a CheckpointPolicy or bool raises."""
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, lambda *a, **k: "save"
    )
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match="return a CheckpointPolicy"):
        checkpoint(torch.sin, input_tensor(), context_fn=context_fn, use_reentrant=False)


def test_offload_must_be_save_on_cpu() -> None:
    """offload= takes a tensorhooks.save_on_cpu."""
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match="save_on_cpu"):
        tensorhooks.create_selective_checkpoint_contexts([], offload=object())  # type: ignore[arg-type]


# --- views, in-place ops and what recomputation hands out -----------------------------------------


def _save_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def _slicing_block(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(h: torch.Tensor) -> torch.Tensor:
        a = h @ w
        return a[:, :3].sin().sum() + (a.t() * 2).exp().sum() + a.split(2, dim=1)[1].cos().sum()

    return block


FACTORIES = {
    "tensorhooks": tensorhooks.create_selective_checkpoint_contexts,
    "torch": torch_checkpoint.create_selective_checkpoint_contexts,
}


@pytest.mark.parametrize("factory", sorted(FACTORIES))
def test_saved_views_work_with_retain_graph_and_double_backward(factory: str) -> None:
    """A policy saving view ops: a second backward and double backward give plain gradients."""
    w, _ = weights()
    x = input_tensor()
    block = _slicing_block(w)
    context_fn = functools.partial(FACTORIES[factory], _save_everything)
    out = checkpoint(block, x, context_fn=context_fn, use_reentrant=False)
    first = torch.autograd.grad(out, [x, w], retain_graph=True)
    second = torch.autograd.grad(out, [x, w])
    expected = torch.autograd.grad(block(x), [x, w])
    assert_same(first, expected)
    assert_same(second, expected)
    (gx,) = torch.autograd.grad(
        checkpoint(block, x, context_fn=context_fn, use_reentrant=False), [x], create_graph=True
    )
    (plain_gx,) = torch.autograd.grad(block(x), [x], create_graph=True)
    assert_same(torch.autograd.grad(gx.sum(), [w]), torch.autograd.grad(plain_gx.sum(), [w]))


def test_view_ops_are_replayed_not_served() -> None:
    """View ops run again in recomputation whatever the policy says; the saved mm does not."""
    w, _ = weights()
    x = input_tensor()
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _save_everything
    )

    def block(h: torch.Tensor) -> torch.Tensor:
        a = h @ w
        return (a.t()[1:] * 1).sin().sum()

    out = checkpoint(block, x, context_fn=context_fn, use_reentrant=False)
    with OpCounter() as counter:
        got = torch.autograd.grad(out, [x, w])
    assert counter.counts.get(aten.t.default, 0) >= 1  # replayed
    assert counter.counts.get(aten.slice.Tensor, 0) >= 1
    assert counter.counts.get(aten.mm.default, 0) == 2  # backward's two, none recomputed
    assert_same(got, torch.autograd.grad(block(x), [x, w]))


@pytest.mark.parametrize("factory", sorted(FACTORIES))
@pytest.mark.parametrize(
    "choice",
    [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_CPU_OFFLOAD,
        CheckpointPolicy.MUST_RECOMPUTE,
    ],
)
def test_no_storage_outlives_backward(factory: str, choice: CheckpointPolicy) -> None:
    """Every tensor a selective region makes, forward and recomputation, dies after backward."""
    w, _ = weights()
    made: list[weakref.ref[torch.Tensor]] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            made.extend(weakref.ref(t) for t in _tensors(out))
            return out

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return choice

    context_fn = functools.partial(FACTORIES[factory], policy)
    block = _slicing_block(w)
    for _ in range(3):
        x = input_tensor()
        with Spy():
            out = checkpoint(block, x, context_fn=context_fn, use_reentrant=False)
            torch.autograd.grad(out, [x, w])
        del out, x
    gc.collect()
    assert made
    assert [ref() for ref in made if ref() is not None] == []


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def test_saved_output_written_by_the_region_names_the_op_and_policy() -> None:
    """MUST_SAVE on an output the region then writes: autograd's error naming op and policy."""
    w, _ = weights()
    x = input_tensor()

    def attention(h: torch.Tensor) -> torch.Tensor:
        scores = h @ w
        scores.mul_(0.5)
        return scores.softmax(-1).sum()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _save_everything
    )
    out = checkpoint(attention, x, context_fn=context_fn, use_reentrant=False)
    with pytest.raises(
        tensorhooks.SavedTensorModifiedError,
        match=r"(?s)modified by an inplace operation.*aten\.mm\.default \(call 0\).*\(MUST_SAVE\)"
        r".*allow_cache_entry_mutation=True",
    ):
        torch.autograd.grad(out, [x])


def test_saved_view_written_after_forward_raises() -> None:
    """A saved output written through a view before backward raises, never a silent gradient."""
    w, _ = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = h @ w
        return a[:, :2], a.exp().sum()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _save_everything
    )
    view, out = checkpoint(block, x, context_fn=context_fn, use_reentrant=False)
    with torch.no_grad():
        view.mul_(2)
    with pytest.raises(tensorhooks.SavedTensorModifiedError, match="selective checkpoint policy"):
        torch.autograd.grad(out, [x])


def test_save_everything_with_dropout_under_allow_mutation() -> None:
    """A save-all policy over dropout inside allow_mutation gives plain autograd's gradient."""
    w, _ = weights()
    x = input_tensor()

    def block(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(h @ w, 0.5, training=True).sin().sum()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _save_everything
    )
    torch.manual_seed(3)
    with tensorhooks.allow_mutation_on_saved_tensors():
        got = torch.autograd.grad(
            checkpoint(block, x, context_fn=context_fn, use_reentrant=False), [x, w]
        )
    torch.manual_seed(3)
    assert_same(got, torch.autograd.grad(block(x), [x, w]))


@pytest.mark.parametrize(("respect", "packed_outputs"), [(None, 0), (False, 0), (True, 2)])
def test_respect_saved_tensors_hooks(respect: bool | None, packed_outputs: int) -> None:
    """respect_saved_tensors_hooks=True sends the outputs a policy saves through outer hooks."""
    w1, w2 = weights()
    x = input_tensor()
    shapes: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tensor.shape)
        return tensor.clone()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    with tensorhooks.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = checkpoint(
            block_of(w1, w2),
            x,
            context_fn=context_fn,
            respect_saved_tensors_hooks=respect,
            use_reentrant=False,
        )
    assert len(shapes) == 1 + packed_outputs  # the region's input, then the saved mm outputs
    assert_same(grads(lambda: out, [x, w1, w2]), grads(lambda: block_of(w1, w2)(x), [x, w1, w2]))


def test_respect_saved_tensors_hooks_takes_a_bool() -> None:
    """Anything but None or a bool is refused, naming the value."""
    with pytest.raises(tensorhooks.CheckpointArgumentTypeError, match="got 'yes' of type str"):
        checkpoint(
            torch.sin, input_tensor(), respect_saved_tensors_hooks="yes", use_reentrant=False
        )  # type: ignore[arg-type]


def test_policy_sees_the_output_on_every_release() -> None:
    """ctx.op_output is the op's output, also where torch's context lacks the argument."""
    outputs: list[torch.Tensor] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == aten.mm.default:
            outputs.append(ctx.op_output)
        return CheckpointPolicy.PREFER_RECOMPUTE

    w1, w2 = weights()
    x = input_tensor()
    context_fn = functools.partial(tensorhooks.create_selective_checkpoint_contexts, policy)
    out = checkpoint(block_of(w1, w2), x, context_fn=context_fn, use_reentrant=False)
    assert len(outputs) == 2
    assert outputs[0].shape == (4, 6)
    del out


# What selective checkpointing may hold, against torch's with the same policy: a stack of blocks
# of random widths and kinds, checkpointed one region per block, measured op by op (LiveBytes).

_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})
_NONLINEAR = frozenset({aten.relu.default, aten.tanh.default, aten._softmax.default})


def _saving(ops: frozenset[Any], choice: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return choice if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


# name: (tensorhooks' policy, torch's): an offloaded output is held in host memory, which on a
# machine without an accelerator is the memory torch's would hold had it saved the output.
_POLICIES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "matmuls": (
        _saving(_MATMULS, CheckpointPolicy.MUST_SAVE),
        _saving(_MATMULS, CheckpointPolicy.MUST_SAVE),
    ),
    "nonlinear": (
        _saving(_NONLINEAR, CheckpointPolicy.PREFER_SAVE),
        _saving(_NONLINEAR, CheckpointPolicy.PREFER_SAVE),
    ),
    "everything": (_save_all, _save_all),
    "offload matmuls": (
        _saving(_MATMULS, CheckpointPolicy.MUST_CPU_OFFLOAD),
        _saving(_MATMULS, CheckpointPolicy.MUST_SAVE),
    ),
}


class _Block(torch.nn.Module):
    """A residual block: an MLP, or attention over the rows (softmax), then an MLP."""

    def __init__(self, width: int, attention: bool) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width, dtype=torch.float64) if attention else None
        self.up = torch.nn.Linear(width, 4 * width, dtype=torch.float64)
        self.down = torch.nn.Linear(4 * width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            x = x + torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return x + self.down(torch.relu(self.up(x)).tanh())


def _held_in_backward(
    blocks: list[_Block],
    x: torch.Tensor,
    run: Callable[..., Any],
    policy: Callable[..., Any] | None,
    make: Callable[..., Any],
    *,
    variant: str,
) -> tuple[int, list[torch.Tensor]]:
    """The peak bytes of a step over the checkpointed stack, and its gradients."""
    # No policy at all: plain full recomputation, through checkpoint's default context_fn.
    context_fn: Callable[[], Any] = torch_checkpoint.noop_context_fn
    if policy is not None:
        context_fn = functools.partial(make, policy)
    params = [p for block in blocks for p in block.parameters()]
    for p in params:
        p.grad = None
    with LiveBytes() as live:
        h = x
        for block in blocks:
            h = run(block, h, use_reentrant=False, context_fn=context_fn)
        loss = h.square().sum()
        if variant == "grad":
            got = list(torch.autograd.grad(loss, params))
        else:
            loss.backward(retain_graph=variant == "retain_graph")
            got = [p.grad for p in params]
    return live.peak, [g.clone() for g in got]


@settings(max_examples=12, deadline=None, database=None)
@given(
    width=st.sampled_from([4, 8, 16]),
    attention=st.lists(st.booleans(), min_size=2, max_size=5),
    name=st.sampled_from([*sorted(_POLICIES), "no policy"]),
    variant=st.sampled_from(["backward", "grad", "retain_graph"]),
)
def test_selective_regions_hold_no_more_than_torch(
    width: int, attention: list[bool], name: str, variant: str
) -> None:
    """A checkpointed stack never holds more bytes than torch's with the same policy, or none."""
    torch.manual_seed(0)
    blocks = [_Block(width, kind) for kind in attention]
    x = torch.randn(2 * width, width, dtype=torch.float64, requires_grad=True)
    ours, theirs = _POLICIES.get(name, (None, None))
    th_peak, th_grads = _held_in_backward(
        blocks,
        x,
        checkpoint,
        ours,
        tensorhooks.create_selective_checkpoint_contexts,
        variant=variant,
    )
    torch_peak, torch_grads = _held_in_backward(
        blocks,
        x,
        torch_checkpoint.checkpoint,
        theirs,
        torch_checkpoint.create_selective_checkpoint_contexts,
        variant=variant,
    )
    assert th_peak <= torch_peak, (th_peak, torch_peak)
    assert_same(th_grads, torch_grads)


def test_second_backward_runs_consumed_ops_again() -> None:
    """Saved outputs are consumed by the first backward; a retained graph's second runs them."""
    w1, w2 = weights()
    x = input_tensor()
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    loss = checkpoint(block_of(w1, w2), x, context_fn=context_fn, use_reentrant=False).sum()
    runs = []
    for retain in (True, False):
        with OpCounter() as counter:
            got = torch.autograd.grad(loss, [x, w1], retain_graph=retain)
        runs.append(counter.counts.get(aten.mm.default, 0))
        assert_same(got, grads(lambda: block_of(w1, w2)(x), [x, w1]))
    # Both backward calls run backward's three matmuls; the first reads the region's two from
    # what the policy saved, the second runs them again.
    assert runs == [3, 5]


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_layers_hold_no_more_than_torch(name: str) -> None:
    """GPT-2 and BERT layers under "save matmuls" hold no more than torch's checkpoint."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32, use_cache=False
        )
        config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
        model = transformers.GPT2LMHeadModel(config)
        layers = list(model.transformer.h)
    else:
        config = transformers.BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            vocab_size=128,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = transformers.BertForMaskedLM(config)
        layers = list(model.bert.encoder.layer)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    policy = _POLICIES["matmuls"][0]
    peaks = {}
    for run, make in (
        (checkpoint, tensorhooks.create_selective_checkpoint_contexts),
        (torch_checkpoint.checkpoint, torch_checkpoint.create_selective_checkpoint_contexts),
    ):
        originals = [layer.forward for layer in layers]
        for layer, forward in zip(layers, originals, strict=True):
            layer.forward = functools.partial(
                run, forward, use_reentrant=False, context_fn=functools.partial(make, policy)
            )
        try:
            with LiveBytes() as live:
                model(input_ids=tokens, labels=tokens).loss.backward()
        finally:
            for layer, forward in zip(layers, originals, strict=True):
                layer.forward = forward
        model.zero_grad(set_to_none=True)
        peaks[run] = live.peak
    assert peaks[checkpoint] <= peaks[torch_checkpoint.checkpoint]
