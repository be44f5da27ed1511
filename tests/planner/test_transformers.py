"""plan_activations on Hugging Face transformers models as they ship (tiny configs, built here).

Causal LMs keep ``use_cache=True`` in training; T5 has two stacks of layers; and a model may have
Hugging Face's own gradient checkpointing on. The models are built from configs (no download),
hidden size 32, two layers, sequence 16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks as th

transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def mistral() -> nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON))


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        **COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))


def qwen3() -> nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8))


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen2": qwen2,
    "qwen2_moe": qwen2_moe,
    "qwen3": qwen3,
    "gpt2": gpt2,
    "t5": t5,
    "bert": bert,
}


def built(name: str) -> tuple[nn.Module, Callable[[], None]]:
    """The model in training mode, and a step on a batch of 2 x 16 tokens.

    In float32: the mixture-of-experts layers' grouped matmul takes no float64.
    """
    torch.manual_seed(0)
    model = MODELS[name]().train()
    ids = torch.randint(3, VOCAB, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    return model, step


def grads(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' gradients, cleared from the model."""
    found = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plans_the_model_as_shipped(name: str) -> None:
    """The config as shipped (use_cache=True where it is): the plan fits, gradients unchanged."""
    model, step = built(name)
    assert getattr(model.config, "use_cache", False) or name == "bert"
    torch.manual_seed(1)  # dropout (GPT-2, T5, BERT) draws the same numbers in both steps
    step()
    reference = grads(model)
    profile = th.profile_step(model, step, rounds=1)
    plan = th.plan_activations(model, step, 0.6, profile=profile)
    assert any(block.checkpoint for block in plan.blocks)
    torch.manual_seed(1)
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    ours = grads(model)
    assert len(ours) == len(reference)
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


def test_t5_blocks_are_both_stacks() -> None:
    """T5's default blocks are its encoder's and its decoder's layers, in the order they run."""
    model, step = built("t5")
    profile = th.profile_step(model, step, rounds=1, unplanned=False)
    assert [block.name for block in profile.blocks] == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
    ]


def test_checkpointed_layers_leave_the_cache_out() -> None:
    """A checkpointed layer runs without the cache, as under Hugging Face's checkpointing."""
    model, _ = built("llama")
    ids = torch.randint(3, VOCAB, (2, 16))
    plan = th.plan_activations(model, lambda: model(input_ids=ids).logits.sum().backward(), 1.0)
    kept = model(input_ids=ids).cache
    assert kept.get_seq_length() == 16  # no plan: every layer fills the cache
    choices = [th._planner.apply.FULL] * len(plan.blocks)  # type: ignore[attr-defined]
    application = th._planner.apply.Application(plan._modules, choices)  # type: ignore[attr-defined]
    application.install()
    try:
        output = model(input_ids=ids)
    finally:
        application.remove()
    assert output.cache.get_seq_length() == 0  # every layer checkpointed
    assert torch.equal(output.logits, model(input_ids=ids).logits)


def test_gradient_checkpointing_enabled_before_planning_is_refused() -> None:
    """model.gradient_checkpointing_enable() before planning: refused, naming the fix."""
    model, step = built("llama")
    with pytest.warns(FutureWarning, match="gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()  # deprecated, still what most recipes call
    with pytest.raises(th.PlanStateError, match=r"activation_checkpointing_disable\(\)"):
        th.plan_activations(model, step, 0.5)
    model.activation_checkpointing_disable()
    th.plan_activations(model, step, 0.6)


def test_gradient_checkpointing_enabled_after_planning_is_refused() -> None:
    """Enabled after planning: applying the plan, or a step under an applied one, is refused."""
    model, step = built("qwen3")
    plan = th.plan_activations(model, step, 0.6)
    model.activation_checkpointing_enable()
    with pytest.raises(th.PlanStateError, match=r"own gradient checkpointing is on"), plan:
        pass
    model.activation_checkpointing_disable()
    with plan.apply():
        model.activation_checkpointing_enable()
        with pytest.raises(th.PlanStateError, match=r"checkpointed twice"):
            step()
    model.activation_checkpointing_disable()
    with plan:
        step()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_cache_is_turned_off_even_when_empty(name: str) -> None:
    """An empty cache (falsy: it has a length) is dropped too, by name or by position (GPT-2)."""
    model, _ = built(name)
    layer = th._planner.blocks.default_blocks(model)[0]  # type: ignore[attr-defined]
    cache = transformers.DynamicCache()
    assert not cache  # empty: a truth test would keep it
    positions = th._planner.layers.positional_names(layer.forward)  # type: ignore[attr-defined]
    hidden = torch.zeros(2, 16, 32)
    without = th._planner.layers.cache_arguments  # type: ignore[attr-defined]
    args, kwargs = without(layer, positions, (hidden,), {"cache": cache, "use_cache": True})
    assert args == (hidden,)
    assert kwargs == {"cache": None, "use_cache": False}
    args, kwargs = without(layer, positions, (hidden, cache), {"position_ids": None})
    assert args[1:] == ((None,) if name == "gpt2" else (cache,))  # only GPT-2 takes it second
    assert kwargs == {"position_ids": None}


def two_chunks(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward the first half of ``ids`` filling a cache, the second from it; backward both.

    Returns the second chunk's logits (the gradients are left in the model).
    """
    first = model(input_ids=ids[:, :8], use_cache=True)
    second = model(input_ids=ids[:, 8:], cache=first.cache, use_cache=True)
    (first.logits.square().mean() + second.logits.square().mean()).backward()
    return second.logits.detach()


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral", "gpt2"])
def test_eval_mode_keeps_the_cache(name: str) -> None:
    """Eval mode keeps the KV cache (as HF): second chunk's logits and grads are unplanned's."""
    model, step = built(name)
    plan = th.plan_activations(model, step, 0.6)
    assert plan.blocks[0].checkpoint
    ids = torch.randint(3, VOCAB, (2, 16))
    model.eval()
    reference = two_chunks(model, ids)
    expected = grads(model)
    warned = pytest.warns(th.PlanBudgetWarning, match=r"block 0 .* eval mode with a KV cache")
    with warned, plan.apply():
        logits = two_chunks(model, ids)
    assert torch.equal(logits, reference)
    for mine, theirs in zip(grads(model), expected, strict=True):
        assert torch.equal(mine, theirs)


def test_train_mode_drops_the_cache_as_hugging_face_checkpointing_does() -> None:
    """Train mode drops a checkpointed layer's cache: the chunks match HF's own checkpointing."""
    model, step = built("llama")
    profile = th.profile_step(model, step, rounds=1)
    least = th.plan_activations(model, step, 1.0, profile=profile).least_peak_bytes
    plan = th.plan_activations(model, step, least, profile=profile)
    assert all(block.checkpoint for block in plan.blocks)
    ids = torch.randint(3, VOCAB, (2, 16))
    model.activation_checkpointing_enable()
    reference = two_chunks(model, ids)
    expected = grads(model)
    model.activation_checkpointing_disable()
    with plan.apply():
        logits = two_chunks(model, ids)
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    for mine, theirs in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-8)


def test_eval_mode_with_a_cache_is_refused_at_profiling() -> None:
    """Profiling a step in eval mode that fills a cache is refused: no plan could hold there."""
    model, step = built("qwen3")
    model.eval()
    with pytest.raises(th.PlanStateError, match=r"eval mode with a KV cache .* use_cache=False"):
        th.plan_activations(model, step, 0.6)
    ids = torch.randint(3, VOCAB, (2, 16))

    def uncached() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    plan = th.plan_activations(model, uncached, 0.6)  # no cache: planned, and it holds
    with plan:
        uncached()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
