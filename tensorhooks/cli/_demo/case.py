"""What a demo case is (`Case`), what running it gives (`Result`, `Row`), what cases share (`Demo`).

Each case runs the peer's implementation (torch's, or DDP, or torch.utils.checkpoint) and
tensorhooks' on one situation where they differ, says what each did as an `Outcome`, and may
time a training step of the shared tiny transformer under both (see
NOTE [How tensorhooks times things] and NOTE [How long the demo times]).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorhooks.cli._harness import Spread, interleaved
from tensorhooks.cli._models import ModelConfig, TinyTransformer, backward, make_batch

__all__ = [
    "Case",
    "Context",
    "Demo",
    "DemoConfig",
    "Outcome",
    "Result",
    "Row",
    "gradient_or_error",
    "time_pair",
    "what_went_wrong",
]

Context = Callable[[], contextlib.AbstractContextManager[Any]]


# NOTE [How long the demo times]
#
# The demo's case is what each side does; its step times are a second reading, and must not
# make it a long run on a laptop that is doing other work (the bench is where timing is asked
# for). Each timed case warms both steps up once, then times 5 interleaved rounds of one step
# each: 12 steps per case instead of the 40 that 5 rounds of 2 steps cost with `Timer`'s two
# warm-up calls per round. Five rounds are the fewest whose spread can show a ratio clearly
# faster or slower (see NOTE [Reading a ratio from its rounds]); one step a round keeps each
# round short, so that load drifting during a round moves both sides alike. On a CPU the whole
# demo runs on one intra-op thread, the project's reference setting: its model is small, and a
# second thread costs more CPU time than it saves wall time. Its batch there is 8 (`demo`): the
# cases' steps cost half what they did at 16, and no case turns on the batch size. Most of the
# rest is fixed: importing torch, in the demo and in the two processes of the sync_gradients
# case, and torch._dynamo (about 1.6 CPU-seconds each time), which torch imports the first
# time a dispatch mode runs, and DDP's constructor in each of those processes.
# ``benchmarks/demo_cost.py`` measures the whole (target: at most 20 CPU-seconds).

WARMUP = 1
"""Untimed steps of each side before a timed case's first round."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: the model timed, and how long (see NOTE [How long the demo times])."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rounds: int = 5
    steps: int = 1
    processes: bool = True  # run the two-process sync_gradients case

    @property
    def timed_steps(self) -> int:
        """Steps each side of a timed case runs: the warm-up, then every round's."""
        return WARMUP + self.rounds * self.steps


@dataclass(frozen=True)
class Outcome:
    """What one implementation did on a case: a short result, a sentence, and whether it is OK."""

    result: str
    detail: str
    good: bool


@dataclass(frozen=True)
class Result:
    """What running a case gave: each side's outcome, and the step-time comparison if timed."""

    torch: Outcome
    ours: Outcome
    timing: Spread | None = None  # step time, tensorhooks over the peer, per round
    timed: str = ""  # which side over which, on what step: "tensorhooks / torch, identity hooks"


@dataclass(frozen=True)
class Case:
    """One situation where a feature differs from its peer.

    Attributes:
        feature: the feature's name, as the summary lists it.
        peer: what tensorhooks is compared against (torch.autograd.graph, DDP, ...).
        situation: the case in words.
        run: runs the peer's side and tensorhooks' side on the shared `Demo`.
    """

    feature: str
    peer: str
    situation: str
    run: Callable[[Demo], Result]


@dataclass(frozen=True)
class Row:
    """A case and what running it gave: what the demo prints, one section and summary row each."""

    feature: str
    peer: str
    situation: str
    torch: Outcome
    ours: Outcome
    timing: Spread | None = None
    timed: str = ""

    @classmethod
    def of(cls, case: Case, result: Result) -> Row:
        """The row of ``case`` once it gave ``result``."""
        return cls(
            case.feature,
            case.peer,
            case.situation,
            result.torch,
            result.ours,
            result.timing,
            result.timed,
        )


class Demo:
    """What every case shares: the configuration, a model, a batch, and the step timer."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        torch.manual_seed(config.model.seed)
        self.model = TinyTransformer(config.model).to(config.model.device)
        self.batch = make_batch(config.model)

    @property
    def cuda(self) -> bool:
        """Whether the model runs on a CUDA device."""
        return self.config.model.device.startswith("cuda")

    def step(
        self, context: Context, model: TinyTransformer | None = None, *, inplace: bool = False
    ) -> Callable[[], None]:
        """One training step (forward + backward) of the tiny transformer under ``context``."""
        net = self.model if model is None else model

        def run() -> None:
            net.zero_grad(set_to_none=True)
            with context():
                loss = net(*self.batch, inplace=inplace)
                backward(loss)

        return run

    def ratio(self, theirs: Callable[[], None], ours: Callable[[], None]) -> Spread:
        """Step time of ``ours`` over ``theirs``, per round."""
        return time_pair(theirs, ours, self.config)


def time_pair(theirs: Callable[[], None], ours: Callable[[], None], config: DemoConfig) -> Spread:
    """Step time of ``ours`` over ``theirs``, per round: how every timed case is timed.

    See NOTE [How long the demo times]: `WARMUP` steps of each, then ``config.rounds``
    interleaved rounds of ``config.steps`` steps, on the intra-op threads the caller set.
    """
    timings = interleaved(
        {"torch": theirs, "tensorhooks": ours},
        rounds=config.rounds,
        inner=config.steps,
        threads=torch.get_num_threads(),
        warmup=WARMUP,
        warm_each_round=False,
    )
    return timings.ratio("tensorhooks", "torch")


def what_went_wrong(error: BaseException) -> str:
    r"""The error's type and the first sentence of its message: the part that says what failed.

    Whole words only: the rest of a message (hints, what to do, the list of accepted
    signatures) is left out, never cut mid-word.

    Example:
        >>> what_went_wrong(RuntimeError("Expected to have finished reduction. This error ..."))
        'RuntimeError: Expected to have finished reduction.'
        >>> what_went_wrong(TypeError("f(): incompatible function arguments.\n  1. (x: str)"))
        'TypeError: f(): incompatible function arguments.'
    """
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    sentence = re.match(r"(.*?[.!?])(?=\s|$)", first)
    return f"{type(error).__name__}: {sentence.group(1) if sentence else first}"


def gradient_or_error(
    program: Callable[[], torch.Tensor],
    expected: torch.Tensor,
    *,
    raising_is_right: bool = True,
    right: str = "the gradient of the save-time values",
) -> Outcome:
    """The gradient ``program`` returns, right or wrong, or the error it raises.

    ``raising_is_right`` says whether an error is the right answer (no right gradient exists
    without a copy) or a refusal of a program whose gradient is well defined; ``right`` is the
    detail of a right gradient.
    """
    try:
        grad = program()
    except RuntimeError as error:
        if raising_is_right:
            return Outcome("raises", what_went_wrong(error), good=True)
        return Outcome("refuses", what_went_wrong(error), good=False)
    if torch.equal(grad, expected):
        return Outcome("right gradient", right, good=True)
    index = int((grad != expected).flatten().nonzero()[0])
    got, want = grad.flatten()[index].item(), expected.flatten()[index].item()
    return Outcome("WRONG gradient", f"silently {got:g} where {want:g} is right", good=False)
