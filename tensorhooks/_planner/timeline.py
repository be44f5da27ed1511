"""A traced step replayed: its regions, what a policy kept, and the holds in order to the peak.

See NOTE [Replaying a traced step] below.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from .accounting import DEVICE, HOST
from .tracing import SAVED, Interval, OpRecord, Pair, Site, Trace

__all__ = ["Replay", "cached_ops", "finish", "region_call", "replay"]

# NOTE [Replaying a traced step]
#
# After the step, three things the hooks could not see as it ran are added from what they
# recorded:
# - Which module a checkpoint region is. A region is pushed either around a module's call
#   (``checkpoint(layer, x)``, ``checkpoint_wrapper``) or inside a module's forward around its
#   body (Hugging Face's layers). The calls that started with the region's pair innermost and
#   whose caller did not are its top-level calls: one call with no op of the region outside it
#   is the region's module; otherwise the region is the body of the module that was running when
#   its pair was first seen.
# - A region's inputs. Checkpoint saves its inputs through the pair in force just before it
#   pushes its own (torch's ``_NoopSaveInputs``, tensorhooks' ``save_inputs``): the saves of the
#   region module's arguments between the last op that made a tensor before the region and the
#   region's first sight are the region's, and are shown as its inputs.
# - What a selective policy cached: the region's forward ops, up to its last save, that its
#   recomputation skipped, matched in order by operator. Their outputs are held from the op until
#   the recomputation starts, which consumes them. (Outputs cached after the region's last save
#   are never asked for by an early-stopping recomputation; they are not counted.)
# The holds are then replayed in tick order, a storage counted once however many holds it has
# (a tensor saved by two ops, an output a policy cached and the next op saved): the peak of
# device bytes, and what is held at it.


def region_call(trace: Trace, pair: Pair) -> int:
    """The module call that ``pair``'s region is (see NOTE [Replaying a traced step])."""
    calls = trace.calls
    top = [
        call.index
        for call in calls
        if call.pair == pair.index
        and not call.backward
        and (call.parent < 0 or calls[call.parent].pair != pair.index)
    ]
    outside = any(
        op.call < 0 or calls[op.call].pair != pair.index
        for op in trace.ops
        if op.pair == pair.index and not op.backward
    )
    if len(top) == 1 and not outside:
        return top[0]
    return pair.enclosing


def cached_ops(trace: Trace, pair: Pair) -> list[OpRecord]:
    """The forward ops of a selective region that its first recomputation did not run."""
    if not pair.selective or not pair.recomputed:
        return []
    # Views and detaches are left out: they make nothing, and both passes add their own.
    forward = [
        op
        for op in trace.ops
        if op.pair == pair.index and not op.backward and op.tick < pair.last_save and op.outputs
    ]
    again = [op.name for op in trace.ops if op.recomputing == pair.index and op.outputs]
    cached, position = [], 0
    for op in forward:
        if position < len(again) and again[position] == op.name:
            position += 1
        else:
            cached.append(op)
    return cached


def _policy_holds(trace: Trace, pair: Pair, call: int) -> list[Interval]:
    start = min(pair.recomputed.values())
    held = []
    for op in cached_ops(trace, pair):
        for key, nbytes in op.outputs:
            if key in trace.excluded:
                continue
            site = Site(op.call if op.call >= 0 else call, op.index, SAVED, "policy")
            held.append(Interval(key, nbytes, DEVICE, site, op.tick + 0.5, start - 0.5))
    return held


def _tag_inputs(trace: Trace, pair: Pair, call: int) -> None:
    """Show the saves of a region's inputs as the region's (see NOTE [Replaying ...])."""
    before = max((op.tick for op in trace.ops if op.tick < pair.tick and op.outputs), default=-1)
    arguments = None if call < 0 else {key for key, _ in trace.calls[call].tensors}
    for interval in trace.intervals:
        site = interval.site
        if not before < interval.start < pair.tick or site.status != SAVED:
            continue
        if arguments is not None and interval.key not in arguments:
            continue
        interval.site = replace(site, call=call, how="checkpoint input")


def finish(trace: Trace) -> dict[int, int]:
    """Add what the replay needs (see NOTE [Replaying a traced step]); each region's call."""
    regions = {}
    for pair in trace.pairs:
        if not pair.region:
            continue
        call = regions[pair.index] = region_call(trace, pair)
        _tag_inputs(trace, pair, call)
        trace.intervals.extend(_policy_holds(trace, pair, call))
    return regions


@dataclass(frozen=True)
class Replay:
    """The holds of a traced step, replayed in order."""

    peak: int
    """The peak of device bytes held."""
    host_peak: int
    peak_tick: float
    live: tuple[Interval, ...]
    """One interval per storage held at the device peak (the earliest), device and host; at the
    host's peak if nothing is ever held on the device."""
    ticks: tuple[float, ...]
    """Where the step was sampled for the chart."""
    parts: tuple[tuple[int, ...], ...]
    """Device bytes held at each sample, per part (the blocks, then everything else)."""


_Event = tuple[float, int, Interval]


def _events(intervals: Sequence[Interval]) -> list[_Event]:
    events: list[_Event] = []
    for interval in intervals:
        events.append((interval.start, 1, interval))
        if interval.end is not None:
            events.append((interval.end, -1, interval))
    events.sort(key=lambda event: (event[0], event[1]))  # a release first at the same tick
    return events


class _Sweep:
    """Storages held as the events go by, each counted once."""

    def __init__(self, parts: int, part_of: Callable[[Interval], int]) -> None:
        self.live: dict[tuple[Hashable, int], list[Interval]] = {}
        self.bytes = [0, 0]
        self.parts = [0] * parts
        self.part_of = part_of
        self.owner: dict[tuple[Hashable, int], int] = {}

    def apply(self, delta: int, interval: Interval) -> None:
        key = (interval.key, interval.where)
        held = self.live.setdefault(key, [])
        if delta > 0:
            if not held:
                self.bytes[interval.where] += interval.nbytes
                if interval.where == DEVICE:
                    part = self.owner[key] = self.part_of(interval)
                    self.parts[part] += interval.nbytes
            held.append(interval)
            return
        held.remove(interval)
        if held:
            return
        del self.live[key]
        self.bytes[interval.where] -= interval.nbytes
        if interval.where == DEVICE:
            self.parts[self.owner.pop(key)] -= interval.nbytes


def replay(
    trace: Trace, parts: int, part_of: Callable[[Interval], int], samples: int = 400
) -> Replay:
    """Replay the holds of ``trace``: the peak, what is held at it, and ``samples`` samples."""
    events = _events(trace.intervals)
    sweep = _Sweep(parts, part_of)
    peak, host_peak, at, host_at = 0, 0, -1, -1
    every = max(1, len(events) // samples)
    ticks: list[float] = []
    sampled: list[tuple[int, ...]] = []
    for index, (tick, delta, interval) in enumerate(events):
        sweep.apply(delta, interval)
        if sweep.bytes[DEVICE] > peak:
            peak, at = sweep.bytes[DEVICE], index
        if sweep.bytes[HOST] > host_peak:
            host_peak, host_at = sweep.bytes[HOST], index
        if index % every == 0 or index == len(events) - 1:
            ticks.append(tick)
            sampled.append(tuple(sweep.parts))
    if at < 0:  # nothing held on the device: what is held at the host's peak
        at = host_at
    again = _Sweep(parts, part_of)
    for _, delta, interval in events[: at + 1]:
        again.apply(delta, interval)
    live = tuple(min(held, key=lambda item: item.start) for held in again.live.values() if held)
    return Replay(
        peak=peak,
        host_peak=host_peak,
        peak_tick=events[at][0] if at >= 0 else 0.0,
        live=live,
        ticks=tuple(ticks),
        parts=tuple(sampled),
    )
