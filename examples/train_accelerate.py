"""Train a Hugging Face model in an accelerate loop under an activation plan: one call.

After `accelerator.prepare(...)`, `checkpoint_model(accelerator, model, budget=...)` plans the
model's layers with `plan_activations` at its first training call (that call's batch, its
loss, `accelerator.backward`) and runs every call after it under the plan; without a budget
it checkpoints every layer with `tensorhooks.checkpoint`. The loop itself is accelerate's usual
one, with gradient accumulation. A tiny GPT-2 is built from its config (no download); the script
checks the first step's gradients against the same loop without tensorhooks, the plan's
measured peak against the budget, and that the loss goes down.

Run: python examples/train_accelerate.py [--budget 0.6] [--steps 20]
(--budget: bytes, a fraction of the unplanned peak, or a size such as 8GB on a real model)
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: never reach the hub

import torch
import transformers
from accelerate import Accelerator

import tensorhooks
from tensorhooks.integrations.accelerate import checkpoint_model


def budget_of(text: str) -> int | float | str | None:
    """None, bytes (an int), a fraction of the unplanned peak (a float), or a size ("8GB")."""
    if text == "none":
        return None
    if text.isdigit():
        return int(text)
    if re.fullmatch(r"\d*\.\d+", text):
        return float(text)
    return text


def train(
    accelerator: Any, budget: int | float | str | bool | None, steps: int, batches: list[Any]
) -> tuple[list[float], list[torch.Tensor], Any]:
    """The usual loop, after checkpoint_model(..., budget) unless budget is False.

    Returns the losses, the first optimizer step's gradients, and what checkpoint_model gave.
    """
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=4, n_head=4, vocab_size=32, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpointing = None if budget is False else checkpoint_model(accelerator, model, budget=budget)
    torch.manual_seed(1)  # dropout draws the same numbers in every run
    losses, first = [], []
    for index in range(steps * accelerator.gradient_accumulation_steps):
        ids = batches[index % len(batches)]
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and not first:
                first = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first, checkpointing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.6", help="bytes, a fraction, a size, or none")
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    pattern = torch.arange(33) % 7 + 3
    batches = [torch.stack([pattern.roll(shift + row) for row in range(4)]) for shift in (0, 4)]
    _, expected, _ = train(accelerator, False, options.steps, batches)  # no tensorhooks
    budget = budget_of(options.budget)
    losses, first, checkpointing = train(accelerator, budget, options.steps, batches)
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))
    if budget is not None:
        plan = checkpointing.plan
        print(plan)
        checkpointing.remove()  # report() runs the planned step itself
        report = plan.report(rounds=1)
        print(report)
        assert report.measured_peak_bytes <= plan.budget_bytes, report
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {options.steps} steps")
    assert losses[-1] < losses[0]
    assert tensorhooks.live_graph_tasks() == 0


if __name__ == "__main__":
    main()
