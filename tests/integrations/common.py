"""What the integration tests share: tiny Llama and GPT-2 models, batches, and what they record.

The models are built from configs (no download): hidden size 32, two layers, 64 tokens. A batch
is 4 rows of 16 tokens whose first row is left-padded (an attention mask that is not all ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorhooks

transformers = pytest.importorskip("transformers")

VOCAB = 64
ROWS, SEQ = 4, 16


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}


def built(name: str) -> nn.Module:
    """The model, seeded so that every build of one name has the same weights."""
    torch.manual_seed(0)
    return MODELS[name]().train()


def layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (Llama's ``model.layers``, GPT-2's ``transformer.h``)."""
    inner: Any = model
    stack = inner.transformer.h if hasattr(inner, "transformer") else inner.model.layers
    return list(stack)


def batch(rows: int = ROWS, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids, labels, and an attention mask with the first row's 3 first tokens masked."""
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def rows(count: int = 8) -> list[dict[str, torch.Tensor]]:
    """A dataset for the Trainer: ``count`` examples of one row each."""
    whole = batch(count, seed=2)
    return [{name: value[index] for name, value in whole.items()} for index in range(count)]


class Recomputations:
    """Whether each layer's MLP ran in a forward pass or in tensorhooks' recomputation.

    The hook sits on a module inside each layer, so it runs again when a checkpoint recomputes
    the layer. ``tensorhooks.is_recomputing()`` is True only in tensorhooks' recomputation: under
    torch's checkpoint the MLP runs twice and the hook sees False both times.
    """

    def __init__(self, model: nn.Module) -> None:
        self.seen: list[list[bool]] = [[] for _ in layers(model)]
        self._handles = [
            layer.mlp.register_forward_pre_hook(self._hook(index))
            for index, layer in enumerate(layers(model))
        ]

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                self.seen[index].append(tensorhooks.is_recomputing())

        return hook

    def by_tensorhooks(self) -> list[bool]:
        """Per layer: whether tensorhooks recomputed it at least once."""
        return [any(seen) for seen in self.seen]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def grads(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' gradients (zeros where a parameter has none)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    """Bitwise equal: recomputation runs the same kernels on the same values."""
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine, other)


def cache_length(output: Any) -> int:
    """The sequence length in a model output's KV cache (0 when there is none)."""
    cache = output.cache
    return 0 if cache is None else int(cache.get_seq_length())
