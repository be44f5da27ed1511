"""What a plan says in words: its table, and the report of predicted against measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GROUPED", "LEGEND", "BlockPlan", "PlanReport", "mib", "plan_table"]


def mib(nbytes: float) -> str:
    """Bytes in MiB, two decimals.

    Example:
        >>> mib(3 << 20)
        '3.00 MiB'
    """
    return f"{nbytes / (1 << 20):.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclass(frozen=True)
class BlockPlan:
    """What a plan does with one block, and what the cost model predicts of it.

    Attributes:
        name: the block's qualified name in the model.
        checkpoint: False: the block keeps what it saves; True: it is recomputed in backward,
            except the outputs of ``saved`` and ``offloaded``.
        saved: the ops whose outputs stay on the device (``"aten.mm.default#2"``: the third
            ``mm`` of the block's forward).
        offloaded: the ops whose outputs wait in host memory.
        offload_input: whether the block's inputs wait in host memory.
        recomputed: how many ops run again in its recomputation.
        device_bytes: bytes it holds on the device from its forward until its backward.
        backward_bytes: bytes it holds on the device during its backward.
        host_bytes: bytes it holds in host memory.
        seconds: what it changes in step time against recomputing all of it.
    """

    name: str
    checkpoint: bool
    saved: tuple[str, ...]
    offloaded: tuple[str, ...]
    offload_input: bool
    recomputed: int
    device_bytes: int
    backward_bytes: int
    host_bytes: int
    seconds: float

    @property
    def choice(self) -> str:
        """The choice in a few words, such as ``"recompute, save 4, offload input"``."""
        if not self.checkpoint:
            return "keep"
        words = ["recompute"]
        if self.saved:
            words.append(f"save {len(self.saved)}")
        if self.offloaded:
            words.append(f"offload {len(self.offloaded)}")
        if self.offload_input:
            words.append("offload input")
        return ", ".join(words)


def plan_table(blocks: Sequence[BlockPlan], *, exact: bool = True) -> list[str]:
    """The per-block lines of a plan: choice, ops run again, MiB held, time change; a legend.

    Every line the plan adds is at most 80 characters (block names aside), so it reads whole in
    a terminal and in a log: the number columns are as wide as their widest figure, and a choice
    too long for the room left goes on in the lines below its row, split after a comma.
    ``exact`` False adds what a grouped search means (see `tensorhooks._planner.solver`).
    """
    headers = ("again", "held", "in bwd", "host", "time")
    figures = [
        (
            f"{block.recomputed}",
            f"{block.device_bytes / (1 << 20):.2f}",
            f"{block.backward_bytes / (1 << 20):.2f}",
            f"{block.host_bytes / (1 << 20):.2f}",
            f"{block.seconds * 1e3:+.2f} ms",
        )
        for block in blocks
    ]
    widths = [  # at least as wide as a small model's figures, so that most tables look alike
        max([least, len(header), *(len(row[i]) for row in figures)])
        for i, (header, least) in enumerate(zip(headers, (5, 6, 6, 6, 9), strict=True))
    ]
    name_width = max([len("block"), *(len(block.name) for block in blocks)])
    room = _WIDTH - name_width - sum(2 + width for width in widths) - 2
    shortest = len("offload input,")  # the longest part of a choice, with its comma
    longest = max([len("choice"), *(len(block.choice) for block in blocks)])
    choice_width = min(longest, max(room, shortest))

    def line(name: str, choice: str, row: Sequence[str]) -> str:
        cells = "".join(f"  {cell:>{width}}" for cell, width in zip(row, widths, strict=True))
        return f"{name:<{name_width}}  {choice:<{choice_width}}{cells}".rstrip()

    header = line("block", "choice", headers)
    lines = [header, "-" * len(header)]
    for block, row in zip(blocks, figures, strict=True):
        first, *rest = _wrapped(block.choice, choice_width)
        lines.append(line(block.name, first, row))
        lines.extend(f"{'':<{name_width}}  {part}" for part in rest)
    return [*lines, *LEGEND, *([] if exact else GROUPED)]


_WIDTH = 80
"""The width every line of a plan's table keeps to (block names aside)."""


def _wrapped(choice: str, width: int) -> list[str]:
    """``choice`` in lines of at most ``width`` characters, split after its commas."""
    parts = choice.split(", ")
    lines = [parts[0]]
    for index, part in enumerate(parts[1:], start=2):
        comma = 1 if index < len(parts) else 0  # a part with another after it ends in one
        if len(lines[-1]) + 2 + len(part) + comma <= width:
            lines[-1] += f", {part}"
        else:
            lines[-1] += ","
            lines.append(part)
    return lines


LEGEND = (
    "again: ops run again in backward; held: MiB on the device from the forward pass",
    "to the block's backward; in bwd: MiB during it; host: MiB offloaded;",
    "time: what the choice adds to the step time against recomputing the whole block",
    "(predicted; -12.00 ms means 12 ms faster; recompute is +0.00 ms by definition)",
)
"""What the columns of `plan_table` mean, lines of at most 80 characters."""

GROUPED = (
    "some blocks had too many ways to split their ops to compare one by one: they",
    "were grouped by size. The plan fits the budget; a slightly faster one may exist.",
)
"""What a plan whose search grouped some blocks' choices (``plan.exact`` False) says."""


@dataclass(frozen=True)
class PlanReport:
    """A plan's predictions against what a planned step measured.

    Attributes:
        budget_bytes: the budget the plan was made for.
        predicted_peak_bytes: the peak of device bytes held for backward the plan predicts.
        measured_peak_bytes: the peak measured over a planned step: distinct storages saved
            for backward and still held, recomputation included, parameters and buffers left
            out; offloaded tensors count as host bytes, also where they stayed in place (a CPU).
        predicted_host_bytes: bytes the plan predicts in host memory at the end of the forward
            pass.
        measured_host_peak_bytes: the measured peak of offloaded bytes.
        predicted_step_seconds: the predicted step time.
        measured_step_seconds: the median planned step time over the timed rounds.
        measured_step_range: the fastest and slowest round.
        device: where the step ran.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_host_bytes: int
    measured_host_peak_bytes: int
    predicted_step_seconds: float
    measured_step_seconds: float
    measured_step_range: tuple[float, float]
    device: str

    @property
    def peak_error(self) -> float:
        """Measured over predicted peak, minus one (``0.01``: measured 1% above)."""
        return self.measured_peak_bytes / max(self.predicted_peak_bytes, 1) - 1.0

    @property
    def within_budget(self) -> bool:
        """Whether the measured peak is at most the budget."""
        return self.measured_peak_bytes <= self.budget_bytes

    def __str__(self) -> str:
        low, high = self.measured_step_range
        verdict = "within" if self.within_budget else "OVER"
        return "\n".join(
            [
                f"plan report ({self.device}), budget {mib(self.budget_bytes)}:",
                (
                    f"  saved-activation peak: predicted {mib(self.predicted_peak_bytes)}, "
                    f"measured {mib(self.measured_peak_bytes)} ({self.peak_error:+.1%}, "
                    f"{verdict} budget)"
                ),
                (
                    f"  host (offloaded): predicted {mib(self.predicted_host_bytes)}, measured "
                    f"peak {mib(self.measured_host_peak_bytes)}"
                ),
                (
                    f"  step time: predicted {_ms(self.predicted_step_seconds)}, measured "
                    f"{_ms(self.measured_step_seconds)} ({_ms(low)}-{_ms(high)})"
                ),
            ]
        )
