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
    a terminal and in a log. ``exact`` False adds what a grouped search means (see
    `tensorhooks._planner.solver`).
    """
    name_width = max([len("block"), *(len(block.name) for block in blocks)])
    choice_width = max([len("choice"), *(len(block.choice) for block in blocks)])
    header = (
        f"{'block':<{name_width}}  {'choice':<{choice_width}}  {'again':>5}  {'held':>6}  "
        f"{'in bwd':>6}  {'host':>6}  {'time':>9}"
    )
    return [
        header,
        "-" * len(header),
        *(
            f"{block.name:<{name_width}}  {block.choice:<{choice_width}}  "
            f"{block.recomputed:>5}  {block.device_bytes / (1 << 20):>6.2f}  "
            f"{block.backward_bytes / (1 << 20):>6.2f}  {block.host_bytes / (1 << 20):>6.2f}  "
            f"{block.seconds * 1e3:>+6.2f} ms"
            for block in blocks
        ),
        *LEGEND,
        *([] if exact else GROUPED),
    ]


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
