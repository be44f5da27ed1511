"""The exact solver: the fastest plan whose predicted peak fits the budget.

See NOTE [Solving a plan exactly] below.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
# Within a block, candidates with the same bytes (saved, unsaved) and the same offloadability
# are interchangeable except for the time they save, so some optimal plan caches, of each such
# class, the ones that save the most time, and which of those it saves and which it offloads
# does not matter: a class of m ops has (m+1)(m+2)/2 choices (how many saved, how many
# offloaded), not 3**m. A dynamic programme over the classes keeps, for each reachable
# (device bytes, unsaved bytes saved, offloaded bytes), the most time saved; every state is
# then priced with `choice_outcome` for each input choice (the same function a brute force
# uses, so the numbers agree to the bit). The block's menu is what remains after dropping every
# outcome that another beats or equals in device bytes, backward bytes and seconds: the peak
# grows with each of them, so a dropped outcome is never needed.
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
    """Candidate indices grouped by (saved bytes, unsaved bytes, offloadable), most time first."""
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for index, op in enumerate(block.ops):
        groups.setdefault((op.saved_bytes, op.other_bytes, op.offloadable), []).append(index)
    classes = []
    for key in sorted(groups):
        members = groups[key]
        members.sort(key=lambda index: (-block.ops[index].seconds, index))
        classes.append(members)
    return classes


_Key = tuple[int, int, int]  # (device bytes, unsaved bytes saved, offloaded bytes) of a policy

STATES_PER_BLOCK = 4096
"""Policies per block the exact programme keeps before it groups them (see `_coarsened`)."""


def _policies(block: BlockCosts, link: bool) -> tuple[list[tuple[int, ...]], bool]:
    """The policies worth pricing for ``block``, and whether the search over them was exact.

    One policy per reachable (device, unsaved, offloaded) bytes: the one saving the most time
    (see NOTE [Solving a plan exactly]). False when there were more than `STATES_PER_BLOCK`
    and they were grouped. Without a ``link`` nothing is offloaded.
    """
    classes = _classes(block)
    states: dict[_Key, float] = {(0, 0, 0): 0.0}
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
            device, unsaved, offloaded = parent
            for kept in range(len(members) + 1):
                for moved in range(min(offloads, len(members) - kept) + 1):
                    key = (
                        device + kept * size,
                        unsaved + kept * first.other_bytes,
                        offloaded + moved * size,
                    )
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
    ranges = [max(key[axis] for key in states) for axis in range(3)]
    dimensions = sum(1 for extent in ranges if extent) or 1
    cells = max(2, int(STATES_PER_BLOCK ** (1 / dimensions)))
    quanta = [max(1, -(-extent // cells)) for extent in ranges]
    grid: dict[_Key, tuple[_Key, float]] = {}
    for key, saved in states.items():
        cell = (key[0] // quanta[0], key[1] // quanta[1], key[2] // quanta[2])
        best = grid.get(cell)
        if best is None or (saved, -sum(key)) > (best[1], -sum(best[0])):
            grid[cell] = (key, saved)
    kept = dict(grid.values())
    if (0, 0, 0) in states:
        kept[0, 0, 0] = states[0, 0, 0]
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


def block_menu(block: BlockCosts, bandwidth: float | None) -> Menu:
    """Every choice of ``block`` that no other beats (see NOTE [Solving a plan exactly])."""
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


class _State:
    __slots__ = ("entry", "held", "parent", "seconds")

    def __init__(
        self, held: int, seconds: float, parent: _State | None, entry: tuple[Outcome, Choice] | None
    ) -> None:
        self.held = held
        self.seconds = seconds
        self.parent = parent
        self.entry = entry


def _frontier(states: list[_State]) -> list[_State]:
    """States no other beats or equals in bytes held and time (stable: the first one stays)."""
    states.sort(key=lambda state: (state.held, state.seconds))
    kept: list[_State] = []
    for state in states:
        if not kept or state.seconds < kept[-1].seconds:
            kept.append(state)
    return kept


def solve(table: CostTable, menus: Sequence[Menu], budget: int) -> Solution | None:
    """The fastest plan whose predicted peak is at most ``budget``; None if none is."""
    states = [_State(0, 0.0, None, None)]
    room = budget - table.fixed_bytes
    for menu in menus:
        grown = []
        for state in states:
            for entry in menu.entries:
                outcome = entry[0]
                if state.held + outcome.backward <= room:
                    held = state.held + outcome.device
                    grown.append(_State(held, state.seconds + outcome.seconds, state, entry))
        states = _frontier(grown)
    final = [state for state in states if state.held + table.after_bytes <= room]
    if not final:
        return None
    best = min(final, key=lambda state: (state.seconds, state.held))
    return _unwind(table, best)


def _unwind(table: CostTable, state: _State) -> Solution:
    entries: list[tuple[Outcome, Choice]] = []
    node: _State | None = state
    while node is not None and node.entry is not None:
        entries.append(node.entry)
        node = node.parent
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
    states: list[tuple[int, int]] = [(0, 0)]
    for menu in menus:
        grown = {
            (held + outcome.device, max(high, held + outcome.backward))
            for held, high in states
            for outcome, _ in menu.entries
        }
        ordered = sorted(grown)
        states = []
        for held, high in ordered:
            if not states or high < states[-1][1]:
                states.append((held, high))
    return table.fixed_bytes + min(max(high, held + table.after_bytes) for held, high in states)
