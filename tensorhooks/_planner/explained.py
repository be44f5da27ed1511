"""What `explain` returns: the tensors held at the peak, the traps found, and a plan; in words."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .report import mib

if TYPE_CHECKING:
    from .plan import ActivationPlan

__all__ = ["Explanation", "HeldTensor", "Lint", "Row", "grouped_rows"]

_WIDTH = 80
"""The width every line of an explanation keeps to (module names aside)."""


@dataclass(frozen=True)
class HeldTensor:
    """One storage held for backward at the step's peak, and where it comes from.

    Attributes:
        module: the module whose forward saved it (``"model.layers.3.mlp.down_proj"``); the
            region's module for a checkpoint's input; ``"(model)"`` for the model's own
            forward, ``"(outside the model)"`` for the step's code around it (a loss).
        op: the op whose output it is (``"aten.mm"``), or ``"(input)"`` for a tensor made
            before the step (the batch).
        made_in: the module running that op, as ``module`` names it.
        status: ``"saved"`` (kept for backward as it is), ``"recomputed"`` (made again by a
            checkpoint's recomputation, held until backward uses it) or ``"offloaded"`` (in
            host memory).
        how: ``"checkpoint input"`` (what a checkpoint keeps to recompute from), ``"policy"``
            (an output a selective checkpoint policy kept), the name of the saved-tensor hooks
            that kept it, or ``""``.
        nbytes: bytes of its storage.
        block: the block its module is in, or None.
        saved_at: when it was saved, as a share of the step (0: the start, 1: the end).
        freed_at: when autograd let go of it, as a share of the step (1.0: held to the end).
    """

    module: str
    op: str
    made_in: str
    status: str
    how: str
    nbytes: int
    block: str | None
    saved_at: float
    freed_at: float

    @property
    def lives(self) -> float:
        """The share of the step it is held."""
        return self.freed_at - self.saved_at

    @property
    def kind(self) -> str:
        """Its status in one word for a table: ``input`` and ``policy`` are saved tensors."""
        if self.how == "checkpoint input":
            return "input"
        if self.how == "policy":
            return "policy"
        return self.status


@dataclass(frozen=True)
class Lint:
    """A known trap found in the step, what it costs, and the fix.

    Attributes:
        code: which trap: ``"children-checkpointed"``, ``"policy-saves-nothing"``,
            ``"policy-saves-everything"``, ``"inputs-larger-than-saves"``,
            ``"cache-under-checkpoint"`` or ``"identity-pack"``.
        modules: the modules (or hooks) concerned.
        nbytes: bytes of the peak it accounts for, 0 where it costs time rather than memory.
        message: what was found, what it costs, and what to change.
    """

    code: str
    modules: tuple[str, ...]
    nbytes: int
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Row:
    """Tensors held at the peak with the same module (layers merged), op and kind."""

    module: str
    op: str
    kind: str
    count: int
    nbytes: int
    lives: float
    """The longest share of the step one of them is held."""


def _pattern(name: str, blocks: Sequence[str]) -> str:
    """``name`` with the index of a stack's layer as ``*`` (``model.layers.*.mlp``)."""
    for block in blocks:
        if name == block or name.startswith(block + "."):
            parent, _, index = block.rpartition(".")
            if index.isdigit():
                return f"{parent}.*{name[len(block) :]}" if parent else f"*{name[len(block) :]}"
    return name


def grouped_rows(held: Sequence[HeldTensor], layers: Sequence[str]) -> list[Row]:
    """The tensors of ``held`` on the device, grouped into rows, the most bytes first.

    Tensors of the ``layers`` of one stack merge (``model.layers.*.mlp``).
    """
    groups: dict[tuple[str, str, str], list[HeldTensor]] = {}
    for tensor in held:
        if tensor.status == "offloaded":
            continue
        op = tensor.op.removeprefix("aten.")
        groups.setdefault((_pattern(tensor.module, layers), op, tensor.kind), []).append(tensor)
    rows = [
        Row(
            module=module,
            op=op,
            kind=kind,
            count=len(members),
            nbytes=sum(member.nbytes for member in members),
            lives=max(member.lives for member in members),
        )
        for (module, op, kind), members in groups.items()
    ]
    return sorted(rows, key=lambda row: (-row.nbytes, row.module, row.op, row.kind))


def _cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis marking the cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: Sequence[Row], peak: int, limit: int) -> list[str]:
    """The rows under their modules, the modules holding the most first; at most 80 columns.

    A module's line carries its total; its ops follow, indented, with their figures. An op name
    too long for the room left is cut (``…``). At most ``limit`` op rows are shown.
    """
    modules: dict[str, list[Row]] = {}
    for row in rows:
        modules.setdefault(row.module, []).append(row)
    order = sorted(modules, key=lambda name: (-sum(row.nbytes for row in modules[name]), name))
    headers = ("status", "n", "MiB", "peak", "lives")
    widths = (10, 4, 8, 5, 5)
    figures = sum(2 + width for width in widths)
    op_width = _WIDTH - 2 - figures

    def line(label: str, cells: Sequence[str]) -> str:
        row = "".join(
            f"  {cell:<{width}}" if index == 0 else f"  {cell:>{width}}"
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return f"{label:<{op_width + 2}}{row}".rstrip()

    lines = [line("module / op that made it", headers), "-" * _WIDTH]
    shown = 0
    for name in order:
        if shown >= limit:
            break
        members = modules[name]
        total = sum(row.nbytes for row in members)
        lines.append(f"{name}  ({total / (1 << 20):.2f} MiB, {total / max(peak, 1):.0%})")
        for row in members[: limit - shown]:
            cells = (
                row.kind,
                f"{row.count}",
                f"{row.nbytes / (1 << 20):.2f}",
                f"{row.nbytes / max(peak, 1):.0%}",
                f"{row.lives:.2f}",
            )
            lines.append(line(f"  {_cut(row.op, op_width)}", cells))
            shown += 1
    rest = rows[shown:] if shown < len(rows) else []
    hidden = [row for name in order for row in modules[name]][shown:]
    if rest and hidden:
        lines.append(f"({len(hidden)} more rows: {mib(sum(row.nbytes for row in hidden))})")
    return lines


LEGEND = (
    "saved: kept for backward; input: what a checkpoint keeps to recompute from;",
    "policy: kept by a selective checkpoint policy; recomputed: made again in",
    "backward, held until backward uses it. n: tensors; peak: their share of the",
    "peak; lives: the longest share of the step one of them is held. The layers of",
    "a stack are merged (*).",
)
"""What the columns of an explanation's table mean, lines of at most 80 characters."""


@dataclass(frozen=True)
class Explanation:
    """What holds a step's peak of saved activations, the traps found, and the plan that fits.

    Made by `tensorhooks.explain`; ``print`` it for a table of what is held at the peak (at
    most 80 columns), the traps found with their fixes, and the cheapest plan under the budget.
    `save_chart` draws the bytes each block holds over the step.

    Example:
        >>> import torch, tensorhooks
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(4, 8)
        >>> explanation = tensorhooks.explain(model, lambda: model(x).sum().backward())
        >>> [(held.module, held.op, held.status, held.nbytes) for held in explanation.held]
        [('1', 'aten.tanh', 'saved', 512), ('0', '(input)', 'saved', 128)]
        >>> explanation.peak_bytes   # tanh's output (4 x 32 floats) and the batch (4 x 8)
        640

    Attributes:
        device: where the step ran.
        peak_bytes: the measured peak of device bytes held for backward, as
            ``ActivationPlan.measured_peak_bytes`` counts them.
        host_peak_bytes: the peak of offloaded bytes.
        peak_at: when the peak was reached, as a share of the step.
        peak_in_backward: whether it was reached in the backward pass.
        backward_at: when the backward pass started, as a share of the step.
        held: every storage held at the peak, on the device and offloaded, the most bytes first.
        attributed_bytes: bytes of the peak whose module or op is known.
        blocks: the blocks the chart and the plan go by, in the order the model lists them.
        layers: the layers of the model's stacks of repeated layers, whose rows merge.
        lints: the traps found (see `Lint`), the costliest first.
        timeline: the step sampled: (share of the step, device bytes held by each block and
            then by everything else).
        budget_bytes: the budget asked for, or None.
        plan: the fastest plan whose predicted peak fits the budget, or None.
        plan_note: why there is no plan (the step checkpoints itself, the budget is below what
            any plan reaches), or None.
        unplanned_step_seconds: the step with no checkpointing, as profiled for the plan.
        checkpointed_step_seconds: the step with every block recomputed, as profiled.
    """

    device: str
    peak_bytes: int
    host_peak_bytes: int
    peak_at: float
    peak_in_backward: bool
    backward_at: float
    held: tuple[HeldTensor, ...]
    attributed_bytes: int
    blocks: tuple[str, ...]
    layers: tuple[str, ...]
    lints: tuple[Lint, ...]
    timeline: tuple[tuple[float, tuple[int, ...]], ...]
    budget_bytes: int | None = None
    plan: ActivationPlan | None = None
    plan_note: str | None = None
    unplanned_step_seconds: float | None = None
    checkpointed_step_seconds: float | None = None

    @property
    def attributed_fraction(self) -> float:
        """The share of the peak attributed to a module or an op."""
        return self.attributed_bytes / max(self.peak_bytes, 1)

    def rows(self) -> list[Row]:
        """The device tensors at the peak grouped by module (layers merged), op and status."""
        return grouped_rows(self.held, self.layers)

    def save_chart(self, path: str | Path) -> Path:
        """Draw the bytes each block holds over the step, and what is held at the peak.

        Needs matplotlib (``pip install 'tensorhooks[cli]'``).

        Args:
            path: the image to write (``.png``, ``.svg``: what matplotlib writes).

        Returns:
            The path written.

        Raises:
            ImportError: if matplotlib is not installed.
        """
        from .explain_chart import draw  # noqa: PLC0415  # matplotlib: only when drawing

        return draw(self, Path(path))

    def _header(self) -> list[str]:
        phase = "backward" if self.peak_in_backward else "forward"
        return [
            (
                f"saved-activation peak {mib(self.peak_bytes)} on {self.device}, in the {phase} "
                f"pass at {self.peak_at:.0%} of the step"
            ),
            (
                f"(host {mib(self.host_peak_bytes)}); {self.attributed_fraction:.1%} of it "
                "attributed to modules and ops"
            ),
        ]

    def plan_text(self) -> str:
        """The budget, the cheapest plan under it and what it costs in time, or why there is none.

        Empty without a budget.
        """
        return "\n".join(self._plan_lines())

    def _plan_lines(self) -> list[str]:
        if self.budget_bytes is None:
            return []
        lines = [f"budget {mib(self.budget_bytes)}:"]
        if self.peak_bytes <= self.budget_bytes:
            lines.append("the step as it runs fits the budget.")
        if self.plan is None:
            note = self.plan_note or "no plan"
            return [*lines, *textwrap.wrap(note, _WIDTH)]
        plan = self.plan
        lines.append(
            f"cheapest plan: predicted peak {mib(plan.predicted_peak_bytes)}, step "
            f"{plan.predicted_step_seconds * 1e3:.2f} ms"
        )
        anchors = []
        if self.unplanned_step_seconds:
            ratio = plan.predicted_step_seconds / self.unplanned_step_seconds - 1
            anchors.append(f"{ratio:+.0%} against no checkpointing")
        if self.checkpointed_step_seconds:
            ratio = plan.predicted_step_seconds / self.checkpointed_step_seconds - 1
            anchors.append(f"{ratio:+.0%} against every block recomputed")
        if anchors:
            lines.append(f"({', '.join(anchors)}; predicted)")
        return [*lines, *str(plan).splitlines()]

    def __str__(self) -> str:
        rows = self.rows()
        lines = [*self._header(), *_table(rows, self.peak_bytes, 20), *LEGEND]
        if self.lints:
            lines.extend(["", f"{len(self.lints)} trap(s) found:"])
            for lint in self.lints:
                lines.extend(
                    textwrap.wrap(lint.message, _WIDTH, initial_indent="- ", subsequent_indent="  ")
                )
        if self.budget_bytes is not None:
            lines.extend(["", *self._plan_lines()])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<Explanation: peak {self.peak_bytes} B, {len(self.held)} tensors held, "
            f"{len(self.lints)} lints>"
        )
