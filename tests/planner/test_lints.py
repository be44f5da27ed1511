"""explain's lints: each known trap reproduced and found with its fix, and not found once fixed.

The traps are set up the way they happen in the field: children of each Hugging Face decoder
layer checkpoint-wrapped (accelerate's FSDP2 wrapping did that), a selective policy testing the
wrong operator, a checkpoint around a reduction, a checkpointed layer handed the KV cache, and
saved-tensor hooks that return their input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils import checkpoint as torch_checkpoint

import tensorhooks as th
from tensorhooks._planner.lints import (
    CACHE,
    CHILDREN,
    IDENTITY,
    INPUTS,
    SAVES_EVERYTHING,
    SAVES_NOTHING,
)
from tests.planner.test_explain import Wrapped, non_reentrant, stack, stepper, wrapped

transformers = pytest.importorskip("transformers")

POLICY = torch_checkpoint.CheckpointPolicy
COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


def qwen3() -> tuple[nn.Module, Callable[[], None]]:
    """A tiny Qwen3 as shipped (use_cache=True), and its training step."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8)).train()
    ids = torch.randint(3, 64, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return model, step


def codes(explanation: th.Explanation) -> list[str]:
    return [lint.code for lint in explanation.lints]


def wrap(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def test_children_checkpointed_instead_of_the_layer() -> None:
    """Every child of each decoder layer wrapped, as accelerate's FSDP2 wrapping did: found."""
    model, step = qwen3()
    model.config.use_cache = False
    for layer in model.model.layers:
        for name, child in list(layer.named_children()):
            setattr(layer, name, wrap(child))
    explanation = th.explain(model, step)
    (lint,) = [lint for lint in explanation.lints if lint.code == CHILDREN]
    assert lint.modules == ("model.layers.0", "model.layers.1")
    assert lint.nbytes > 0
    assert "checkpoint their children (input_layernorm, mlp, post_attention_layernorm" in str(lint)
    assert "isinstance(m, Qwen3DecoderLayer)" in str(lint)
    assert "Checkpoint the layer itself" in str(lint)
    assert "trap(s) found" in str(explanation)


def test_layers_checkpointed_whole_have_no_lint() -> None:
    """The fix: each layer wrapped whole, the cache off; nothing is found."""
    model, step = qwen3()
    model.config.use_cache = False
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = wrap(layer)
    assert th.explain(model, step).lints == ()


@pytest.mark.parametrize("name", ["qwen3", "llama", "gpt2", "t5"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-checkpointing"])
def test_models_as_shipped_have_no_lint(name: str, checkpointing: bool) -> None:
    """Models as shipped, with or without Hugging Face's own checkpointing: nothing is found.

    And at least 95% of the peak is attributed to modules and ops.
    """
    from tests.planner.test_transformers import built  # transformers: imported once needed

    model, step = built(name)
    if checkpointing:
        model.activation_checkpointing_enable()
    explanation = th.explain(model, step)
    assert explanation.lints == ()
    assert explanation.attributed_fraction >= 0.95
    if checkpointing:
        assert "recomputed" in {tensor.kind for tensor in explanation.held}


def _selective(policy: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)
        return torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context)

    return run


def packet_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """The trap: a packet compared with the overload the policy is handed; never true."""
    return POLICY.MUST_SAVE if op == torch.ops.aten.addmm else POLICY.PREFER_RECOMPUTE


def overload_policy(ctx: object, op: Any, *args: object, **kwargs: object) -> object:
    """The fix: the overload's packet compared."""
    return (
        POLICY.MUST_SAVE if op.overloadpacket == torch.ops.aten.addmm else POLICY.PREFER_RECOMPUTE
    )


def save_all_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    return POLICY.MUST_SAVE


def test_policy_that_saves_nothing() -> None:
    """A policy testing ``op == torch.ops.aten.addmm`` keeps nothing: found, naming the cause."""
    model = wrapped(stack(), _selective(packet_policy))
    explanation = th.explain(model, stepper(model))
    assert codes(explanation) == [SAVES_NOTHING]
    (lint,) = explanation.lints
    assert lint.modules == ("0.block", "1.block", "2.block", "3.block")
    assert "kept none of the" in str(lint)
    assert "func.overloadpacket" in str(lint)
    fixed = wrapped(stack(), _selective(overload_policy))
    assert th.explain(fixed, stepper(fixed)).lints == ()


def test_policy_that_saves_everything() -> None:
    """A policy that saves every op: nothing recomputed, found with the bytes it keeps."""
    model = wrapped(stack(), _selective(save_all_policy))
    explanation = th.explain(model, stepper(model))
    assert codes(explanation) == [SAVES_EVERYTHING]
    (lint,) = explanation.lints
    assert lint.nbytes > 0
    assert "nothing is recomputed" in str(lint)
    assert "PREFER_RECOMPUTE" in str(lint)


class Pool(nn.Module):
    """A reduction of its input: it saves one value per row, and is handed the whole input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x.sum(-1, keepdim=True)) * 2


def test_checkpoint_whose_inputs_outweigh_its_saves() -> None:
    """A checkpointed reduction keeps its whole input to save one value per row: found."""
    model = nn.Sequential(stack(blocks=2), Wrapped(Pool(), non_reentrant))
    x = torch.randn(32, 16, requires_grad=True)
    explanation = th.explain(model, lambda: model(x).sum().backward())
    (lint,) = explanation.lints
    assert lint.code == INPUTS
    assert lint.modules == ("1.block",)
    assert lint.nbytes == 32 * 16 * 4 - 32 * 4
    assert "Remove the checkpoint there" in str(lint)


def test_blocks_checkpointed_have_no_inputs_lint() -> None:
    """A checkpointed block saves more than its input: nothing is found."""
    model = wrapped(stack(), non_reentrant)
    assert th.explain(model, stepper(model)).lints == ()


def test_cache_handed_to_a_checkpointed_layer() -> None:
    """Whole layers wrapped, the model's use_cache=True as shipped: found, naming use_cache."""
    model, step = qwen3()
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = wrap(layer)
    explanation = th.explain(model, step)
    assert codes(explanation) == [CACHE]
    (lint,) = explanation.lints
    assert lint.modules == ("model.layers.0", "model.layers.1")
    assert "called with cache=DynamicCache" in str(lint)  # transformers 5 names it cache
    assert "model.config.use_cache = False" in str(lint)


def identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@pytest.mark.parametrize(
    "hooks", [torch.autograd.graph.saved_tensors_hooks, th.saved_tensors_hooks], ids=["torch", "th"]
)
def test_hooks_that_return_their_input(hooks: Callable[..., Any]) -> None:
    """Saved-tensor hooks whose pack returns its input: found, naming the function."""
    model = stack()
    step = stepper(model)

    def hooked() -> None:
        with hooks(identity, identity):
            step()

    explanation = th.explain(model, hooked)
    assert codes(explanation) == [IDENTITY]
    (lint,) = explanation.lints
    assert lint.modules == ("tests.planner.test_lints.identity",)
    assert lint.nbytes == explanation.peak_bytes
    assert "return the tensor they are given" in str(lint)

    def copying() -> None:
        with hooks(torch.clone, identity):
            step()

    assert th.explain(model, copying).lints == ()
