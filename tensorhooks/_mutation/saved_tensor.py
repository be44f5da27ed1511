"""What autograd stores for a tensor saved in the context, and the check made when it is read.

`make_pack` gives a context its pack hook and its tracker; both return a `SavedTensor`, a
handle whose tensor the context replaces by a clone before a write reaches it
(`context_state`), and `unpack` hands that tensor back unless a write the context did not see
changed it. See NOTE [Detecting writes the context did not see] below.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NoReturn

import torch

from tensorhooks._core.errors import MutationContextExitedError, SavedTensorModifiedError
from tensorhooks._core.guards import modified_message, register_protected_pack_hook
from tensorhooks._core.torch_compat import (
    PYTHON_DISPATCH_KEY,
    is_dispatch_key_excluded,
    is_newest_node,
    set_dispatch_key_excluded,
    set_version_counters,
)

__all__ = [
    "PLAIN_TENSOR_TYPES",
    "SavedTensor",
    "Track",
    "check_version",
    "holds_weight",
    "is_weight",
    "make_pack",
    "settle",
    "settle_to_original",
    "shares_version_counter",
    "unpack",
    "unseen_write_error",
]

# Tensor types whose detach never needs Python dispatch (no __torch_dispatch__ of their own).
PLAIN_TENSOR_TYPES = frozenset(
    t for t in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if t
)

_EXITED_MESSAGE = (
    # torch's own sentence first, as torch writes it (no space in "contextin", on 2.11 to 2.15),
    # for code that matches it
    "Trying to backward outside of the 'allow_mutation_on_saved_tensors' contextin which the "
    "graph was originally recorded. "
    "allow_mutation_on_saved_tensors: backward needed a tensor saved inside the context, but the "
    "context has exited (or was cleared) since the forward pass recorded the graph, so in-place "
    "changes made after that were not tracked. Run backward inside the same "
    "`with tensorhooks.allow_mutation_on_saved_tensors():` block as the forward pass."
)


class SavedTensor:
    """What autograd stores for a tensor saved in the context: an alias of it, or its clone.

    ``tensor`` is emptied when the context closes; reading it then raises.
    """

    __slots__ = (
        "__weakref__",
        "of_weight",
        "original",
        "original_version",
        "slack",
        "tensor",
        "version",
    )

    tensor: torch.Tensor
    # The versions ``tensor`` may be at with no write the context did not see: from ``version``
    # to ``version + slack``. See NOTE [Detecting writes the context did not see].
    version: int
    slack: int
    # Set by a clone until the first read settles which of the two backward gets: the tensor
    # before the write and its version counter then. See NOTE [Writes autograd does not count].
    # ``version`` is PENDING meanwhile.
    original: torch.Tensor
    original_version: int
    # Set, True, when ``tensor`` is a detached alias of a view of a weight (`is_weight`), which
    # the alias itself no longer tells. Unset otherwise: read it with `holds_weight`.
    of_weight: bool

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached when a slot is empty, i.e. after the context closed.
        if name == "tensor":
            raise MutationContextExitedError(_EXITED_MESSAGE)
        raise AttributeError(name)


# NOTE [Detecting writes the context did not see]
#
# Cloning before a write protects saved tensors from the writes the dispatch mode sees. Some it
# cannot see: a write on a thread with no open context, a write to a sparse tensor's values or
# indices (another storage, the same version counter), a write under saved-tensor hooks that
# tensorhooks did not install. Each handle therefore records its tensor's version counter at
# save, and unpacking compares: a mismatch means a write changed the tensor with no clone taken,
# and backward raises autograd's own in-place error instead of reading changed data. A write the
# mode did see and that left a saved tensor unchanged (a non-overlapping slice of its storage)
# still moves the shared counter. The mode runs below autograd, which bumps the counter after the
# op returns, so after such a write each handle on that storage accepts its current version up
# to one more per tensor written there (``slack``). Costs: two ints per save, one comparison per
# unpack, and, after a write that reaches a storage holding saved tensors, one pass over that
# storage's handles.


# NOTE [Writes autograd does not count]
#
# FSDP2 frees the storage of its unsharded parameters after forward (resized to zero bytes, which
# no operator sees) and writes them again before backward: the saved weights then read their
# save-time values, and a clone taken just before that write would copy freed memory. Its default
# copy-out (``fsdp::split_with_sizes_copy``) is known by name and never cloned (`op_writes`). Its
# other paths (one rank; parameters sharded on a dimension other than 0) write with ``copy_`` and
# ``cat(out=)`` under ``torch.autograd._unsafe_preserve_version_counter``, which puts the version
# counters back: their author tells autograd the write changes nothing backward needs. The mode
# cannot know yet how the counters will end, so such a write is cloned as any other, the handle
# keeps the tensor before the write too, and the first read settles: if the saved tensor's
# counter is where it was before the write, backward reads the tensor itself, as plain autograd
# would; otherwise the clone. Until it settles the handle stays indexed by its storage, so that a
# later write settles it first (a write counted there, after a refill, is cloned from the
# refilled values). This is done only where it is safe and free:
#   - for weights (`is_weight`: a leaf that requires grad, or a view of one), which live as long
#     as the model, so keeping them costs no memory; an activation's storage is released as soon
#     as the clone is taken, as before (and as torch's context does). A view of a weight that the
#     pack hook holds through a detached alias is one too (`holds_weight`): the alias no longer
#     says so, and a clone of the freed memory would otherwise be final. So is a weight that
#     tensorhooks.checkpoint tracks for its recomputation (it hands over the weight itself);
#   - for a write of a single tensor through an alias sharing the saved tensor's counter (asked
#     at the write, `shares_version_counter`). A write through ``.data`` (a counter of its own)
#     keeps the clone, and so does a list write (``_foreach_mul_``, ``out=`` lists), which under
#     a dispatch mode leaves every counter alone, so its counters tell nothing.
PENDING = -1


def settle_to_original(saved: SavedTensor) -> bool:
    """Decide between the clone and the tensor itself; whether it is the tensor itself.

    At the first read after a clone, or at the next write reaching the tensor.
    """
    original = saved.original
    uncounted = original._version == saved.original_version
    if uncounted:
        saved.tensor = original
        saved.version = saved.original_version
    else:
        saved.version = saved.tensor._version
    saved.slack = 0
    del saved.original
    return uncounted


def settle(saved: SavedTensor) -> torch.Tensor:
    """`settle_to_original`, at a read: the tensor backward gets."""
    settle_to_original(saved)
    return saved.tensor


def is_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a leaf that requires grad (a weight), or a view of one."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def holds_weight(saved: SavedTensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, what ``saved`` holds, is a weight or an alias the pack hook made of one.

    A view of a weight saved while its node is the newest one (a checkpoint region's argument
    ``w[3]``) is held through a detached alias, which is no view and requires no grad.
    """
    return is_weight(tensor) or getattr(saved, "of_weight", False)


def _detached_saved(saved: SavedTensor, tensor: torch.Tensor) -> None:
    """Hold ``tensor`` through a detached alias, noting whether it was a view of a weight."""
    saved.tensor = _detached(tensor)
    if tensor._base is not None and is_weight(tensor):
        saved.of_weight = True


def shares_version_counter(saved: torch.Tensor, written: torch.Tensor) -> bool:
    """Whether ``written`` moves ``saved``'s version counter: an alias made by autograd.

    Asked of the counters themselves (one is moved and put back): inside the dispatch mode an
    alias made to remember ``written`` would get a counter of its own.
    """
    try:
        before = written._version
        if saved._version != before:
            return False
        set_version_counters((written,), (before + 1,))
    except RuntimeError:  # an inference tensor has no counter: it shares none
        return False
    try:
        return saved._version == before + 1
    finally:
        set_version_counters((written,), (before,))


def unseen_write_error(tensor: torch.Tensor, saved_version: int) -> SavedTensorModifiedError:
    """Autograd's in-place error for ``tensor``, changed by a write the context did not see."""
    try:
        type_name = tensor.type()
    except RuntimeError:  # layouts without a legacy type name (sparse CSR)
        type_name = f"{tensor.layout} {tensor.dtype}"
    return SavedTensorModifiedError(
        modified_message(type_name, list(tensor.shape), tensor._version, saved_version)
        + " Hint: the tensor was saved inside allow_mutation_on_saved_tensors() and then changed "
        "in place by a write the context did not see, so it could not keep the save-time value: "
        "a write made on a thread with no open context, through a sparse tensor's components, or "
        "under saved-tensor hooks that tensorhooks did not install. Make the write inside the "
        "context on the thread that runs the forward pass, or write to a copy."
    )


def check_version(saved: SavedTensor, tensor: torch.Tensor) -> None:
    """Raise if a write the context did not see changed ``tensor`` (a mismatch, the slow path)."""
    if not saved.version <= tensor._version <= saved.version + saved.slack:
        raise unseen_write_error(tensor, saved.version)


def unpack(saved: SavedTensor) -> torch.Tensor:
    """Hand back what ``saved`` holds, unless a write the context did not see changed it."""
    tensor = saved.tensor
    if tensor._version != saved.version:
        if saved.version == PENDING:
            return settle(saved)
        check_version(saved, tensor)
    return tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()``, made without entering this context's dispatch mode where possible."""
    if type(tensor) not in PLAIN_TENSOR_TYPES:
        return tensor.detach()
    # detach() would otherwise go through the dispatch mode (microseconds).
    was_excluded = is_dispatch_key_excluded(PYTHON_DISPATCH_KEY)
    set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, True)
    try:
        return tensor.detach()
    finally:
        set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, was_excluded)


_Pack = Callable[[torch.Tensor], SavedTensor]
Track = Callable[[torch.Tensor, bool], SavedTensor]


def make_pack(pending: set[weakref.ref[SavedTensor]]) -> tuple[_Pack, Track]:
    """Return the context's pack hook and its tracker; handles go into ``pending``.

    ``track(tensor, is_output)`` makes the handle of a tensor whose ``is_output`` test was made
    earlier (guarded user pairs, see `_GuardedPair.pack` in `guarded_pairs.py`); ``pack`` tests
    now. See NOTE [Clone before write] in `context.py` for why saved outputs are held through a
    detached alias. Handles stay in ``pending`` until a write indexes them.
    """
    add = pending.add
    discard = pending.discard
    newest = is_newest_node

    def pack(tensor: torch.Tensor) -> SavedTensor:
        # The hot path: is_output_of_saving_node and track inlined.
        saved = SavedTensor()
        grad_fn = tensor.grad_fn
        if grad_fn is None or not newest(grad_fn):
            saved.tensor = tensor
        else:
            _detached_saved(saved, tensor)
        saved.version = tensor._version
        saved.slack = 0
        add(weakref.ref(saved, discard))
        return saved

    def track(tensor: torch.Tensor, is_output: bool) -> SavedTensor:
        saved = SavedTensor()
        if is_output:
            _detached_saved(saved, tensor)
        else:
            saved.tensor = tensor
        saved.version = tensor._version
        saved.slack = 0
        add(weakref.ref(saved, discard))
        return saved

    register_protected_pack_hook(pack)
    return pack, track
