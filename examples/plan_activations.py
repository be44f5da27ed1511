"""Plan a small transformer's activations under a memory budget, then train with the plan.

`tensorhooks.plan_activations` profiles one step, then chooses per block what to keep, what to
recompute and (with a host link) what to offload, so that the bytes autograd holds for backward
stay under the budget at the least predicted step time. The plan is printed, checked against a
measured step, and applied to a few training steps on batches of other lengths (as a collator
padding each batch to its longest row gives them): every step's measured peak must be within the
budget, the loss must go down and the gradients of the first step must equal the unplanned
model's.

On a GPU the host link is measured and offloading enters the plans by itself; here, on a CPU,
``--bandwidth`` simulates one (the tensors stay in place and count as host bytes).

Run: python examples/plan_activations.py [--budget 0.5] [--steps 8] [--bandwidth GBPS]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional

import tensorhooks


class Block(nn.Module):
    """Pre-norm attention and MLP, residual adds."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, seq, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(functional.gelu(self.up(self.mlp_norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))  # the blocks
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the unplanned peak")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bandwidth", type=float, default=None, help="simulated link, GB/s")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Model().double()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (8, 65), generator=generator)
    tokens[:, 1::2] = tokens[:, 0::2][:, : tokens[:, 1::2].shape[1]]  # a pattern to learn

    def step() -> torch.Tensor:
        loss = model(tokens)
        loss.backward()
        return loss

    step()
    unplanned = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad()

    bandwidth = None if args.bandwidth is None else args.bandwidth * 1e9
    plan = tensorhooks.plan_activations(
        model, step, args.budget, bandwidth=bandwidth, min_offload_bytes=16 << 10
    )
    print(plan)
    report = plan.report()
    print(report)
    assert report.measured_peak_bytes <= plan.budget_bytes, report
    assert abs(report.peak_error) <= 0.05, report

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    lengths = [65, 81, 49, 73]  # the plan was profiled on 65 tokens: longer batches come too
    for index in range(args.steps):
        batch = torch.cat([tokens, tokens[:, 1:]], dim=1)[:, : lengths[index % len(lengths)]]
        optimizer.zero_grad()
        with plan:  # measures this step; a longer batch is planned for before it runs
            loss = model(batch)
            loss.backward()
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= plan.budget_bytes, (batch.shape, plan)
        losses.append(loss.item())
        if index == 0:
            grads = [parameter.grad for parameter in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(grads, unplanned, strict=True))
        optimizer.step()
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} planned steps on batches of "
        f"{sorted(set(lengths))} tokens; planned again for {plan.replans} longer ones"
    )
    assert losses[-1] < losses[0]
    assert tensorhooks.live_graph_tasks() == 0


if __name__ == "__main__":
    main()
