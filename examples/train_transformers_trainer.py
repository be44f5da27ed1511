"""Train a Hugging Face model with the Trainer on tensorhooks' checkpoint, then under a plan.

One call after making the Trainer, `checkpoint_trainer(trainer)`, and the layers checkpoint with
`tensorhooks.checkpoint` (the Trainer's own setup would put torch's back); with a budget,
`checkpoint_trainer(trainer, budget=...)` plans the layers with `plan_activations` from the
first training step and trains under the plan. A tiny Llama is built from its config (no
download). The script checks that tensorhooks recomputed the layers, that the plan's measured
peak is within the budget, and that the loss goes down.

Run: python examples/train_transformers_trainer.py [--budget 0.6] [--steps 30]
(--budget: bytes, a fraction of the unplanned peak, or a size such as 8GB on a real model)
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: never reach the hub

import torch
import transformers

import tensorhooks
from tensorhooks.integrations.transformers import checkpoint_trainer


def budget_of(text: str) -> int | float | str:
    """An int is bytes, a float a fraction of the unplanned peak, anything else a size."""
    if text.isdigit():
        return int(text)
    if re.fullmatch(r"\d*\.\d+", text):
        return float(text)
    return text


def make_trainer(steps: int, output_dir: str) -> Any:
    """A tiny Llama and a Trainer for it, on rows of a repeating pattern it can learn."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    pattern = torch.arange(33) % 7 + 3
    rows = [{"input_ids": pattern.roll(k), "labels": pattern.roll(k)} for k in range(16)]
    args = transformers.TrainingArguments(
        output_dir, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        activation_checkpointing=True,  # what recipes set; tensorhooks takes over after setup
        logging_steps=steps // 3, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def every_layer(steps: int, output_dir: str) -> list[float]:
    """checkpoint_trainer(trainer): each layer checkpointed by tensorhooks."""
    trainer = make_trainer(steps, output_dir)
    checkpoint_trainer(trainer)
    recomputed = []
    for layer in trainer.model.model.layers:  # counts tensorhooks' recomputations of each MLP
        layer.mlp.register_forward_pre_hook(
            lambda module, args: recomputed.append(tensorhooks.is_recomputing())
        )
    trainer.train()
    assert sum(recomputed) == 4 * steps, "every layer recomputed by tensorhooks at every step"
    print(f"every layer checkpointed: loss {losses(trainer)[0]:.3f} -> {losses(trainer)[-1]:.3f}")
    assert losses(trainer)[-1] < losses(trainer)[0]
    return losses(trainer)


def planned(steps: int, budget: int | float | str, output_dir: str) -> list[float]:
    """checkpoint_trainer(trainer, budget=...): planned at the first step."""
    trainer = make_trainer(steps, output_dir)
    callback = checkpoint_trainer(trainer, budget=budget)
    trainer.train()
    plan = callback.plan
    assert plan is not None
    print(plan)
    report = plan.report(rounds=1)  # a Trainer step on the first batch, under the plan
    print(report)
    assert report.measured_peak_bytes <= plan.budget_bytes, report
    print(f"planned: loss {losses(trainer)[0]:.3f} -> {losses(trainer)[-1]:.3f}")
    return losses(trainer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.6", help="bytes, a fraction, or a size (8GB)")
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as output_dir:
        checkpointed = every_layer(options.steps, output_dir)
        # The same training, whatever is recomputed: the same gradients, so the same losses.
        assert planned(options.steps, budget_of(options.budget), output_dir) == checkpointed
    assert tensorhooks.live_graph_tasks() == 0


if __name__ == "__main__":
    main()
