"""``python -m tensorhooks demo``: train a tiny transformer under every feature, check gradients.

Each training step runs the same batch once with plain autograd and once under every feature of
this build, in an order that rotates from step to step, and times each run. Each feature's
gradients are compared with plain autograd's (exactly; on CUDA within a tolerance for
non-deterministic kernels). The optimizer then steps with plain autograd's gradients, so every
feature sees the same weights. What each feature did is counted from the outside, with hooks and
counters the demo owns: bytes saved for backward, bytes kept off the device, saved tensors changed
in place, hooks fired.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812  # the conventional name
from torch import nn

import tensorhooks

from ._console import Console

__all__ = ["DemoConfig", "DemoResult", "FeatureRow", "TinyTransformer", "run_demo"]

_T = TypeVar("_T")

DISABLED_MESSAGE = "saved-tensor hooks are disabled in this region of the demo model"


@dataclass(frozen=True)
class DemoConfig:
    """Size of the demo model and run."""

    steps: int = 8
    batch: int = 16
    seq: int = 64
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    vocab: int = 512
    lr: float = 3e-3
    seed: int = 0
    device: str = "cpu"


@dataclass
class FeatureRow:
    """One line of the demo's table."""

    feature: str
    what: str = ""
    max_diff: float = 0.0
    exact: bool = True
    matched: bool = True
    times: list[float] = field(default_factory=list)
    error: str | None = None

    def compare(
        self, grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]
    ) -> None:
        """Fold one step's gradients, compared with the reference's, into the row."""
        difference, within = _max_difference(grads, reference)
        self.max_diff = max(self.max_diff, difference)
        self.exact = self.exact and difference == 0.0
        self.matched = self.matched and within

    def time_ratio(self, reference: Sequence[float]) -> float | None:
        """Fastest step over the reference's fastest, skipping the first (warm-up) step.

        The fastest step, not the median: on a shared machine other processes only ever add
        time, so the minimum of a few steps is the steadiest estimate of a step's own cost.
        """
        mine, theirs = self.times[1:] or self.times, list(reference[1:] or reference)
        if not mine or not theirs:
            return None
        return min(mine) / min(theirs)


@dataclass
class DemoResult:
    """Everything the demo measured."""

    config: DemoConfig
    rows: list[FeatureRow]
    losses: list[float]
    parameters: int

    @property
    def all_matched(self) -> bool:
        """Whether every feature reproduced plain autograd's gradients."""
        return all(row.matched for row in self.rows)


# ---------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    """A pre-norm transformer block whose residual adds can run in place.

    ``inplace=True`` writes the residual adds into ``x`` itself (``x.add_(...)``). ``x`` was saved
    for backward by the layer norm just before, so plain autograd refuses that code at backward;
    under ``allow_mutation_on_saved_tensors`` it must give the out-of-place gradients.
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, inplace: bool) -> torch.Tensor:
        """Attention then MLP, each with a residual add."""
        batch, seq, d_model = x.shape
        q, k, v = (
            self.qkv(self.ln1(x))
            .view(batch, seq, 3, self.heads, d_model // self.heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        # Explicit attention rather than a fused kernel: deterministic on every device.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_model // self.heads))
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        y = self.proj((attention @ v).transpose(1, 2).reshape(batch, seq, d_model))
        x = x.add_(y) if inplace else x + y
        y = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x.add_(y) if inplace else x + y


class TinyTransformer(nn.Module):
    """A small causal language model: embeddings, ``layers`` blocks, a tied-free output head."""

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab, config.d_model)
        self.position = nn.Parameter(0.02 * torch.randn(config.seq, config.d_model))
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.heads) for _ in range(config.layers)
        )
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)
        self.register_buffer(
            "causal", torch.ones(config.seq, config.seq, dtype=torch.bool).triu(1), persistent=False
        )

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        inplace: bool = False,
        block_context: Callable[
            [], contextlib.AbstractContextManager[Any]
        ] = contextlib.nullcontext,
    ) -> torch.Tensor:
        """Return the mean cross-entropy of predicting ``targets`` from ``tokens``."""
        x = self.token(tokens) + self.position
        for block in self.blocks:
            with block_context():
                x = block(x, self.causal, inplace)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def buckets(self) -> list[list[torch.Tensor]]:
        """Parameters grouped as a data-parallel reducer would: a bucket per block, plus ends."""
        ends: list[torch.Tensor] = [
            self.token.weight,
            self.position,
            *self.ln.parameters(),
            *self.head.parameters(),
        ]
        blocks: list[list[torch.Tensor]] = [list(block.parameters()) for block in self.blocks]
        return [*blocks, ends]


def make_batch(config: DemoConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the target at each position is the previous token (a learnable task)."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + step)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq), generator=generator)
    targets = torch.roll(tokens, 1, dims=1)
    targets[:, 0] = 0
    return tokens.to(config.device), targets.to(config.device)


# ---------------------------------------------------------------------------------------------
# Instrumentation


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), storage.nbytes())


@dataclass
class SavedCensus:
    """Tensors saved for backward by one forward pass, counted by a pack hook."""

    tensors: int = 0
    activation_bytes: int = 0
    changed_in_place: int = 0
    changed_bytes: int = 0


def census(
    model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor], *, inplace: bool
) -> SavedCensus:
    """Count what one forward pass saves for backward, and what it then changes in place.

    Uses torch's own hooks so that the count does not depend on the code being demonstrated.
    Parameters are not counted as activations; storages saved twice count once. No backward
    runs: the graph is dropped when this returns.
    """
    parameters = {_storage_key(p) for p in model.parameters()}
    saved: list[tuple[torch.Tensor, int]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # detach() shares the version counter, so later in-place changes stay visible.
        saved.append((tensor.detach(), tensor._version))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*batch, inplace=inplace)
    result = SavedCensus(tensors=len(saved))
    seen: set[tuple[int, int]] = set()
    # In-place code saves one storage at several versions; each saved version is one value to keep.
    changed: set[tuple[int, int, int]] = set()
    for tensor, version in saved:
        key = _storage_key(tensor)
        if key not in parameters and key not in seen:
            seen.add(key)
            result.activation_bytes += key[1]
        if tensor._version != version and (*key, version) not in changed:
            changed.add((*key, version))
            result.changed_in_place += 1
            result.changed_bytes += tensor.nbytes
    return result


def format_bytes(count: float) -> str:
    """Human-readable byte count.

    Example:
        >>> format_bytes(3 * 1024 * 1024)
        '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def held_for_backward(
    device: str,
    forward: Callable[[], torch.Tensor],
    wrap: Callable[[], contextlib.AbstractContextManager[Any]],
) -> int:
    """Device bytes a forward pass leaves allocated for backward (CUDA only; 0 elsewhere)."""
    if not device.startswith("cuda"):
        return 0
    _synchronize(device)
    before = torch.cuda.memory_allocated()
    with wrap():
        loss = forward()
        _synchronize(device)
        held = torch.cuda.memory_allocated() - before
        _backward(loss)
    return held


# ---------------------------------------------------------------------------------------------
# The features


class Feature:
    """One row of the demo: a way of running forward + backward, and what it counts."""

    name = "plain autograd"

    def instrument(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor], config: DemoConfig
    ) -> None:
        """Untimed measurements made once before training."""

    @contextlib.contextmanager
    def around_step(self, model: TinyTransformer) -> Iterator[None]:
        """Untimed set-up and tear-down around one timed step."""
        yield

    def step(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward; returns the loss."""
        loss: torch.Tensor = model(*batch)
        _backward(loss)
        return loss

    def describe(self, steps: int) -> str:
        """What the feature did, for the table."""
        return ""


class Plain(Feature):
    """The reference: plain autograd, no hooks."""

    name = "plain autograd (reference)"

    def __init__(self) -> None:
        self.census = SavedCensus()

    def instrument(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor], config: DemoConfig
    ) -> None:
        self.census = census(model, batch, inplace=False)

    def describe(self, steps: int) -> str:
        return (
            f"{format_bytes(self.census.activation_bytes)} of activations saved for backward "
            f"({self.census.tensors} tensors)"
        )


class SaveOnCpu(Feature):
    """Activations saved in host memory until backward needs them."""

    name = "save_on_cpu"

    def __init__(self, plain: Plain) -> None:
        self.plain = plain
        self.device = "cpu"
        self.offloaded = 0

    def _context(self) -> contextlib.AbstractContextManager[Any]:
        # Pinned host memory only makes sense with a GPU to copy from.
        pin = self.device.startswith("cuda")
        return tensorhooks.save_on_cpu(pin_memory=pin)

    def instrument(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor], config: DemoConfig
    ) -> None:
        self.device = config.device
        plain = held_for_backward(config.device, lambda: model(*batch), contextlib.nullcontext)
        offloaded = held_for_backward(config.device, lambda: model(*batch), self._context)
        self.offloaded = max(plain - offloaded, 0)
        model.zero_grad(set_to_none=True)

    def step(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        with self._context():
            loss: torch.Tensor = model(*batch)
            _backward(loss)
        return loss

    def describe(self, steps: int) -> str:
        if not self.device.startswith("cuda"):
            return "CPU run: activations already in host memory, nothing to move"
        total = self.plain.census.activation_bytes
        share = f" ({100 * self.offloaded / total:.0f}% of activations)" if total else ""
        return f"{format_bytes(self.offloaded)} offloaded to host memory{share}"


class AllowMutation(Feature):
    """In-place residual adds on tensors saved for backward."""

    name = "allow_mutation_on_saved_tensors"

    def __init__(self) -> None:
        self.census = SavedCensus()
        self.plain_error = ""

    def instrument(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor], config: DemoConfig
    ) -> None:
        self.census = census(model, batch, inplace=True)
        try:
            _backward(model(*batch, inplace=True))
        except RuntimeError as error:
            self.plain_error = type(error).__name__
        model.zero_grad(set_to_none=True)

    def step(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        with tensorhooks.allow_mutation_on_saved_tensors():
            loss: torch.Tensor = model(*batch, inplace=True)
            _backward(loss)
        return loss

    def describe(self, steps: int) -> str:
        plain = "; plain autograd raises on this code" if self.plain_error else ""
        return (
            f"{self.census.changed_in_place} saved tensors changed in place, save-time values "
            f"kept ({format_bytes(self.census.changed_bytes)} cloned){plain}"
        )


class SavedTensorsHooks(Feature):
    """A pack/unpack pair that counts the tensors going through it."""

    name = "saved_tensors_hooks"

    def __init__(self) -> None:
        self.packed = 0
        self.unpacked = 0
        self.packed_bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count, then keep the tensor as it is."""
        self.packed += 1
        self.packed_bytes += tensor.nbytes
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count, then hand the tensor back."""
        self.unpacked += 1
        return tensor

    def step(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        with tensorhooks.saved_tensors_hooks(self.pack, self.unpack):
            loss: torch.Tensor = model(*batch)
        _backward(loss)
        return loss

    def describe(self, steps: int) -> str:
        return (
            f"pack fired {self.packed // steps}x, unpack {self.unpacked // steps}x "
            f"({format_bytes(self.packed_bytes / steps)} packed)"
        )


class DisableSavedTensorsHooks(Feature):
    """A model whose blocks try to install hooks, run inside a region that refuses them."""

    name = "disable_saved_tensors_hooks"

    def __init__(self) -> None:
        self.refused = 0
        self.enabled_after = True

    @contextlib.contextmanager
    def optional_hooks(self) -> Generator[None, None, None]:
        """Use saved-tensor hooks if this region allows them, else run without (counted)."""
        hooks = tensorhooks.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)
        try:
            hooks.__enter__()
        except RuntimeError as error:
            if str(error) != DISABLED_MESSAGE:
                raise
            self.refused += 1
            entered = False
        else:
            entered = True
        try:
            yield
        finally:
            if entered:
                hooks.__exit__(None, None, None)

    def step(
        self, model: TinyTransformer, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        with tensorhooks.disable_saved_tensors_hooks(DISABLED_MESSAGE):
            loss: torch.Tensor = model(*batch, block_context=self.optional_hooks)
        _backward(loss)
        # Hooks must work again once the region is left.
        try:
            with tensorhooks.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
                pass
        except RuntimeError:
            self.enabled_after = False
        return loss

    def describe(self, steps: int) -> str:
        after = "usable again after" if self.enabled_after else "STILL DISABLED after the region"
        return f"refused {self.refused // steps} hook installs with its message; hooks {after}"


class MultiGradHook(Feature):
    """One "all" hook per bucket of parameters, like a data-parallel reducer's."""

    name = "register_multi_grad_hook"

    def __init__(self) -> None:
        self.buckets = 0
        self.fired = 0
        self.incomplete = 0

    def on_bucket_ready(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Count a completed bucket, and whether every gradient in it was there."""
        self.fired += 1
        if any(grad is None for grad in grads):
            self.incomplete += 1

    @contextlib.contextmanager
    def around_step(self, model: TinyTransformer) -> Iterator[None]:
        buckets = model.buckets()
        self.buckets = len(buckets)
        handles = [
            tensorhooks.register_multi_grad_hook(bucket, self.on_bucket_ready) for bucket in buckets
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def describe(self, steps: int) -> str:
        missing = "no grad missing" if self.incomplete == 0 else f"{self.incomplete} incomplete"
        return (
            f"{self.fired} of {self.buckets * steps} bucket completions "
            f"({self.buckets} buckets x {steps} steps), {missing}"
        )


# ---------------------------------------------------------------------------------------------
# The run


def _max_difference(
    grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]
) -> tuple[float, bool]:
    """Largest absolute difference, and whether it is within tolerance of the reference."""
    worst = 0.0
    within = True
    for grad, ref in zip(grads, reference, strict=True):
        if grad is None or ref is None:
            if grad is not ref:
                return math.inf, False
            continue
        difference = float((grad - ref).abs().max())
        worst = max(worst, difference)
        # Exact on CPU; a hair of slack for non-deterministic GPU kernels.
        within = within and bool(torch.allclose(grad, ref, rtol=1e-5, atol=1e-7))
    return worst, within


def features() -> tuple[Plain, list[Feature]]:
    """The reference and every feature shown, in table order."""
    plain = Plain()
    return plain, [
        SaveOnCpu(plain),
        AllowMutation(),
        SavedTensorsHooks(),
        DisableSavedTensorsHooks(),
        MultiGradHook(),
    ]


def run_demo(config: DemoConfig, console: Console) -> DemoResult:
    """Train the tiny transformer under plain autograd and every feature; compare and time.

    Args:
        config: model size, number of steps, device.
        console: where progress goes.

    Returns:
        The measurements, one `FeatureRow` per feature.
    """
    torch.manual_seed(config.seed)
    model = TinyTransformer(config).to(config.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    plain, shown = features()
    rows = {feature.name: FeatureRow(feature.name) for feature in [plain, *shown]}

    losses: list[float] = []
    runs: list[Feature] = [plain, *shown]
    with console.progress(1 + config.steps * len(runs), "measuring what is saved") as progress:
        first = make_batch(config, 0)
        for feature in runs:
            _guarded(rows[feature.name], partial(feature.instrument, model, first, config))
        model.zero_grad(set_to_none=True)
        progress.advance("measured what is saved")
        for step in range(config.steps):
            batch = make_batch(config, step)
            grads: dict[str, list[torch.Tensor | None]] = {}
            # Rotating the order, the reference included, spreads cache and allocator warm-up
            # evenly over every row.
            shift = step % len(runs)
            for feature in runs[shift:] + runs[:shift]:
                row = rows[feature.name]
                run = partial(_timed_step, feature, model, batch, config, row)
                measured = None if row.error else _guarded(row, run)
                if measured is not None:
                    grads[feature.name] = measured[1]
                    if feature is plain:
                        losses.append(float(measured[0]))
                progress.advance(f"step {step + 1}/{config.steps}: {feature.name}")
            if plain.name not in grads:
                raise RuntimeError(f"plain autograd failed: {rows[plain.name].error}")
            reference = grads[plain.name]
            for feature in shown:
                if feature.name in grads:
                    rows[feature.name].compare(grads[feature.name], reference)
            for parameter, grad in zip(model.parameters(), reference, strict=True):
                parameter.grad = grad
            optimizer.step()
            model.zero_grad(set_to_none=True)

    for feature in runs:
        row = rows[feature.name]
        row.what = f"FAILED: {row.error}" if row.error else feature.describe(config.steps)
    parameters = sum(p.numel() for p in model.parameters())
    return DemoResult(config, list(rows.values()), losses, parameters)


def _guarded(row: FeatureRow, action: Callable[[], _T]) -> _T | None:
    """Run ``action``; an exception is recorded on the row (shown in the table), not raised."""
    try:
        return action()
    except Exception as error:  # a failing feature is reported, the demo goes on
        row.error = f"{type(error).__name__}: {error}"
        row.matched = False
        return None


def _timed_step(
    feature: Feature,
    model: TinyTransformer,
    batch: tuple[torch.Tensor, torch.Tensor],
    config: DemoConfig,
    row: FeatureRow,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    with feature.around_step(model):
        _synchronize(config.device)
        started = time.perf_counter()
        loss = feature.step(model, batch)
        _synchronize(config.device)
        row.times.append(time.perf_counter() - started)
    return loss.detach(), [p.grad for p in model.parameters()]


def result_table(result: DemoResult) -> tuple[list[str], list[list[str]]]:
    """The demo's table: columns and rows of text (free text last, so the figures line up)."""
    columns = ["feature", "grads match", "max |diff|", "time vs plain", "what it did (per step)"]
    reference = result.rows[0].times
    rows = []
    for index, row in enumerate(result.rows):
        if index == 0:
            rows.append([row.feature, "(reference)", "-", "1.00x", row.what])
            continue
        ratio = row.time_ratio(reference)
        if row.error is not None:
            verdict, difference = "NO (failed)", "-"
        elif row.matched:
            verdict = "yes" if row.exact else "yes (rtol 1e-5)"
            difference = f"{row.max_diff:.1e}" if row.max_diff else "0"
        else:
            verdict, difference = "NO", f"{row.max_diff:.1e}"
        timing = f"{ratio:.2f}x" if ratio else "-"
        rows.append([row.feature, verdict, difference, timing, row.what])
    return columns, rows
