"""The picture of an explanation: the bytes each block holds over the step, and at the peak.

matplotlib is imported here only, when a chart is drawn: it comes with the ``cli`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["KINDS", "Drawn", "draw"]


class _Held(Protocol):
    @property
    def block(self) -> str | None: ...
    @property
    def status(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def nbytes(self) -> int: ...


class Drawn(Protocol):
    """What a chart is drawn from: an `Explanation` (this module does not import it)."""

    @property
    def device(self) -> str: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def peak_at(self) -> float: ...
    @property
    def backward_at(self) -> float: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def blocks(self) -> tuple[str, ...]: ...
    @property
    def timeline(self) -> tuple[tuple[float, tuple[int, ...]], ...]: ...
    @property
    def held(self) -> Sequence[_Held]: ...
    @property
    def attributed_fraction(self) -> float: ...


KINDS = ("saved", "input", "policy", "recomputed")
"""The kinds of device bytes the peak's bars are split into, in this order."""

_COLORS = {
    "saved": "tab:blue",
    "input": "tab:orange",
    "policy": "tab:purple",
    "recomputed": "tab:green",
}


def _mib(nbytes: float) -> float:
    return nbytes / (1 << 20)


def _over_the_step(axes: Any, explanation: Drawn, labels: list[str]) -> None:
    """Device bytes held per block over the step, stacked; the peak and the backward marked."""
    import matplotlib as mpl  # noqa: PLC0415  # the cli extra

    shares = [share for share, _ in explanation.timeline]
    series = [
        [_mib(parts[index]) for _, parts in explanation.timeline] for index in range(len(labels))
    ]
    colors = mpl.colormaps["viridis"].resampled(max(len(labels) - 1, 1))
    palette = [colors(index) for index in range(len(labels) - 1)] + ["tab:gray"]
    axes.stackplot(shares, series, labels=labels, colors=palette, step="post", alpha=0.85)
    axes.axvline(explanation.peak_at, color="tab:red", linestyle="--", linewidth=1)
    axes.annotate(
        f"peak {_mib(explanation.peak_bytes):.2f} MiB",
        (explanation.peak_at, _mib(explanation.peak_bytes)),
        textcoords="offset points",
        xytext=(4, -12),
        fontsize=8,
        color="tab:red",
    )
    axes.axvline(explanation.backward_at, color="tab:gray", linestyle=":", linewidth=1)
    if explanation.budget_bytes is not None:
        axes.axhline(
            _mib(explanation.budget_bytes),
            color="black",
            linestyle="-.",
            linewidth=1,
            label="budget",
        )
    axes.set_xlim(0, 1)
    axes.set_xlabel("share of the step (forward, then backward after the dotted line)")
    axes.set_ylabel("held for backward, MiB")
    axes.set_title("bytes each block holds over the step", fontsize=10)
    if len(labels) <= 12:
        axes.legend(fontsize=7, loc="upper left")


def _at_the_peak(axes: Any, explanation: Drawn, labels: list[str]) -> None:
    """One horizontal bar per block: what it holds at the peak, by kind."""
    blocks = list(explanation.blocks)
    totals = {(label, kind): 0 for label in labels for kind in KINDS}
    for tensor in explanation.held:
        if tensor.status == "offloaded":
            continue
        label = tensor.block if tensor.block is not None else labels[-1]
        kind = tensor.kind if tensor.kind in KINDS else "saved"
        totals[label, kind] += tensor.nbytes
    positions = list(range(len(labels)))
    left = [0.0] * len(labels)
    for kind in KINDS:
        widths = [_mib(totals[label, kind]) for label in labels]
        axes.barh(positions, widths, left=left, color=_COLORS[kind], label=kind)
        left = [start + width for start, width in zip(left, widths, strict=True)]
    axes.set_yticks(positions, [*blocks, labels[-1]], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("held at the peak, MiB")
    axes.set_title("what each block holds at the peak", fontsize=10)
    axes.legend(fontsize=7, loc="lower right")


def draw(explanation: Drawn, path: Path) -> Path:
    """Draw ``explanation`` to ``path``: the step on the left, the peak by block on the right."""
    from matplotlib.figure import Figure  # noqa: PLC0415  # the cli extra, slow to import

    labels = [*explanation.blocks, "outside the blocks"]
    height = 3 + 0.18 * len(labels)
    figure = Figure(figsize=(12, max(4.0, height)), layout="constrained")
    step_axes, peak_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    _over_the_step(step_axes, explanation, labels)
    _at_the_peak(peak_axes, explanation, labels)
    figure.suptitle(
        f"saved activations: peak {_mib(explanation.peak_bytes):.2f} MiB on "
        f"{explanation.device}, {explanation.attributed_fraction:.0%} attributed",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
