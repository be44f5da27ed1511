"""sync_gradients: bucketed gradient averaging driven by multi-grad hooks.

See NOTE [What a bucket averages].
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from tensorhooks._core.compile import runs_eagerly
from tensorhooks._core.errors import (
    GradientSyncError,
    SyncArgumentTypeError,
    SyncArgumentValueError,
)
from tensorhooks._core.late_grads import LANDING_ORDER, generation, lands_late
from tensorhooks._core.store import GraphTaskState, graph_task_store
from tensorhooks._core.torch_compat import (
    current_autograd_node,
    current_graph_task_id,
    fsdp2_modules,
    fsdp2_sharded_parameters,
    is_captured_accumulator,
    will_engine_execute_node,
)
from tensorhooks._hooks import register_multi_grad_hook

from .buckets import MIB, Bucket, assign_buckets

__all__ = ["GradientSyncHandle", "sync_gradients"]

# NOTE [What a bucket averages]
#
# DistributedDataParallel averages ``p.grad`` as it stands once the parameter's gradient
# accumulator has run: its reducer hooks the accumulator node's post hooks (reducer.cpp,
# ``grad_accumulator->add_post_hook``), which the engine calls after the node ran the tensor's
# hooks (registered before or after DDP), added the result to ``.grad`` and called
# ``register_post_accumulate_grad_hook`` hooks, which may change ``.grad`` in place. So gradients
# accumulated locally under ``no_sync()`` are averaged by the next synchronised backward, and
# what users' hooks do (clipping, scaling) is averaged too. The bucket's hook is called from a
# tensor hook of the last of its parameters to get a gradient, *before* that accumulation
# (checked on torch 2.13: the hook sees the old ``.grad``, and hooks registered after
# sync_gradients have not run). At that moment:
#   * every other parameter of the bucket that got a gradient has been accumulated already: its
#     accumulator ran to the end, post hooks included, before the engine went on (the nodes of
#     one device run one at a time on one thread, and a bucket holds one device), so ``p.grad``
#     is the value to average;
#   * the parameter whose hook is running is the one the engine is executing
#     (``current_autograd_node()`` is its accumulator): the bucket is left pending
#     (``GradientSyncHandle._deferred``) and is filled and launched from a post hook that
#     sync_gradients puts on every accumulator of the bucket, once that node has run;
#   * a parameter that gets no gradient in this backward keeps its ``.grad`` (or zeros), which
#     holds what earlier ``no_sync()`` steps accumulated.
# When the bucket's hook is called at the end of the task instead (multi-grad's late flush), no
# node is executing and every parameter is accumulated. The buffer is written as ``.grad * (1/W)``
# in one pass and summed across processes, as DDP's reducer does, so float64 results agree to the
# last bits.
#
# Unused parameters: each buffer ends with one flag per parameter, 1 where this process computed
# its gradient, in this backward or in a ``no_sync()`` backward since the last synchronised one
# (each bucket keeps that record, ``Bucket.used_since_sync``, as DDP keeps its used-map across
# no_sync steps; it is cleared once the averages are written back). After the sum a flag of 0
# means no process did, and that ``.grad`` is left as it was: the result DDP gives with
# ``find_unused_parameters=True``, at the cost of a few elements per bucket rather than a separate
# collective. The flags are only read back (a device sync on GPU) when this process had an unused
# parameter in the bucket; otherwise all are in use.
#
# Launch order: ranks must issue collectives in the same order, but buckets can complete in
# different orders on different ranks. Bucket i is launched only once buckets 0..i-1 are, and a
# bucket completed early waits in ``_SyncStep.ready``. When the first bucket of a backward
# completes, right after it is launched, buckets none of whose parameters will run in this graph
# task are marked ready, so an unused first bucket does not hold back every later one. Buckets
# still not ready at the end of the task (never fired) are filled from ``.grad`` and launched
# before waiting.
#
# Gradients that land late: a parameter streamed by ``offload_parameters`` has no ``.grad`` while
# backward runs (its post-accumulate hook moves the gradient to the host and writes ``.grad`` at the
# end of the graph task, see NOTE [Streaming parameters with hooks] in
# `_parameter_offload/streaming.py`). A bucket holding such a parameter (`lands_late` of
# `_core.late_grads`, asked when a step opens) is not filled when it completes: the step notes which
# of its parameters got a gradient (``_SyncStep.landing``), and the end-of-task callback, which runs
# after the one landing those gradients (a greater ``order``), fills it from the landed ``.grad``
# before launching in order. The average is then written into the host ``.grad``, as DDP averages
# ``.grad`` after accumulation; communication of such buckets does not overlap backward.
#
# Failure: a backward that raises never runs the end-of-task callback. What it launched stays
# with the handle (``_active``); the next synchronised backward, or ``remove()``, sees that the
# graph task is gone from the store, waits for those works (every rank that failed the same way
# launched the same ones), and only then writes into the buffers again.


_FIRST_BUCKET_BYTES = MIB
"""The first bucket is closed once it holds this much, so the first all-reduce starts early."""

# Parameters synchronised by a live handle, by id, with a weak reference to tell a reused id.
_synced: dict[int, weakref.ref[torch.Tensor]] = {}
_synced_lock = threading.Lock()


class _SyncStep:
    """What one synchronised backward call has done so far."""

    __slots__ = (
        "accumulates",
        "idle",
        "landing",
        "late",
        "lock",
        "next",
        "ready",
        "scan_pending",
        "sync",
        "task_id",
        "works",
    )

    def __init__(
        self, task_id: int, buckets: int, sync: bool, accumulates: bool, late: tuple[bool, ...]
    ) -> None:
        self.task_id = task_id
        self.late = late  # buckets filled at the end of the task: see NOTE [What a bucket ...]
        self.landing: dict[int, list[bool]] = {}  # late bucket -> which parameters got a grad
        self.sync = sync
        self.accumulates = accumulates  # False for torch.autograd.grad, which leaves .grad alone
        self.scan_pending = sync  # the buckets that will not run are yet to be marked ready
        self.lock = threading.Lock()  # buckets of several devices complete on several threads
        self.ready = [False] * buckets
        self.idle = [False] * buckets
        self.next = 0
        self.works: list[Any] = []  # torch.distributed Work objects, in launch order


class _Deferred:
    """A bucket completed by one of its parameters' hooks, to be filled once its node has run."""

    __slots__ = ("grads", "position", "step")

    def __init__(
        self, step: _SyncStep, grads: Sequence[torch.Tensor | None], position: int
    ) -> None:
        self.step = step
        self.grads = grads
        self.position = position  # the parameter whose accumulator is running


class GradientSyncHandle:
    """Averages gradients across processes at every backward; returned by `sync_gradients`.

    Attributes:
        process_group: the process group the gradients are averaged over.
        world_size: the number of processes in it.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        process_group: dist.ProcessGroup,
        bucket_cap_bytes: int,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._scale = 1.0 / self.world_size
        groups = assign_buckets(params, bucket_cap_bytes, _FIRST_BUCKET_BYTES)
        self._buckets = tuple(Bucket([params[i] for i in group]) for group in groups)
        self._key = object()
        self._lock = threading.Lock()
        self._no_sync_depth = 0
        self._active: _SyncStep | None = None
        self._params = tuple(params)
        self._deferred: list[_Deferred | None] = [None] * len(self._buckets)
        self._late: tuple[int, tuple[bool, ...]] = (-1, ())  # (generation, per bucket)
        # Graph tasks in which an accumulator of these parameters ran, possibly ended (an
        # insertion-ordered set, pruned when a backward call opens its step).
        self._touched: dict[int, None] = {}
        self._hooks = [
            register_multi_grad_hook(bucket.params, self._bucket_hook(index), mode="all")
            for index, bucket in enumerate(self._buckets)
        ]
        self._hooks += [
            node.register_hook(self._after_accumulation(index, position))
            for index, bucket in enumerate(self._buckets)
            for position, node in enumerate(bucket.accumulators)
        ]

    @property
    def buckets(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The parameters of each bucket, in launch order (reverse registration order)."""
        return tuple(bucket.params for bucket in self._buckets)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication: gradients of backward calls in the block accumulate locally.

        The first synchronised backward after the block averages the accumulated ``.grad``
        across processes, as DistributedDataParallel's ``no_sync`` does. Whether a backward
        call synchronises is decided when its first bucket completes.

        Example:
            >>> import torch, torch.distributed as dist, tempfile, os
            >>> from tensorhooks.distributed import sync_gradients
            >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            >>> model = torch.nn.Linear(2, 1)
            >>> handle = sync_gradients(model)
            >>> with handle.no_sync():
            ...     model(torch.ones(1, 2)).sum().backward()   # local only
            >>> model(torch.ones(1, 2)).sum().backward()       # averages both steps' sum
            >>> model.bias.grad
            tensor([2.])
            >>> handle.remove()
            >>> dist.destroy_process_group()

        Nesting and threads: blocks nest (a counter, restored on exceptions), and the setting
        belongs to the handle, not to the thread that entered the block: autograd runs hooks on
        its own device threads, which a thread-local flag would not reach. A backward call whose
        first bucket completes while some thread is inside a ``no_sync`` block of this handle
        skips communication; one that already started synchronising finishes. Each process must
        make the same choice for the same step, as with DistributedDataParallel.
        """
        with self._lock:
            self._no_sync_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._no_sync_depth -= 1

    def remove(self) -> None:
        """Stop synchronising: remove every hook. Calling it again does nothing.

        Raises:
            GradientSyncError: if called while a backward call is synchronising these
                parameters (a ``RuntimeError``).
        """
        with self._lock:
            step = self._active
            if step is not None and graph_task_store.is_live(step.task_id):
                raise GradientSyncError(
                    "sync_gradients: handle.remove() was called while backward call (graph task "
                    f"{step.task_id}) is synchronising these parameters; call remove() after "
                    "backward has returned (for example after optimizer.step())"
                )
            self._finish_abandoned()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        if hooks:
            _release(self._params)

    def _bucket_hook(self, index: int) -> Callable[[Sequence[torch.Tensor | None]], None]:
        def on_bucket_complete(grads: Sequence[torch.Tensor | None]) -> None:
            self._on_bucket_complete(index, grads)

        return on_bucket_complete

    def _after_accumulation(self, index: int, position: int) -> Callable[..., None]:
        """A post hook for the accumulator of parameter ``position`` of bucket ``index``."""
        deferred = self._deferred
        touched = self._touched

        @runs_eagerly  # See NOTE [Contexts under torch.compile]
        def after_accumulation(grad_inputs: Any, grad_outputs: Any) -> None:
            task_id = current_graph_task_id()
            touched[task_id] = None
            pending = deferred[index]
            if pending is None or pending.position != position or pending.step.task_id != task_id:
                return
            deferred[index] = None
            self._fill(pending.step, index, pending.grads)

        return after_accumulation

    def _on_bucket_complete(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        task = graph_task_store.current()
        step: _SyncStep | None = task.peek(self._key)
        if step is None:
            step = task.get(self._key, lambda: self._open_step(task, index, grads))
        bucket = self._buckets[index]
        if not step.sync:
            if step.accumulates:
                bucket.note_used(grads)
            return
        with step.lock:
            if step.ready[index] or index in step.landing:
                raise GradientSyncError(
                    f"sync_gradients: bucket {index} completed twice in one backward call "
                    f"(graph task {task.task_id}); this is a bug in tensorhooks, please report it"
                )
            if step.late[index]:  # filled once .grad has landed: see NOTE [What a bucket ...]
                step.landing[index] = [grad is not None for grad in grads]
                return
        node = current_autograd_node()
        position = None if node is None else bucket.position_of_node.get(id(node))
        if position is not None:
            # Called before this node adds the gradient to .grad and runs the hooks registered
            # after ours: fill once it has. See NOTE [What a bucket averages].
            self._deferred[index] = _Deferred(step, grads, position)
            return
        self._fill(step, index, grads)

    def _fill(self, step: _SyncStep, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Write bucket ``index`` from ``.grad``, launch what is ready, mark idle buckets."""
        with torch.no_grad():
            idle = self._buckets[index].fill(grads, self._scale)
        with step.lock:
            step.ready[index] = True
            step.idle[index] = idle
            self._launch_ready(step)
            scan, step.scan_pending = step.scan_pending, False
        if scan:
            self._mark_idle_buckets(step, index)

    def _open_step(
        self, task: GraphTaskState, index: int, grads: Sequence[torch.Tensor | None]
    ) -> _SyncStep:
        """Start the per-backward state at the first bucket to complete (under ``task.lock``)."""
        accumulates = not _captured(self._buckets[index], grads)
        sync = accumulates and self._no_sync_depth == 0
        step = _SyncStep(task.task_id, len(self._buckets), sync, accumulates, self._late_buckets())
        outer = self._other_live_task(task.task_id)
        if not sync:
            return step
        with self._lock:
            if outer is not None:
                raise GradientSyncError(_nested_message(task.task_id, outer))
            self._finish_abandoned()
            self._active = step
        # The callback must not hold the task: the task holds its callbacks, and a cycle would
        # keep this backward's state (buffered gradients included) alive until the next GC. It
        # runs after the multi-grad hooks' flush (order 0) and after late gradients land.
        task.on_end(functools.partial(self._end_step, step), order=LANDING_ORDER + 1)
        return step

    def _late_buckets(self) -> tuple[bool, ...]:
        """Which buckets hold a parameter whose ``.grad`` lands at the end of the task."""
        now = generation()
        known, late = self._late
        if known != now:
            late = tuple(any(map(lands_late, bucket.params)) for bucket in self._buckets)
            self._late = (now, late)
        return late

    def _other_live_task(self, task_id: int) -> int | None:
        """A graph task other than ``task_id`` that ran an accumulator of ours and is running.

        Forgets the ended ones. See NOTE [Nested backward calls].
        """
        other = None
        for seen in list(self._touched):
            if seen == task_id:
                continue
            if graph_task_store.is_live(seen):
                other = seen
            else:
                self._touched.pop(seen, None)
        return other

    def _mark_idle_buckets(self, step: _SyncStep, first: int) -> None:
        """Fill and mark ready the buckets none of whose parameters run in this backward.

        Called once per synchronised backward, after its first bucket (``first``) is launched.
        A bucket found here cannot complete in this backward, so no other thread touches it.
        """
        idle = [
            other
            for other, bucket in enumerate(self._buckets)
            if other != first and not any(map(will_engine_execute_node, bucket.accumulators))
        ]
        if not idle:
            return
        with torch.no_grad():
            for other in idle:
                self._buckets[other].fill_idle(self._scale)
        with step.lock:
            for other in idle:
                step.ready[other] = step.idle[other] = True
            self._launch_ready(step)

    def _launch_ready(self, step: _SyncStep) -> None:
        """Launch, in bucket order, every bucket whose predecessors are all launched."""
        while step.next < len(self._buckets) and step.ready[step.next]:
            flat = self._buckets[step.next].flat
            step.works.append(dist.all_reduce(flat, group=self.process_group, async_op=True))
            step.next += 1

    def _end_step(self, step: _SyncStep) -> None:
        """At the end of a synchronised backward: launch what is left, wait, write ``.grad``."""
        with step.lock, torch.no_grad():
            for index, used in step.landing.items():
                bucket = self._buckets[index]
                grads = [
                    p.grad if got else None for p, got in zip(bucket.params, used, strict=True)
                ]
                step.idle[index] = bucket.fill(grads, self._scale)
                step.ready[index] = True
            for index, bucket in enumerate(self._buckets):
                if not step.ready[index]:
                    bucket.fill_idle(self._scale)
                    step.ready[index] = step.idle[index] = True
            self._launch_ready(step)
        _wait_all(step.works)
        with torch.no_grad():
            for bucket, idle in zip(self._buckets, step.idle, strict=True):
                bucket.write_back(idle)
        with self._lock:
            if self._active is step:
                self._active = None

    def _finish_abandoned(self) -> None:
        """Wait for what a failed backward launched, so the buffers can be reused (under lock)."""
        step = self._active
        if step is None:
            return
        if graph_task_store.is_live(step.task_id):
            raise GradientSyncError(
                "sync_gradients: these parameters are already being synchronised by backward "
                f"call (graph task) {step.task_id}; two backward calls cannot synchronise the "
                "same parameters at once: run them one after the other, or, with "
                "torch.utils.checkpoint, pass use_reentrant=False"
            )
        self._active = None
        self._deferred[:] = [None] * len(self._deferred)
        _wait_all(step.works)


# NOTE [Nested backward calls]
#
# torch.utils.checkpoint(..., use_reentrant=True) recomputes each checkpointed block during
# backward and runs a nested backward call (a graph task of its own) through it, from inside a node
# of the outer one. A bucket's multi-grad hook counts per graph task, so a bucket whose parameters
# run in several tasks completes once in each, and the outer task, when it opens its step, counts
# the buckets of checkpointed blocks as idle (none of their accumulators runs in it) and launches
# them with stale ``.grad``. The engine does not say which task a nested one runs in, so that cannot
# be undone soundly; DistributedDataParallel needs ``static_graph=True`` for the same reason. It is
# refused instead, at the first synchronised backward: a backward call that opens a synchronised
# step while another graph task that ran an accumulator of these parameters is still running
# raises, with the advice to pass ``use_reentrant=False`` (same gradients, one graph task). The
# post hook on every accumulator records the tasks (``_touched``). Two threads running backward
# on these parameters at once are refused by the same check. Not caught: a model whose
# synchronised parameters all sit inside reentrant checkpoints, where the outer task runs none of
# their accumulators; there every nested task synchronises on its own, which averages each
# gradient once it is complete (averaging what is already averaged changes nothing, up to
# rounding when the world size is not a power of two), at the cost of extra collectives.


def _nested_message(task_id: int, outer: int) -> str:
    return (
        f"sync_gradients: backward call (graph task {task_id}) reached these parameters while "
        f"another backward call that reached them (graph task {outer}) is still running. "
        "torch.utils.checkpoint(..., use_reentrant=True) does this: it runs a nested backward "
        "for each checkpointed block, and gradients split across backward calls cannot be "
        "averaged as one step. Pass use_reentrant=False, which gives the same gradients "
        "(transformers: model.activation_checkpointing_enable(activation_checkpointing_kwargs="
        "{'use_reentrant': False})); DistributedDataParallel needs static_graph=True for "
        "reentrant checkpointing. Two threads running backward on these parameters at once do "
        "this too: run them one after the other"
    )


def _wait_all(works: list[Any]) -> None:
    # Pop before waiting: a work that failed is reported once, not again at every later step.
    while works:
        works.pop(0).wait()


def _captured(bucket: Bucket, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether the gradients are captured by ``torch.autograd.grad`` rather than accumulated.

    The engine raises when asked about an accumulator that the running task captures (see
    NOTE [Counting the gradients an "all" hook waits for] in `_hooks/multigrad.py`).
    """
    for node, grad in zip(bucket.accumulators, grads, strict=True):
        if grad is not None:
            return is_captured_accumulator(node)
    return False


def _collect_params(
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
) -> list[torch.Tensor]:
    if isinstance(module_or_params, torch.nn.Module):
        candidates: list[Any] = list(module_or_params.parameters())
    elif isinstance(module_or_params, torch.Tensor):
        raise SyncArgumentTypeError(
            "sync_gradients: module_or_params must be a Module or an iterable of tensors, got a "
            "single Tensor; wrap it in a list: sync_gradients([tensor])"
        )
    elif isinstance(module_or_params, (str, bytes)):  # type: ignore[unreachable]  # a mistake seen
        raise SyncArgumentTypeError(
            "sync_gradients: module_or_params must be a Module or an iterable of tensors, got "
            f"the {type(module_or_params).__name__} {module_or_params!r}; pass the module "
            "object itself (sync_gradients(model)), or model.parameters()"
        )
    else:
        try:
            candidates = list(module_or_params)
        except TypeError:
            raise SyncArgumentTypeError(
                "sync_gradients: module_or_params must be a Module or an iterable of tensors, "
                f"got {module_or_params!r} of type {type(module_or_params).__name__}"
            ) from None
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for index, param in enumerate(candidates):
        if not isinstance(param, torch.Tensor):
            raise SyncArgumentTypeError(
                f"sync_gradients: parameter {index} is {param!r} of type "
                f"{type(param).__name__}, not a torch.Tensor; pass a Module or tensors"
            )
        if not param.requires_grad or id(param) in seen:
            continue
        if not param.is_leaf:
            raise SyncArgumentValueError(
                f"sync_gradients: parameter {index} (shape {tuple(param.shape)}) is not a leaf "
                f"tensor (grad_fn={type(param.grad_fn).__name__}); gradients are only "
                "accumulated into .grad of leaves: pass parameters, not results of operations"
            )
        seen.add(id(param))
        params.append(param)
    return params


def _claim(params: Sequence[torch.Tensor]) -> None:
    with _synced_lock:
        for index, param in enumerate(params):
            ref = _synced.get(id(param))
            if ref is not None and ref() is param:
                raise SyncArgumentValueError(
                    f"sync_gradients: parameter {index} (shape {tuple(param.shape)}) is already "
                    "synchronised by another handle; call .remove() on that handle first, or "
                    "its gradients would be averaged twice"
                )
        for param in params:
            _synced[id(param)] = weakref.ref(param)


def _release(params: Sequence[torch.Tensor]) -> None:
    with _synced_lock:
        for param in params:
            ref = _synced.get(id(param))
            if ref is not None and ref() is param:
                del _synced[id(param)]


def _refuse_fsdp2(module_or_params: object, params: list[torch.Tensor]) -> None:
    """Raise for a model sharded by FSDP2: it reduces its gradients itself."""
    sharded = fsdp2_sharded_parameters()
    in_module = isinstance(module_or_params, torch.nn.Module) and fsdp2_modules(module_or_params)
    if in_module or any(id(param) in sharded for param in params):
        raise SyncArgumentValueError(
            "sync_gradients: the model is sharded by FSDP2 (fully_shard), which reduce-scatters "
            "its gradients itself in backward; averaging them again would be wasted work, and its "
            "sharded parameters never get an autograd gradient to start from. Drop "
            "sync_gradients for this model (FSDP2's gradients are already averaged across "
            "ranks); to skip communication while accumulating, use "
            "model.set_requires_gradient_sync(False)"
        )


def sync_gradients(
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = 25.0,
) -> GradientSyncHandle:
    """Average the parameters' gradients across processes at every backward, as DDP does.

    Parameters that require grad are grouped into buckets of at most ``bucket_cap_mb`` MiB, in
    reverse registration order, by dtype and device; the first bucket is closed as soon as it
    holds 1 MiB, so that communication starts after the last layer's gradients, as in DDP.
    Each bucket has one multi-grad hook: when all of its gradients of a backward call are
    computed, they are copied into the bucket's flat buffer and an asynchronous ``all_reduce``
    starts, while backward goes on computing the rest. When backward ends, every ``.grad``
    holds the average over the processes of the group of what ``.grad`` would hold without
    synchronisation: the values `torch.nn.parallel.DistributedDataParallel` gives.

    Parameters that get no gradient in a step on some processes are handled as DDP does with
    ``find_unused_parameters=True``: they are averaged with zeros from those processes, and a
    parameter no process computed a gradient for keeps its ``.grad`` unchanged. Calls of
    ``torch.autograd.grad`` do not touch ``.grad`` and are not synchronised.

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from tensorhooks.distributed import sync_gradients
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> handle = sync_gradients(model, bucket_cap_mb=5e-5)  # 52 bytes
        >>> [[tuple(p.shape) for p in bucket] for bucket in handle.buckets]
        [[(1,), (1, 4), (4,)], [(4, 4)]]
        >>> model(torch.ones(2, 4)).sum().backward()     # each .grad now averaged over ranks
        >>> model[1].bias.grad
        tensor([2.])
        >>> handle.remove()
        >>> dist.destroy_process_group()

    Args:
        module_or_params: a module, whose ``parameters()`` are synchronised, or an iterable of
            leaf tensors. Tensors that do not require grad are skipped.
        process_group: the group to average over; the default group when ``None``.
        bucket_cap_mb: the largest bucket, in MiB (a larger parameter gets a bucket of its own).

    Returns:
        A `GradientSyncHandle`: ``handle.no_sync()`` skips communication for gradient
        accumulation, ``handle.remove()`` stops synchronising.

    Raises:
        SyncArgumentTypeError: if ``module_or_params`` is not a module or an iterable of
            tensors, ``bucket_cap_mb`` is not a number, or ``process_group`` is not a process
            group (a ``TypeError``).
        SyncArgumentValueError: if ``bucket_cap_mb`` is not finite and positive, no tensor
            requires grad, a tensor is not a leaf or is already synchronised by another handle,
            this process is not in ``process_group``, torch.distributed is not initialised, or
            the model is sharded by FSDP2 (``fully_shard``), which reduces its gradients itself
            (a ``ValueError``).
        GradientSyncError: from ``backward()``, if a gradient is sparse or two backward calls
            synchronise the same parameters at once (a ``RuntimeError``); from ``handle.remove()``
            during a synchronising backward.

    Every process must call backward the same number of times on these parameters, as with
    DistributedDataParallel; the end of backward waits for the other processes.
    """
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise SyncArgumentTypeError(
            f"sync_gradients: bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r} of "
            f"type {type(bucket_cap_mb).__name__}"
        )
    if not math.isfinite(bucket_cap_mb):
        raise SyncArgumentValueError(
            f"sync_gradients: bucket_cap_mb must be a finite number of MiB, got {bucket_cap_mb!r}; "
            "the default is 25.0 (DistributedDataParallel's)"
        )
    cap_bytes = int(bucket_cap_mb * MIB)
    if not cap_bytes > 0:
        raise SyncArgumentValueError(
            f"sync_gradients: bucket_cap_mb must be positive (at least one byte), got "
            f"{bucket_cap_mb!r}; the default is 25.0"
        )
    # The parameters first: a wrong first argument is reported even without a process group.
    params = _collect_params(module_or_params)
    _refuse_fsdp2(module_or_params, params)
    if not params:
        raise SyncArgumentValueError(
            "sync_gradients: no tensor requires grad, so there is nothing to synchronise; pass "
            "the module or parameters that are trained"
        )
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise SyncArgumentValueError(
                "sync_gradients: torch.distributed has no default process group; call "
                "torch.distributed.init_process_group(...) first (torchrun sets up its "
                "environment), or pass process_group"
            )
        process_group = dist.group.WORLD
        assert process_group is not None  # narrowed: initialised above
    elif not isinstance(process_group, dist.ProcessGroup):
        raise SyncArgumentTypeError(
            f"sync_gradients: process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {process_group!r} of type {type(process_group).__name__}"
        )
    world_size = dist.get_world_size(process_group)
    if world_size < 1:
        raise SyncArgumentValueError(
            f"sync_gradients: this process (global rank {dist.get_rank()}) is not a member of "
            f"process_group (world size {world_size}); call sync_gradients only on its ranks"
        )
    _claim(params)
    try:
        return GradientSyncHandle(params, process_group, cap_bytes)
    except BaseException:
        _release(params)
        raise
