"""Train a Hugging Face model in a plain PyTorch loop: checkpointed layers, or a plan.

A plain loop needs no integration, one call each way:
- `checkpoint_layers(model)`: every layer checkpoints with `tensorhooks.checkpoint`, through
  transformers' own switch (the KV cache is off in training, on in evaluation);
- `tensorhooks.plan_activations(model, step, budget).apply()`: the layers are planned from one
  step (keep, recompute, or offload per op) so that the saved activations fit the budget.
A tiny Qwen3 is built from its config (no download). The script checks the first step's
gradients against the model trained with neither, the plan's measured peak against the
budget, and that the loss goes down.

Run: python examples/train_plain_loop.py [--budget 0.6] [--steps 20]
(--budget: bytes, a fraction of the unplanned peak, or a size such as 8GB on a real model)
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: never reach the hub

import torch
import transformers
from torch import nn

import tensorhooks
from tensorhooks.integrations.transformers import checkpoint_layers


def budget_of(text: str) -> int | float | str:
    """An int is bytes, a float a fraction of the unplanned peak, anything else a size."""
    if text.isdigit():
        return int(text)
    if re.fullmatch(r"\d*\.\d+", text):
        return float(text)
    return text


def make_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=32, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config).train()


def train(
    model: nn.Module, batches: list[torch.Tensor], steps: int
) -> tuple[list[float], list[torch.Tensor]]:
    """The plain loop: the losses, and the first step's gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, first = [], []
    for index in range(steps):
        ids = batches[index % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not first:
            first = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first


def check(name: str, result: tuple[list[float], list[torch.Tensor]], expected: list) -> None:
    losses, first = result
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True)), name
    print(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, first gradients unchanged")
    assert losses[-1] < losses[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.6", help="bytes, a fraction, or a size (8GB)")
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args()
    torch.set_num_threads(1)
    pattern = torch.arange(33) % 7 + 3
    batches = [torch.stack([pattern.roll(shift + row) for row in range(4)]) for shift in (0, 4)]
    _, expected = train(make_model(), batches, options.steps)

    # One call: every layer on tensorhooks' checkpoint.
    model = make_model()
    checkpoint_layers(model)
    check("every layer checkpointed", train(model, batches, options.steps), expected)

    # One call: a plan from one step of the loop, applied for the rest of training.
    model = make_model()

    def step() -> None:  # one step of the loop, as training runs it (no optimizer step)
        model(input_ids=batches[0], labels=batches[0]).loss.backward()

    plan = tensorhooks.plan_activations(model, step, budget_of(options.budget))
    print(plan)
    with plan.apply():
        check("planned", train(model, batches, options.steps), expected)
    report = plan.report(rounds=1)
    print(report)
    assert report.measured_peak_bytes <= plan.budget_bytes, report
    assert tensorhooks.live_graph_tasks() == 0


if __name__ == "__main__":
    main()
