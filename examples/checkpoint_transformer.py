"""Train a small transformer with per-block checkpointing and matmul offloading.

Each block runs under `tensorhooks.checkpoint` with a selective policy: matmul outputs are
offloaded to (pinned) host memory through save_on_cpu, everything else is recomputed in
backward. Gradients come from `torch.autograd.grad`, which reentrant checkpoints (fairscale,
DeepSpeed, optimum-habana) refuse. The loss must go down, and the store must be empty after
every step.

Run: python examples/checkpoint_transformer.py [--steps 30]
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn
from torch.nn import functional

import tensorhooks
from tensorhooks import CheckpointPolicy

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def offload_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    if op in MATMULS:
        return CheckpointPolicy.PREFER_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(functional.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.context_fn = functools.partial(
            tensorhooks.create_selective_checkpoint_contexts, offload_matmuls
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = tensorhooks.checkpoint(block, h, context_fn=self.context_fn, use_reentrant=False)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, seq = 32, 16
    model = TinyLM(vocab, d=32, heads=4, layers=3).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    # A task the model can learn: predict the next token of a repeating pattern.
    pattern = torch.arange(seq + 1, device=device) % 7
    data = pattern.repeat(8, 1)
    losses = []
    for step in range(options.steps):
        logits = model(data[:, :-1])
        loss = functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
        grads = torch.autograd.grad(loss, params)  # works: no nested backward
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        optimizer.step()
        assert tensorhooks.live_graph_tasks() == 0
        losses.append(loss.item())
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0], "the loss should go down"


if __name__ == "__main__":
    main()
