"""tensorhooks from the training stacks people use: one call each.

- `tensorhooks.integrations.transformers`: ``checkpoint_layers(model)`` makes a Hugging Face
  model's layers checkpoint with `tensorhooks.checkpoint` (through transformers' own switch, so
  the KV cache is turned off in training as there); ``checkpoint_trainer(trainer, budget=...)``
  does it for a ``transformers.Trainer``, surviving the Trainer's own setup, or plans the
  layers with `tensorhooks.plan_activations` on the first step.
- `tensorhooks.integrations.accelerate`: ``checkpoint_model(accelerator, model, budget=...)``,
  one call after ``accelerator.prepare(...)``.

A plain training loop needs no integration: ``tensorhooks.plan_activations(model, step,
budget).apply()``, or ``checkpoint_layers(model)`` for a Hugging Face model. See
docs/integrations.md.

Importing ``tensorhooks`` imports none of these (nor transformers or accelerate); import the
one you use.
"""

from __future__ import annotations

__all__: list[str] = []
