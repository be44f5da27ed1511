"""The takeover of saved-tensor hooks the context did not install (torch's own), and their saves.

See NOTE [Saved-tensor hooks the context did not install] and
NOTE [Checking foreign saves in backward] below.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

import torch

from tensorhooks._core.compile import runs_eagerly
from tensorhooks._core.errors import UnguardedHooksError
from tensorhooks._core.guards import (
    PackHook,
    current_save_guard,
    is_protected_pack_hook,
    register_protected_pack_hook,
)
from tensorhooks._core.torch_compat import (
    OpOverload,
    current_graph_task_id,
    get_disabled_hooks_message,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    storage_key,
    top_saved_tensors_hooks,
)

from .aliasing import byte_span, reaches
from .op_writes import tensors_in, written_values
from .saved_tensor import unseen_write_error

__all__ = [
    "ForeignSave",
    "Untied",
    "check_foreign_saves",
    "foreign_saves",
    "take_over_innermost_hooks",
    "tie_foreign_saves",
]

# NOTE [Saved-tensor hooks the context did not install]
#
# torch's own ``saved_tensors_hooks`` (and its subclasses: torch's ``save_on_cpu``, the hooks of
# ``torch.utils.checkpoint``) cannot be intercepted when they are pushed. The context takes such a
# pair over the first time it sees it innermost: it pops it and pushes the pair wrapped by the
# save guard in force (``guard.wrap(pack, unpack)``), so what it saves from then on is tracked and
# cloned before a write, as for pairs pushed with tensorhooks. ``saved_tensors_hooks.__exit__``
# only pops, so the swap is invisible to the code that pushed the pair.
#
# When to look: tensors are saved when autograd creates a node, and every node takes the next
# number of the thread's sequence counter. The mode reads that counter on every operator (a few
# tens of nanoseconds) and reads the innermost pair (a few hundred) only when it moved since the
# last look. Autograd saves a node's inputs before the operator reaches the mode, so the inputs
# of the operator at which a pair is taken over may already sit in what the foreign pack kept:
# they are recorded (weakly, by storage) as *foreign saves*, and a later write that reaches one
# of them raises ``UnguardedHooksError`` instead of changing what backward may read. Outputs are
# saved after the operator returns, through the wrapped pair.
#
# Exceptions:
# - ``torch.utils.checkpoint``'s forward pair stores no tensor data (a holder per save); it is
#   left as it is (wrapping it would keep every tensor alive that it means to free).
# - its recomputation pair (pushed in backward around the recomputed forward) hands what it saves
#   to the checkpoint frame directly, past any unpack: wrapping cannot protect it. Everything it
#   saves is recorded as a foreign save for the graph task running the recomputation, so a
#   write during recomputation that reaches a tensor recomputed for backward raises.
# - tensors saved under a foreign pair before any operator reached the mode (a custom Function
#   whose forward runs no operator, ``checkpoint``'s own inputs saved as the first thing) are
#   not seen. See the Limits section of docs/allow_mutation_on_saved_tensors.md.

_CHECKPOINT_MODULE = "torch.utils.checkpoint"
_CHECKPOINT_FORWARD_PACK = "_checkpoint_hook."
_CHECKPOINT_RECOMPUTATION_PACK = "_recomputation_hook."


class ForeignSave:
    """A tensor that hooks the context did not install may hold: writes reaching it raise."""

    __slots__ = ("hook_name", "ref", "slack", "task", "version")

    def __init__(self, tensor: torch.Tensor, hook_name: str, task: int | None) -> None:
        self.ref = weakref.ref(tensor)
        self.hook_name = hook_name
        # The graph task whose recomputation saved it; None: until the tensor dies.
        self.task = task
        # Versions it may be at with no write the mode did not see (a seen write to another
        # part of its storage moves the shared counter). See
        # NOTE [Detecting writes the context did not see] in `saved_tensor.py`.
        self.version = tensor._version
        self.slack = 0

    def check_version(self) -> None:
        """Raise autograd's in-place error if a write the mode did not see changed the tensor."""
        tensor = self.ref()
        if tensor is not None and not self.version <= tensor._version <= self.version + self.slack:
            raise unseen_write_error(tensor, self.version)


# Foreign saves and weak references to the outputs of the operator that saved them.
Untied: TypeAlias = tuple[list[ForeignSave], list[weakref.ref[torch.Tensor]]]


class _WatchingMode(Protocol):
    """What the dispatch mode remembers between operators, as the takeover reads and sets it."""

    known_pack: object
    untied: Untied | None


# Storage key -> foreign saves on that storage, on every thread; guarded by the lock.
foreign_saves: dict[int | None, list[ForeignSave]] = {}
_foreign_saves_lock = threading.Lock()


def _record_foreign_saves(
    tensors: Sequence[torch.Tensor], hook_name: str, task: int | None
) -> list[ForeignSave]:
    made = []
    with _foreign_saves_lock:
        for tensor in tensors:
            key = storage_key(tensor)
            records = [
                record
                for record in foreign_saves.get(key, ())
                if record.ref() is not None and (record.task is None or record.task == task)
            ]
            made.append(ForeignSave(tensor, hook_name, task))
            records.append(made[-1])
            foreign_saves[key] = records
    return made


def check_foreign_saves(func: OpOverload, written: Sequence[torch.Tensor], resizes: bool) -> None:
    """Raise if ``written`` can reach a tensor that hooks the context did not install kept."""
    task = current_graph_task_id()
    for tensor in written:
        key = storage_key(tensor)
        records = foreign_saves.get(key)
        if not records:
            continue
        span = None if key is None else byte_span(tensor, resizes)
        live = []
        for record in records:
            saved = record.ref()
            if saved is None or (record.task is not None and record.task != task):
                continue
            live.append(record)
            if span is not None:
                if not reaches(span, saved):
                    record.slack += 1  # the write moves the shared version counter
                    continue
            elif key is not None:
                continue
            raise _foreign_write_error(func, record.hook_name)
        with _foreign_saves_lock:
            if live:
                foreign_saves[key] = live
            else:
                foreign_saves.pop(key, None)


def _foreign_write_error(func: OpOverload, name: str) -> UnguardedHooksError:
    return UnguardedHooksError(
        f"allow_mutation_on_saved_tensors: in-place operator {func} writes a tensor that "
        f"saved-tensor hooks not pushed by tensorhooks (pack hook {name!r}) may hold for "
        "backward: it was saved before the context could take those hooks over (or by "
        "torch.utils.checkpoint's recomputation), so the write could silently change what "
        "backward reads. Push the hooks with tensorhooks.saved_tensors_hooks (or use "
        "tensorhooks.save_on_cpu), which keep the protection, write to a copy, or, inside a "
        "checkpointed function, use an out-of-place operator (h = h + f(h))."
    )


def _recording_pack(pack: PackHook, hook_name: str, task: int) -> PackHook:
    """``pack``, recording what it returns as foreign saves of graph task ``task``."""

    def recording_pack(tensor: torch.Tensor) -> object:
        packed = pack(tensor)
        _record_foreign_saves(tensors_in((packed,)), hook_name, task)
        return packed

    register_protected_pack_hook(recording_pack)
    return recording_pack


def take_over_innermost_hooks(
    mode: _WatchingMode, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[ForeignSave]:
    """Swap a foreign innermost pair for its guarded version.

    Returns the foreign saves recorded for this operator's inputs that the saving node must
    check (see `_call_and_tie` in `dispatch_mode.py`). See
    NOTE [Saved-tensor hooks the context did not install].
    """
    top = top_saved_tensors_hooks()
    if top is None or top[0] is mode.known_pack:
        return []
    pack, unpack = top
    if is_protected_pack_hook(pack) or get_disabled_hooks_message() is not None:
        mode.known_pack = pack
        return []
    name = getattr(pack, "__qualname__", None) or type(pack).__name__
    checkpoint = getattr(pack, "__module__", None) == _CHECKPOINT_MODULE
    if checkpoint and name.startswith(_CHECKPOINT_FORWARD_PACK):
        mode.known_pack = pack  # stores no tensor data
        return []
    # This operator's inputs may already be in what ``pack`` kept; what it writes was not
    # (autograd saves a copy of an input an in-place formula needs).
    written = {id(value) for value in written_values(func, args, kwargs)}
    inputs = [t for t in tensors_in((*args, *kwargs.values())) if id(t) not in written]
    records: list[ForeignSave] = []
    if checkpoint and name.startswith(_CHECKPOINT_RECOMPUTATION_PACK):
        task = current_graph_task_id()
        _record_foreign_saves(inputs, name, task)
        new_pack, new_unpack = _recording_pack(pack, name, task), unpack
    else:
        records = _record_foreign_saves(inputs, name, None)
        new_pack, new_unpack = current_save_guard().wrap(pack, unpack)
    pop_saved_tensors_hooks()
    push_saved_tensors_hooks(new_pack, new_unpack)
    mode.known_pack = new_pack
    return records


# NOTE [Checking foreign saves in backward]
#
# A write made where the mode cannot see it (on a thread with no open context) can change a
# foreign save with no error at the write; what torch's pack kept has no version check of its
# own (autograd skips its check once hooks are installed). The operator at which the pair is
# taken over is therefore run by the handler itself (`_call_and_tie` in `dispatch_mode.py`),
# which keeps weak references to its outputs and looks at them on the thread's next operator (it
# forces one more pass through the slow branch): by then autograd has set their ``grad_fn``, the
# node that saved the inputs. A pre-hook on that node compares each foreign save's version
# before the node unpacks them and raises autograd's in-place error on a change. If that next
# operator already runs in backward (the output was backwarded at once), the versions are
# compared there, before the node's formula has read anything. Cost: one operator per take-over,
# nothing per operator otherwise.


def tie_foreign_saves(mode: _WatchingMode, untied: Untied) -> None:
    """Hook the node that saved ``untied``'s records, or check them now."""
    records, outputs = untied
    mode.untied = None
    nodes = {}
    for ref in outputs:
        output = ref()
        node = None if output is None else output.grad_fn
        if node is not None:
            nodes[id(node)] = node
    if not nodes or current_graph_task_id() != -1:  # no node to hook, or already in backward
        for record in records:
            record.check_version()
        if not nodes:
            return

    @runs_eagerly  # a version check: traced, Dynamo would decide it at trace time
    def check(*_: object) -> None:
        for record in records:
            record.check_version()

    for node in nodes.values():
        node.register_prehook(check)
