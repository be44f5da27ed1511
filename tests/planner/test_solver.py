"""The solver: equal to brute force over every combination, monotone, deterministic."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhooks._planner import solver
from tensorhooks._planner.costs import (
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SAVE,
    BlockCosts,
    Choice,
    CostTable,
    OpCost,
    Outcome,
    choice_outcome,
    plan_peak,
    plan_seconds,
)


def op_costs() -> st.SearchStrategy[OpCost]:
    """A candidate op: small byte counts (so that classes share sizes), whole seconds."""
    return st.builds(
        OpCost,
        saved_bytes=st.sampled_from([0, 2, 3, 5]),
        other_bytes=st.sampled_from([0, 0, 2, 4]),
        seconds=st.integers(-2, 6).map(float),  # net of what caching costs: may be negative
        offloadable=st.booleans(),
    )


@st.composite
def block_costs(draw: st.DrawFn) -> BlockCosts:
    """A block: up to three candidates, inputs partly saved by its ops, whole-second windows."""
    ops = tuple(draw(st.lists(op_costs(), max_size=3)))
    saved = draw(st.integers(0, 12)) + sum(op.saved_bytes for op in ops)
    input_bytes = draw(st.integers(0, 6))
    unsaved = draw(st.integers(0, input_bytes))
    offloadable = draw(st.sampled_from([0, input_bytes]))
    return BlockCosts(
        ops=ops,
        saved_bytes=saved,
        input_bytes=input_bytes,
        input_unsaved_bytes=unsaved,
        offloadable_input_bytes=offloadable,
        offloadable_input_unsaved_bytes=min(unsaved, offloadable),
        keep_seconds=-float(draw(st.integers(0, 12))),
        policy_seconds=float(draw(st.integers(0, 3))),
        forward_window=float(draw(st.integers(0, 4))),
        backward_window=float(draw(st.integers(0, 4))),
    )


@st.composite
def cost_tables(draw: st.DrawFn) -> CostTable:
    """One to three blocks, with or without a link."""
    return CostTable(
        blocks=tuple(draw(st.lists(block_costs(), min_size=1, max_size=3))),
        fixed_bytes=draw(st.integers(0, 5)),
        after_bytes=draw(st.integers(0, 8)),
        base_seconds=float(draw(st.integers(10, 40))),
        bandwidth=draw(st.sampled_from([None, 1.0, 2.0])),
    )


def every_choice(block: BlockCosts, bandwidth: float | None) -> Iterator[Choice]:
    """Every choice of a block: keep, or each op recomputed, saved or offloaded, with each input."""
    yield KEEP
    per_op = [
        (RECOMPUTE, SAVE, OFFLOAD)
        if op.offloadable and bandwidth is not None
        else (RECOMPUTE, SAVE)
        for op in block.ops
    ]
    inputs = [False, True] if bandwidth is not None and block.offloadable_input_bytes else [False]
    for ops in itertools.product(*per_op):
        for offload_input in inputs:
            yield Choice(keep=False, ops=tuple(ops), offload_input=offload_input)


def brute_force(table: CostTable) -> list[tuple[int, float]]:
    """(peak, seconds) of every plan."""
    per_block = [
        [
            choice_outcome(block, choice, table.bandwidth)
            for choice in every_choice(block, table.bandwidth)
        ]
        for block in table.blocks
    ]
    return [
        (plan_peak(table, outcomes), plan_seconds(table, outcomes))
        for outcomes in itertools.product(*per_block)
    ]


def menus(table: CostTable) -> list[solver.Menu]:
    return [solver.block_menu(block, table.bandwidth) for block in table.blocks]


@given(cost_tables(), st.integers(0, 60))
def test_solver_equals_brute_force(table: CostTable, budget: int) -> None:
    """The fastest plan within the budget has the brute force's time; none iff none fits."""
    plans = brute_force(table)
    feasible = [seconds for peak, seconds in plans if peak <= budget]
    found = solver.solve(table, menus(table), budget)
    if not feasible:
        assert found is None
        return
    assert found is not None
    assert found.seconds == min(feasible)
    assert found.peak <= budget
    outcomes = [
        choice_outcome(block, choice, table.bandwidth)
        for block, choice in zip(table.blocks, found.choices, strict=True)
    ]
    assert (plan_peak(table, outcomes), plan_seconds(table, outcomes)) == (
        found.peak,
        found.seconds,
    )


@given(cost_tables())
def test_least_peak_equals_brute_force(table: CostTable) -> None:
    """The least peak is the smallest peak of any plan, and a plan is found at that budget."""
    least = solver.least_peak(table, menus(table))
    assert least == min(peak for peak, _ in brute_force(table))
    assert solver.solve(table, menus(table), least) is not None
    assert solver.solve(table, menus(table), least - 1) is None


@given(cost_tables(), st.integers(0, 40), st.integers(0, 40))
def test_larger_budget_never_predicts_a_slower_step(table: CostTable, low: int, more: int) -> None:
    """Monotone: whatever fits a budget fits a larger one, so the best time cannot grow."""
    small = solver.solve(table, menus(table), low)
    large = solver.solve(table, menus(table), low + more)
    if small is not None:
        assert large is not None
        assert large.seconds <= small.seconds


@given(cost_tables(), st.integers(0, 60))
def test_solution_is_deterministic(table: CostTable, budget: int) -> None:
    """The same table and budget give the same choices, also from menus built again."""
    first = solver.solve(table, menus(table), budget)
    second = solver.solve(table, menus(table), budget)
    assert first == second


@given(block_costs(), st.sampled_from([None, 1.0]))
def test_menu_keeps_an_unbeaten_choice_for_every_outcome(
    block: BlockCosts, bandwidth: float | None
) -> None:
    """Every choice is matched or beaten by a menu entry in device, backward bytes and time."""
    entries = solver.block_menu(block, bandwidth).entries
    for choice in every_choice(block, bandwidth):
        outcome = choice_outcome(block, choice, bandwidth)
        assert any(
            kept.device <= outcome.device
            and kept.backward <= outcome.backward
            and kept.seconds <= outcome.seconds
            for kept, _ in entries
        ), choice
    for (first, _), (second, _) in itertools.permutations(entries, 2):
        beaten = (
            second.device <= first.device
            and second.backward <= first.backward
            and second.seconds <= first.seconds
        )
        assert not beaten or first == second


def test_peak_is_the_end_of_forward_or_a_blocks_backward() -> None:
    """The peak formula: held before a block plus its backward bytes, or all of forward."""
    table = CostTable(blocks=(), fixed_bytes=10, after_bytes=7, base_seconds=1.0, bandwidth=None)
    outcomes = [Outcome(5, 40, 0, 0.0), Outcome(20, 20, 0, 0.0), Outcome(1, 30, 0, 0.0)]
    # forward end: 10 + 26 + 7 = 43; backward of block 2: 10 + 25 + 30 = 65; block 0: 50
    assert plan_peak(table, outcomes) == 65
    # forward end: 10 + 40 + 7 = 57, above either block's backward (30, 35)
    assert plan_peak(table, [Outcome(20, 20, 0, 0.0), Outcome(20, 5, 0, 0.0)]) == 57


def test_exposure_is_what_the_windows_do_not_hide() -> None:
    """An offload costs the copy time beyond each window; a keep costs its own change."""
    block = BlockCosts(
        ops=(OpCost(4, 0, 3.0, offloadable=True),),
        saved_bytes=4,
        input_bytes=2,
        input_unsaved_bytes=0,
        offloadable_input_bytes=2,
        offloadable_input_unsaved_bytes=0,
        keep_seconds=-5.0,
        policy_seconds=1.0,
        forward_window=1.0,
        backward_window=2.0,
    )
    offloaded = choice_outcome(block, Choice(keep=False, ops=(OFFLOAD,), offload_input=True), 2.0)
    # 6 bytes at 2 B/s: 3 s each way; 2 s and 1 s exposed; policy 1 s; the op saves 3 s.
    assert offloaded == Outcome(device=0, backward=4, host=6, seconds=1.0 - 3.0 + 2.0 + 1.0)
    assert choice_outcome(block, KEEP, 2.0) == Outcome(4, 4, 0, -5.0)


def test_many_policies_are_grouped_and_keep_full_recomputation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the state cap the menu is marked inexact and still holds the all-recompute plan."""
    monkeypatch.setattr(solver, "STATES_PER_BLOCK", 8)
    solver.block_menu.cache_clear()  # menus are remembered: none from before the cap changed
    ops = tuple(OpCost(size, size % 3, float(size), offloadable=False) for size in range(1, 12))
    block = BlockCosts(
        ops=ops,
        saved_bytes=100,
        input_bytes=1,
        input_unsaved_bytes=0,
        offloadable_input_bytes=0,
        offloadable_input_unsaved_bytes=0,
        keep_seconds=-100.0,
        policy_seconds=0.0,
        forward_window=0.0,
        backward_window=0.0,
    )
    menu = solver.block_menu(block, None)
    solver.block_menu.cache_clear()
    assert not menu.exact
    assert any(choice.ops == (RECOMPUTE,) * len(ops) for _, choice in menu.entries)
