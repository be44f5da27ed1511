"""Explain what holds a transformer's activation peak, find the trap in it, fix it, plan a budget.

The layers' children are checkpointed one by one (each norm, projection and MLP under its own
``torch.utils.checkpoint``), as accelerate's FSDP2 wrapping did: `tensorhooks.explain` shows
what holds the peak, module by module, and names the trap with its fix. Checkpointing each layer
whole instead lowers the peak; the model without any checkpointing is then planned for half of
the first peak (`plan_activations`, through `explain`'s budget), which fits when measured.

Run: python examples/explain_peak.py [--layers 8] [--budget 0.5] [--chart PATH]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

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
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, seq, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, layers: int, vocab: int = 128, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Checkpointed(nn.Module):
    """A module run through torch's checkpoint, as torch's ``checkpoint_wrapper`` runs it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args: Any) -> Any:
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the first peak")
    parser.add_argument("--chart", default=None, help="draw the first explanation here (.png)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Model(args.layers)
    tokens = torch.randint(0, 128, (4, 129), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(tokens).backward()

    # The trap: every child of every layer checkpointed on its own.
    plain = {index: dict(layer.named_children()) for index, layer in enumerate(model.layers)}
    for layer in model.layers:
        for name, child in list(layer.named_children()):
            setattr(layer, name, Checkpointed(child))
    trapped = tensorhooks.explain(model, step)
    print(trapped)
    assert [lint.code for lint in trapped.lints] == ["children-checkpointed"]
    assert trapped.attributed_fraction >= 0.95
    if args.chart:
        print(f"chart: {trapped.save_chart(args.chart)}")

    # The fix the lint names: the children as they were, each layer checkpointed whole.
    for index, layer in enumerate(model.layers):
        for name, child in plain[index].items():
            setattr(layer, name, child)
        model.layers[index] = Checkpointed(layer)
    fixed = tensorhooks.explain(model, step)
    print(
        f"\nlayers checkpointed whole: peak {fixed.peak_bytes / 2**20:.2f} MiB, was "
        f"{trapped.peak_bytes / 2**20:.2f} MiB"
    )
    assert fixed.lints == ()
    assert fixed.peak_bytes < trapped.peak_bytes

    # Or no checkpointing of its own, and the planner's cheapest plan under half the first peak.
    for index, layer in enumerate(model.layers):
        model.layers[index] = layer._checkpoint_wrapped_module
    budget = int(args.budget * trapped.peak_bytes)
    planned = tensorhooks.explain(model, step, budget)
    print("\n" + planned.plan_text())
    plan = planned.plan
    assert plan is not None
    with plan:
        step()
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= budget
    print(f"measured under the plan: {plan.measured_peak_bytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
