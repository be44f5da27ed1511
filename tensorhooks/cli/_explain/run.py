"""``python -m tensorhooks explain``: `tensorhooks.explain` on the demo's tiny Llama.

The tiny Llama checkpoints itself as asked (``--checkpoint``: not at all, each layer whole, or
each layer's children one by one, the trap accelerate's FSDP2 wrapping fell into); one step is
explained: the table of what holds the peak of saved activations, the traps found with their
fixes, the cheapest plan under the budget (of the model without its wrappers, when it checkpoints
itself), and ``explain.png``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import tensorhooks
from tensorhooks.cli._models import LlamaConfig, TinyLlama, llama_step, make_tokens

__all__ = ["Checkpointed", "ExplainOptions", "checkpointed", "run_explain"]


@dataclass(frozen=True)
class ExplainOptions:
    """What ``python -m tensorhooks explain`` runs."""

    checkpoint: str = "children"
    budget: float | str = 0.5
    out: Path = Path("explain-out")


class Checkpointed(nn.Module):
    """A module run through torch's checkpoint, as torch's ``checkpoint_wrapper`` runs it.

    The module is kept under the name torch's wrapper gives it, so names read alike.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint.checkpoint(
            self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs
        )


def checkpointed(model: TinyLlama, how: str) -> TinyLlama:
    """``model`` with each layer (``layers``) or each layer's children (``children``) wrapped."""
    if how == "layers":
        for index, layer in enumerate(model.layers):
            model.layers[index] = Checkpointed(layer)
    elif how == "children":
        for layer in model.layers:
            for name, child in list(layer.named_children()):
                setattr(layer, name, Checkpointed(child))
    return model


def _table(explanation: tensorhooks.Explanation, limit: int) -> Any:
    """What holds the peak, as a rich table: the op and module columns fold, figures do not."""
    from rich import box  # noqa: PLC0415  # the cli extra
    from rich.table import Table  # noqa: PLC0415

    peak = max(explanation.peak_bytes, 1)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    table.add_column("module", overflow="fold")
    table.add_column("op", overflow="fold")
    table.add_column("status", no_wrap=True)
    for column in ("n", "MiB", "peak", "lives"):
        table.add_column(column, justify="right", no_wrap=True)
    rows = explanation.rows()
    for row in rows[:limit]:
        table.add_row(
            row.module,
            row.op,
            row.kind,
            f"{row.count}",
            f"{row.nbytes / (1 << 20):.3f}",
            f"{row.nbytes / peak:.0%}",
            f"{row.lives:.2f}",
        )
    if len(rows) > limit:
        rest = sum(row.nbytes for row in rows[limit:])
        table.add_row(f"({len(rows) - limit} more)", "", "", "", f"{rest / (1 << 20):.3f}", "", "")
    return table


def _print(console: Any, text: str) -> None:
    console.print(text, highlight=False, markup=False)


def _plan_without_wrappers(console: Any, config: LlamaConfig, budget: int) -> None:
    """The plan for the same model without its checkpoint wrappers."""
    model = TinyLlama(config)
    tokens = make_tokens(config)
    _print(console, "\nwithout its checkpoint wrappers, the cheapest plan under the budget:")
    try:
        plan = tensorhooks.plan_activations(model, lambda: llama_step(model, tokens), budget)
    except tensorhooks.PlanBudgetError as error:
        _print(console, f"none: {error}")
        return
    _print(console, str(plan))


def run_explain(
    options: ExplainOptions, stream: TextIO | None = None, width: int | None = 80
) -> int:
    """Explain one step of the tiny Llama as it checkpoints itself; draw the chart.

    Returns:
        0.
    """
    from tensorhooks.cli._console import make_console  # noqa: PLC0415  # the cli extra
    from tensorhooks.cli._environment import environment  # noqa: PLC0415

    console = make_console(stream, width)
    _print(console, f"tensorhooks explain: {environment('cpu')}")
    started = time.perf_counter()
    torch.set_num_threads(1)
    config = LlamaConfig()
    model = checkpointed(TinyLlama(config), options.checkpoint)
    tokens = make_tokens(config)
    explanation = tensorhooks.explain(model, lambda: llama_step(model, tokens), options.budget)
    _print(
        console,
        f"tiny Llama ({config.layers} layers, batch {config.batch} x {config.seq}), "
        f"checkpointing: {options.checkpoint}\n",
    )
    for line in str(explanation).splitlines()[:2]:
        _print(console, line)
    console.print(_table(explanation, 16))
    for lint in explanation.lints:
        _print(console, f"\ntrap: {lint.message}")
    _print(console, "\n" + explanation.plan_text())
    if explanation.plan is None:
        assert explanation.budget_bytes is not None
        _plan_without_wrappers(console, config, explanation.budget_bytes)
    chart = explanation.save_chart(options.out / "explain.png")
    _print(console, f"\nchart: {chart} ({time.perf_counter() - started:.0f}s)")
    return 0
