"""The cost model keeps its promise on real models: measured peak ≤ budget, the least included."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  # the conventional name
from torch import nn

import tensorhooks as th
from tests.planner.test_transformers import MODELS

Case = tuple[nn.Module, Callable[[], None]]
_BATCH, _SEQ, _WIDTH = 2, 32, 64


def _tokens(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(1))


def _causal_lm(model: nn.Module) -> Callable[[], None]:
    tokens = _tokens()

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()

    return step


def gpt2() -> Case:
    """GPT-2 of transformers, built from a tiny config (no dropout: the tests compare bytes)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=_WIDTH, n_layer=2, n_head=4, vocab_size=128, n_positions=_SEQ, use_cache=False
    )
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)
    return model, _causal_lm(model)


def mixtral() -> Case:
    """Mixtral of transformers (a mixture of experts), built from a tiny config."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=_WIDTH,
        intermediate_size=2 * _WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=_SEQ,
        use_cache=False,
    )
    model = transformers.MixtralForCausalLM(config)
    return model, _causal_lm(model)


def t5() -> Case:
    """T5 of transformers (an encoder and a decoder stack), built from a tiny config."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        d_model=_WIDTH, d_ff=2 * _WIDTH, d_kv=16, num_layers=2, num_heads=4, vocab_size=128,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    return model, _causal_lm(model)


def llama() -> Case:
    """Llama of transformers, built from a tiny config (its cache on, as shipped)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=_WIDTH, intermediate_size=2 * _WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=_SEQ,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return model, _causal_lm(model)


def bert() -> Case:
    """BERT of transformers, with its masked-LM head, built from a tiny config."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4 * _WIDTH,
        vocab_size=128,
        max_position_embeddings=_SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    return model, _causal_lm(model)


class _Attention(nn.Module):
    """Pre-norm attention and MLP with residual adds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, 4, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def transformer_stack() -> Case:
    """Eight attention blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Attention(_WIDTH) for _ in range(8)))
    x = torch.randn(_BATCH, _SEQ, _WIDTH)
    return model, lambda: model(x).square().mean().backward()


def mlp_stack() -> Case:
    """Sixteen residual MLP blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Mlp(_WIDTH) for _ in range(16)))
    x = torch.randn(_BATCH * _SEQ, _WIDTH)
    return model, lambda: model(x).square().mean().backward()


def example() -> Case:
    """The model of examples/plan_activations.py."""
    path = Path(__file__).parents[2] / "examples" / "plan_activations.py"
    spec = importlib.util.spec_from_file_location("plan_activations_example", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Model(width=_WIDTH)
    tokens = torch.randint(0, 128, (_BATCH, _SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(tokens).backward()


CASES = {
    "gpt2": gpt2,
    "mixtral": mixtral,
    "bert": bert,
    "t5": t5,
    "llama": llama,
    "transformer_stack": transformer_stack,
    "mlp_stack": mlp_stack,
    "example": example,
}


def _caching_free(profile: th.StepProfile) -> th.StepProfile:
    """``profile`` where every op takes a microsecond and caching its output costs nothing.

    Timing noise out of the way, plans cache whatever fits, in every block the budget allows
    (the step is the ops' microseconds, so the grain of a plan's times is below one op's).
    """
    blocks = tuple(
        dataclasses.replace(
            block,
            ops=tuple(dataclasses.replace(op, seconds=1e-6) for op in block.ops),
            recompute_seconds=1e-6 * block.recompute_ops,
        )
        for block in profile.blocks
    )
    return dataclasses.replace(
        profile,
        blocks=blocks,
        cached_op_seconds=0.0,
        policy_op_seconds=0.0,
        checkpointed_step_seconds=1e-6 * sum(len(block.ops) for block in blocks),
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_measured_peak_within_every_budget(name: str) -> None:
    """At each budget from the least up: measured ≤ budget, within 5% of the prediction.

    Caching priced free (as `dataclasses.replace` lets a user plan for another machine) makes
    plans cache op outputs in blocks checkpointed with a selective policy next to recomputed
    blocks: where the least budget broke when a selective region held its outputs too long.
    """
    model, step = CASES[name]()
    profile = th.profile_step(model, step, rounds=1)
    for priced in (profile, _caching_free(profile)):
        first = th.plan_activations(model, step, 1.0, profile=priced)
        low, high = first.least_peak_bytes, first.unplanned_peak_bytes
        assert low <= priced.checkpointed_peak_bytes  # the least is no worse than recomputing all
        for budget in [low + (high - low) * k // 4 for k in range(4)]:
            plan = th.plan_activations(model, step, budget, profile=priced)
            with plan:
                step()
            measured = plan.measured_peak_bytes
            assert measured is not None
            assert plan.predicted_peak_bytes <= budget
            assert measured <= budget, (budget, plan.predicted_peak_bytes, measured, str(plan))
            assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prediction_within_five_percent_on_every_transformers_model(name: str) -> None:
    """Each transformers model of the suite, as shipped: measured within 5% of predicted."""
    torch.manual_seed(0)
    model = MODELS[name]().train()
    tokens = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        torch.manual_seed(2)  # dropout draws alike in every step
        model(input_ids=tokens, labels=tokens).loss.backward()

    profile = th.profile_step(model, step)
    first = th.plan_activations(model, step, 1.0, profile=profile)
    low, high = first.least_peak_bytes, first.unplanned_peak_bytes
    for budget in (low, (low + high) // 2, high):
        plan = th.plan_activations(model, step, budget, profile=profile)
        with plan:
            step()
        measured = plan.measured_peak_bytes
        assert measured is not None
        assert measured <= budget
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes
