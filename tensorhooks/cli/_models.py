"""The models the demo, the bench and the scripts in ``benchmarks/`` train: defined once, here."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  # the conventional name
from torch import nn

from tensorhooks._core.torch_compat import TorchDispatchMode

__all__ = [
    "Block",
    "LlamaConfig",
    "ModelConfig",
    "NoOpMode",
    "TinyLlama",
    "TinyTransformer",
    "llama_step",
    "make_batch",
    "make_tokens",
    "mlp",
]


@dataclass(frozen=True)
class ModelConfig:
    """Size of the tiny transformer and of its batches."""

    batch: int = 16
    seq: int = 64
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    vocab: int = 512
    seed: int = 0
    device: str = "cpu"


class Block(nn.Module):
    """A pre-norm transformer block whose residual adds can run in place.

    ``inplace=True`` writes the residual adds into ``x`` itself (``x.add_(...)``). ``x`` was saved
    for backward by the layer norm just before, so plain autograd refuses that code at backward;
    under ``allow_mutation_on_saved_tensors`` it gives the out-of-place gradients.
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, inplace: bool) -> torch.Tensor:
        """Attention then MLP, each with a residual add."""
        batch, seq, d_model = x.shape
        q, k, v = (
            self.qkv(self.ln1(x))
            .view(batch, seq, 3, self.heads, d_model // self.heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        # Explicit attention rather than a fused kernel: deterministic on every device, and its
        # softmax saves its own output (what a graph dropped without backward can leak).
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_model // self.heads))
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = self.proj((attention @ v).transpose(1, 2).reshape(batch, seq, d_model))
        x = x.add_(y) if inplace else x + y
        y = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x.add_(y) if inplace else x + y


class FusedAttentionBlock(nn.Module):
    """A pre-norm transformer block on ``scaled_dot_product_attention`` (causal), for benchmarks.

    The fast block the GPU benchmarks time: one input, fused attention, out-of-place residuals.
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each with a residual add."""
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyTransformer(nn.Module):
    """A small causal language model: embeddings, ``layers`` blocks, an output head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab, config.d_model)
        self.position = nn.Parameter(0.02 * torch.randn(config.seq, config.d_model))
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.heads) for _ in range(config.layers)
        )
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)
        self.register_buffer(
            "causal", torch.ones(config.seq, config.seq, dtype=torch.bool).triu(1), persistent=False
        )

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, *, inplace: bool = False
    ) -> torch.Tensor:
        """Return the mean cross-entropy of predicting ``targets`` from ``tokens``."""
        x = self.token(tokens) + self.position
        for block in self.blocks:
            x = block(x, self.causal, inplace)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def buckets(self) -> list[list[torch.Tensor]]:
        """Parameters grouped as a data-parallel reducer would: a bucket per block, plus ends."""
        ends: list[torch.Tensor] = [
            self.token.weight,
            self.position,
            *self.ln.parameters(),
            *self.head.parameters(),
        ]
        blocks: list[list[torch.Tensor]] = [list(block.parameters()) for block in self.blocks]
        return [*blocks, ends]


def make_batch(config: ModelConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the target at each position is the previous token (a learnable task)."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + step)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)
    targets = torch.roll(tokens, 1, dims=1)
    targets[:, 0] = 0
    return tokens.to(config.device), targets.to(config.device)


def mlp(layers: int, width: int = 64, *, last_relu: bool = True, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear(width, width), ReLU), seeded; ``last_relu=False`` drops the last ReLU.

    The project's CPU reference workload is ``mlp(50)`` at batch 8 on one thread.

    Example:
        >>> model = mlp(2, 4)
        >>> [type(layer).__name__ for layer in model]
        ['Linear', 'ReLU', 'Linear', 'ReLU']
    """
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*(blocks if last_relu else blocks[:-1]))


@dataclass(frozen=True)
class LlamaConfig:
    """Size of `TinyLlama` and of its batches: tiny, so that per-op costs dominate, as in tests."""

    batch: int = 2
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 4  # even-numbered layers a SwiGLU MLP, odd-numbered ones a mixture of experts
    experts: int = 4
    top_k: int = 2
    vocab: int = 256
    seed: int = 0


class RMSNorm(nn.Module):
    """Root-mean-square norm in float32, then a learned scale (Llama's)."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight``."""
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the MLP of Llama, and each expert of Mixtral."""

    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, ffn, bias=False)
        self.up = nn.Linear(d_model, ffn, bias=False)
        self.down = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP."""
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class MixtureOfExperts(nn.Module):
    """Mixtral's sparse MoE block: softmax router, top-k experts, weights renormalised in place.

    Each expert runs on the tokens routed to it, and its weighted output is added into the
    result with ``index_add_`` (Mixtral's and Qwen2-MoE's combine).
    """

    def __init__(self, d_model: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, ffn) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route every token to its ``top_k`` experts and combine their outputs."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probabilities = F.softmax(self.router(tokens), dim=-1, dtype=torch.float)
        routing_weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(-1, keepdim=True)  # in place, as in Mixtral
        routing_weights = routing_weights.to(x.dtype)
        combined = torch.zeros_like(tokens)
        expert_mask = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for index, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask[index])
            if token.numel() == 0:
                continue
            out = expert(tokens[token]) * routing_weights[token, slot, None]
            combined.index_add_(0, token, out)
        return combined.reshape(shape)


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: RMSNorm, rotary causal attention, RMSNorm, MLP or MoE."""

    def __init__(self, config: LlamaConfig, moe: bool) -> None:
        super().__init__()
        self.heads = config.heads
        self.attention_norm = RMSNorm(config.d_model)
        self.q = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o = nn.Linear(config.d_model, config.d_model, bias=False)
        self.mlp_norm = RMSNorm(config.d_model)
        self.mlp: nn.Module = (
            MixtureOfExperts(config.d_model, config.ffn, config.experts, config.top_k)
            if moe
            else SwiGLU(config.d_model, config.ffn)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention then MLP, each added to the residual stream."""
        batch, seq, d_model = x.shape
        head_dim = d_model // self.heads
        h = self.attention_norm(x)
        q, k, v = (
            proj(h).view(batch, seq, self.heads, head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim)) + mask
        attention = F.softmax(scores, dim=-1, dtype=torch.float).to(q.dtype)
        x = x + self.o((attention @ v).transpose(1, 2).reshape(batch, seq, d_model))
        mixed: torch.Tensor = self.mlp(self.mlp_norm(x))
        return x + mixed


class TinyLlama(nn.Module):
    """A tiny Llama/Mixtral-style causal language model, for overhead benchmarks on the CPU.

    Token embeddings, ``layers`` decoder layers (rotary attention with an additive causal mask,
    RMSNorm, SwiGLU MLPs alternating with Mixtral-style mixtures of experts), a final norm and an
    output head; `forward` returns the causal-LM loss (predict token ``t + 1`` from ``t``).

    Example:
        >>> config = LlamaConfig(batch=1, seq=8, d_model=16, heads=2, ffn=32, layers=2, vocab=32)
        >>> model = TinyLlama(config)
        >>> loss = model(make_tokens(config))
        >>> loss.backward()
        >>> model.head.weight.grad.shape
        torch.Size([32, 16])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        torch.manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList(
            LlamaBlock(config, moe=index % 2 == 1) for index in range(config.layers)
        )
        self.norm = RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        head_dim = config.d_model // config.heads
        inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(config.seq).float(), inverse)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        mask = torch.full((config.seq, config.seq), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting each next token of ``tokens``."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


def make_tokens(config: LlamaConfig, step: int = 0) -> torch.Tensor:
    """A seeded batch of random tokens, ``(batch, seq)``."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + step)
    return torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)


def llama_step(model: TinyLlama, tokens: torch.Tensor) -> None:
    """One training step's autograd work: forward under the caller's context, then backward."""
    backward(model(tokens))


class NoOpMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped __init_subclass__ in torch
    """A TorchDispatchMode that intercepts every operator and does nothing else.

    The floor for any feature built on a dispatch mode, such as
    ``allow_mutation_on_saved_tensors``.
    """

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, typed (it is untyped in torch's stubs)."""
    loss.backward()  # type: ignore[no-untyped-call]


def nullcontext() -> contextlib.AbstractContextManager[Any]:
    """A context that does nothing: the "plain autograd" variant of a comparison."""
    return contextlib.nullcontext()
