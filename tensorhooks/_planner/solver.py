"""The exact solver: the fastest plan whose predicted peak fits the budget.

See NOTE [Solving a plan exactly] below.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .costs import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    BlockCosts,
    Choice,
    CostTable,
    Outcome,
    choice_outcome,
    plan_peak,
    plan_seconds,
)

__all__ = ["Menu", "Solution", "block_menu", "least_peak", "solve"]

# NOTE [Solving a plan exactly]
#
# The choices: each block is kept, or checkpointed with each candidate op recomputed, saved or
# offloaded and its input kept or offloaded: 1 + 2 * 3**ops plans per block. Two exact
# reductions make that tractable.
#
# Within a block, candidates with the same bytes and the same offloadability are
# interchangeable except for the time they save, so some optimal plan caches, of each such
# class, the ones that save the most time, and which of those it saves and which it offloads
# does not matter: a class of m ops has (m+1)(m+2)/2 choices (how many saved, how many
# offloaded), not 3**m. A dynamic programme over the classes keeps, for each reachable
# (device bytes, offloaded bytes), the most time saved; every state is
# then priced with `choice_outcome` for each input choice (the same function a brute force
# uses, so the numbers agree to the bit); caching nothing is always among them, since it alone
# pays no policy. The block's menu is what remains after dropping every outcome that another
# beats or equals in device bytes, backward bytes and seconds: the peak grows with each of
# them, so a dropped outcome is never needed. The one departure from exactness: a block whose
# classes reach more than `STATES_PER_BLOCK` byte states has them grouped on a grid of bytes,
# each cell keeping its fastest (`_coarsened`), and the plan says so (``plan.exact``).
#
# Across blocks, a dynamic programme in forward order keeps, for each sum of device bytes so
# far, the least time: a block's menu entry is admissible where the bytes held before it plus
# its backward bytes fit the budget, and a plan is feasible where the end of the forward pass
# fits too (see NOTE [The cost model of a plan]). States beaten in both bytes and time are
# dropped. The result is the fastest feasible plan; among equally fast ones, the one that holds
# the least, then the first in menu order (menus are sorted), so the answer is deterministic.
# A larger budget admits a superset of plans, so its predicted time is never larger.


@dataclass(frozen=True)
class Menu:
    """A block's choices that no other choice beats, each with its outcome, sorted.

    ``exact`` is False where the block had too many policies and they were grouped (see
    `_coarsened`).
    """

    entries: tuple[tuple[Outcome, Choice], ...]
    exact: bool = True


def _classes(block: BlockCosts) -> list[list[int]]:
    """Candidate indices grouped by (bytes, offloadable), most time first.

    Bytes an op's output holds, saved by the block or not: only the sum enters the outcome
    (see NOTE [The cost model of a plan]).
    """
    groups: dict[tuple[int, bool], list[int]] = {}
    for index, op in enumerate(block.ops):
        groups.setdefault((op.saved_bytes + op.other_bytes, op.offloadable), []).append(index)
    classes = []
    for key in sorted(groups):
        members = groups[key]
        members.sort(key=lambda index: (-block.ops[index].seconds, index))
        classes.append(members)
    return classes


_Key = tuple[int, int]  # (device bytes, offloaded bytes) of a policy

STATES_PER_BLOCK = 4096
"""Policies per block the exact programme keeps before it groups them (see `_coarsened`)."""


def _policies(block: BlockCosts, link: bool) -> tuple[list[tuple[int, ...]], bool]:
    """The policies worth pricing for ``block``, and whether the search over them was exact.

    One policy per reachable (device, offloaded) bytes: the one saving the most time
    (see NOTE [Solving a plan exactly]). False when there were more than `STATES_PER_BLOCK`
    and they were grouped. Without a ``link`` nothing is offloaded.
    """
    classes = _classes(block)
    states: dict[_Key, float] = {(0, 0): 0.0}
    layers: list[dict[_Key, tuple[_Key, int, int]]] = []  # per class: key -> (parent, kept, moved)
    exact = True
    for members in classes:
        first = block.ops[members[0]]
        size = first.saved_bytes + first.other_bytes
        prefix = list(itertools.accumulate((block.ops[i].seconds for i in members), initial=0.0))
        offloads = len(members) if first.offloadable and link else 0
        grown: dict[_Key, float] = {}
        layer: dict[_Key, tuple[_Key, int, int]] = {}
        for parent, saved in states.items():
            device, offloaded = parent
            for kept in range(len(members) + 1):
                for moved in range(min(offloads, len(members) - kept) + 1):
                    key = (device + kept * size, offloaded + moved * size)
                    value = saved + prefix[kept + moved]
                    best = grown.get(key)
                    if best is None or value > best:
                        grown[key] = value
                        layer[key] = (parent, kept, moved)
        if len(grown) > STATES_PER_BLOCK:
            grown = _coarsened(grown)
            exact = False
        states = grown
        layers.append(layer)
    # Caching nothing costs no policy at all, so it is not beaten by caching a zero-byte output
    # at the same bytes: it always stays.
    policies = [(RECOMPUTE,) * len(block.ops)]
    for final in states:
        policy = [RECOMPUTE] * len(block.ops)
        key = final
        for members, layer in zip(reversed(classes), reversed(layers), strict=True):
            key, kept, moved = layer[key]
            for rank, index in enumerate(members[: kept + moved]):
                policy[index] = SAVE if rank < kept else OFFLOAD
        if any(policy):
            policies.append(tuple(policy))
    return policies, exact


def _coarsened(states: dict[_Key, float]) -> dict[_Key, float]:
    """At most about `STATES_PER_BLOCK` states: per cell of a grid over the bytes, the fastest.

    The grid has as many cells along each dimension with a range as the cap allows; a cell keeps
    its state that saves the most time (the fewest bytes among equals), and the state caching
    nothing stays (full recomputation, the least memory). Every kept state is a real policy
    priced exactly later; what is lost is a policy a little smaller and a little slower than its
    cell's.
    """
    ranges = [max(key[axis] for key in states) for axis in range(2)]
    dimensions = sum(1 for extent in ranges if extent) or 1
    cells = max(2, int(STATES_PER_BLOCK ** (1 / dimensions)))
    quanta = [max(1, -(-extent // cells)) for extent in ranges]
    grid: dict[_Key, tuple[_Key, float]] = {}
    for key, saved in states.items():
        cell = (key[0] // quanta[0], key[1] // quanta[1])
        best = grid.get(cell)
        if best is None or (saved, -sum(key)) > (best[1], -sum(best[0])):
            grid[cell] = (key, saved)
    kept = dict(grid.values())
    if (0, 0) in states:
        kept[0, 0] = states[0, 0]
    return kept


def _pareto(entries: Iterable[tuple[Outcome, Choice]]) -> list[tuple[Outcome, Choice]]:
    """Entries no other entry beats or equals in device bytes, backward bytes and seconds."""
    ordered = sorted(
        entries,
        key=lambda entry: (
            entry[0].device,
            entry[0].backward,
            entry[0].seconds,
            entry[0].host,
            not entry[1].keep,
            entry[1].offload_input,
            entry[1].ops,
        ),
    )
    kept: list[tuple[Outcome, Choice]] = []
    # A staircase of the (backward, seconds) pairs kept so far: backward rising, seconds falling.
    stair_backward: list[int] = []
    stair_seconds: list[float] = []
    for outcome, choice in ordered:
        at = bisect.bisect_right(stair_backward, outcome.backward)
        if at and stair_seconds[at - 1] <= outcome.seconds:
            continue  # an entry with no more device bytes beats it
        kept.append((outcome, choice))
        end = at
        while end < len(stair_backward) and stair_seconds[end] >= outcome.seconds:
            end += 1
        stair_backward[at:end] = [outcome.backward]
        stair_seconds[at:end] = [outcome.seconds]
    return kept


@functools.lru_cache(maxsize=1024)
def block_menu(block: BlockCosts, bandwidth: float | None) -> Menu:
    """Every choice of ``block`` that no other beats (see NOTE [Solving a plan exactly]).

    Remembered for the last 1024 blocks: planning one profile for several budgets builds each
    block's menu once.
    """
    inputs = [False, True] if bandwidth is not None and block.offloadable_input_bytes else [False]
    entries = [(choice_outcome(block, KEEP, bandwidth), KEEP)]
    policies, exact = _policies(block, bandwidth is not None)
    for policy in policies:
        for offload_input in inputs:
            choice = Choice(keep=False, ops=policy, offload_input=offload_input)
            entries.append((choice_outcome(block, choice, bandwidth), choice))
    return Menu(tuple(_pareto(entries)), exact)


@dataclass(frozen=True)
class Solution:
    """The chosen plan: a choice per block, its outcomes, predicted peak and step time."""

    choices: tuple[Choice, ...]
    outcomes: tuple[Outcome, ...]
    peak: int
    seconds: float


def _columns(menu: Menu) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The menu's device bytes, backward bytes and seconds, as tensors."""
    outcomes = [outcome for outcome, _ in menu.entries]
    return (
        torch.tensor([outcome.device for outcome in outcomes], dtype=torch.int64),
        torch.tensor([outcome.backward for outcome in outcomes], dtype=torch.int64),
        torch.tensor([outcome.seconds for outcome in outcomes], dtype=torch.float64),
    )


def _frontier(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Indices of the pairs no other pair beats or equals in both (the earliest of equals stays).

    Sorted by ``first`` then ``second`` (two stable sorts), a pair stays where its ``second`` is
    below every ``second`` before it.
    """
    order = torch.sort(second, stable=True).indices
    order = order[torch.sort(first[order], stable=True).indices]
    ranked = second[order]
    if ranked.dtype == torch.float64:
        before = torch.cat([torch.full((1,), math.inf, dtype=ranked.dtype), ranked[:-1]])
    else:
        before = torch.cat([torch.full((1,), _MAX, dtype=ranked.dtype), ranked[:-1]])
    lowest_before = torch.cummin(before, dim=0).values
    return order[ranked < lowest_before]


_MAX = torch.iinfo(torch.int64).max


def solve(table: CostTable, menus: Sequence[Menu], budget: int) -> Solution | None:
    """The fastest plan whose predicted peak is at most ``budget``; None if none is.

    The programme of NOTE [Solving a plan exactly], one block at a time on tensors: every state
    with every admissible menu entry, then the states no other beats in bytes held and time.
    Seconds add in block order in float64, as `plan_seconds` adds them, so equal plans compare
    equal to the bit.
    """
    held = torch.zeros(1, dtype=torch.int64)
    seconds = torch.zeros(1, dtype=torch.float64)
    room = budget - table.fixed_bytes
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # per block: parent state, menu entry
    for menu in menus:
        device, backward, change = _columns(menu)
        parents, entries = ((held[:, None] + backward[None, :]) <= room).nonzero(as_tuple=True)
        if parents.numel() == 0:
            return None
        held = held[parents] + device[entries]
        seconds = seconds[parents] + change[entries]
        kept = _frontier(held, seconds)
        held, seconds = held[kept], seconds[kept]
        steps.append((parents[kept], entries[kept]))
    feasible = (held + table.after_bytes <= room).nonzero(as_tuple=True)[0]
    if feasible.numel() == 0:
        return None
    best = int(feasible[torch.argmin(seconds[feasible])])  # unique: the frontier's times differ
    return _unwind(table, menus, steps, best)


def _unwind(
    table: CostTable,
    menus: Sequence[Menu],
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    state: int,
) -> Solution:
    entries: list[tuple[Outcome, Choice]] = []
    for menu, (parents, chosen) in zip(reversed(menus), reversed(steps), strict=True):
        entries.append(menu.entries[int(chosen[state])])
        state = int(parents[state])
    entries.reverse()
    outcomes = tuple(outcome for outcome, _ in entries)
    return Solution(
        choices=tuple(choice for _, choice in entries),
        outcomes=outcomes,
        peak=plan_peak(table, outcomes),
        seconds=plan_seconds(table, outcomes),
    )


def least_peak(table: CostTable, menus: Sequence[Menu]) -> int:
    """The least predicted peak any plan reaches."""
    # States: (held so far, the highest backward point so far), both to be small.
    held = torch.zeros(1, dtype=torch.int64)
    high = torch.zeros(1, dtype=torch.int64)
    for menu in menus:
        device, backward, _ = _columns(menu)
        grown_held = (held[:, None] + device[None, :]).flatten()
        grown_high = torch.maximum(high[:, None], held[:, None] + backward[None, :]).flatten()
        kept = _frontier(grown_held, grown_high)
        held, high = grown_held[kept], grown_high[kept]
    peaks = torch.maximum(high, held + table.after_bytes)
    return table.fixed_bytes + int(peaks.min())
