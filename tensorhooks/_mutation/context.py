"""allow_mutation_on_saved_tensors: change tensors saved for backward in place, safely.

The public context manager. What autograd stores for a saved tensor is in `saved_tensor`, a
context's state in `context_state`, which saved tensors a write reaches in `aliasing`, the
dispatch mode that clones them before the write in `dispatch_mode` (with the operators' write
schemas in `op_writes`), user hooks pushed inside in `guarded_pairs`, and the takeover of
torch's own hooks in `foreign_hooks`. See NOTE [Clone before write] below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from tensorhooks._core.compile import not_traced
from tensorhooks._core.guards import use_save_guard
from tensorhooks._core.torch_compat import pop_saved_tensors_hooks, push_saved_tensors_hooks

from .context_state import MutationContext
from .dispatch_mode import add_open_context, mode_for_this_thread, remove_open_context
from .saved_tensor import unpack

__all__ = ["MutationContext", "allow_mutation_on_saved_tensors"]

# NOTE [Clone before write]
#
# Inside the context every tensor autograd saves goes through our pack hook, which returns a
# small handle (``SavedTensor``) holding the tensor; the unpack hook hands back whatever the
# handle holds. A
# TorchDispatchMode sees every operator; just before an operator writes to a tensor it finds the
# saved tensors that share the written tensor's storage and whose byte span overlaps the span the
# write can reach, clones each of them and puts the clone in its handle. Backward therefore sees
# the saved values whatever alias the write went through: the tensor itself, a view, its base, a
# transposed or strided view, an overlapping slice, an ``out=`` argument, a foreach list.
#
# Aliasing is decided by storage identity (the StorageImpl address) and byte spans (storage
# offset, sizes, strides and element size give the lowest and highest byte an access can reach).
# Spans are conservative: two strided views that interleave without sharing an element still
# "overlap" and the saved one is cloned. An ``out=`` argument, or the tensor given to a resizing
# op (``resize_``, ``set_``), may be resized by the op, so its span runs from its storage offset
# to the end of the storage. torch 2.13 keys on ``(data_ptr(), _version)`` instead, and misses a
# write through any alias whose first element is elsewhere, or made after an unrelated write
# bumped the shared version counter.
#
# Costs, in the order they are paid:
#   every operator: one dict lookup keyed by the OpOverload's id. What an op writes is read from
#       its schema (``alias_info.is_write``) the first time it is seen; ops that write nothing
#       are then called straight through the C++ operator (``op_call`` of `_core.torch_compat`),
#       skipping ``OpOverload.__call__``.
#   every saved tensor: one handle and one weak reference, added to the context's pending set
#       (whose discard is the reference's callback). Nothing is keyed by storage yet: most saved
#       tensors are never written.
#   every write: handles saved since the last write are indexed by storage (each handle at most
#       once: its weak reference moves into a per-storage list, dead ones pruned in amortised
#       sweeps), then one dict lookup keyed by the written storage. Only when saved tensors live
#       on that storage are spans computed and clones made.
#
# Memory: the handle is the only strong owner of what it holds, and autograd is the only owner of
# the handle, so both die with the graph, after backward or when the graph is dropped. A tensor
# that is an output of the very node saving it (``exp``, ``relu``, a custom Function saving its
# result) references that node through ``grad_fn``; holding it would close a cycle through the
# node's C++ saved variable that Python's collector cannot see (torch's context has this cycle
# and keeps such graphs until it exits). Such tensors are recognised by their ``grad_fn``'s
# sequence number (the node created last on this thread) and held through a detached alias,
# made with the Python dispatch key excluded so that it does not re-enter the mode. Other
# tensors are held as they are, as plain autograd does. If a node was created between the saving
# node and the save (a custom Function applied inside another's forward), an output is held as it
# is and its graph, if dropped without backward, lives until the context exits, as with torch.
#
# TorchDispatchMode wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``, a
# Python-level wrapper that costs about as much per operator as the whole handler. We instead
# tell Dynamo's frame evaluator to skip the handler's code object and everything it calls
# (``set_code_exec_strategy``, what ``torch._dynamo.disable(recursive=True)`` amounts to, at no
# per-call cost) and opt out of the wrapper (`UnwrappedDispatchMode` of `_core.torch_compat`); torch
# versions without that hook keep the wrapper.
#
# Threads and nesting: each context has its own state; open contexts are listed in a module-level
# tuple, and a write made under any context's mode, on any thread, protects the tensors saved by
# every open context. Nesting is allowed (unlike torch): the inner context tracks what is saved
# inside it and must also see its backward. A context whose thread's innermost dispatch mode is
# already ours pushes no second one (it would only run every operator through the handler twice).
#
# Hooks pushed inside: pairs pushed with tensorhooks' ``saved_tensors_hooks`` (and its
# subclasses, ``save_on_cpu``) are wrapped by the context's save guard and keep the protection.
# torch's own ``saved_tensors_hooks`` are taken over when first seen innermost; see NOTE
# [Saved-tensor hooks the context did not install] in `foreign_hooks.py`.


# See NOTE [Contexts under torch.compile] in `_core/compile.py`.
@not_traced("allow_mutation_on_saved_tensors")
@contextlib.contextmanager
def allow_mutation_on_saved_tensors() -> Generator[MutationContext, None, None]:
    """Context manager under which tensors saved for backward may be changed in place.

    Normally, changing a tensor in place after autograd saved it makes backward raise. Inside
    this context a saved tensor is cloned just before an operation writes to it, and backward
    uses the clone, so gradients are those of the values at the time they were saved. Only
    tensors that are both saved and written are cloned; a clone lives as long as the part of
    the graph that needs it.

    Same semantics as `torch.autograd.graph.allow_mutation_on_saved_tensors`, plus: a
    write through any alias of a saved tensor (a view, its base, an overlapping slice, an
    ``out=`` argument, a foreach list) is caught, hooks pushed inside with tensorhooks'
    `saved_tensors_hooks` keep the protection, contexts nest, and contexts on different
    threads are independent. It also costs far less per operation.

    Example:
        >>> import torch, tensorhooks
        >>> a = torch.ones(2, 3, requires_grad=True)
        >>> with tensorhooks.allow_mutation_on_saved_tensors():
        ...     b = a.clone()
        ...     out = (b**2).sum()
        ...     _ = b[:, 1:].sin_()  # a view of the saved tensor, changed in place
        ...     out.backward()
        >>> a.grad
        tensor([[2., 2., 2.],
                [2., 2., 2.]])

    Returns:
        A context manager that yields a `MutationContext`, whose state (saved tensors
        and clones) is cleared when the context exits.

    Raises:
        RuntimeError: on entry, if saved-tensor hooks are disabled by
            ``disable_saved_tensors_hooks`` (raised by torch, with the message given there).
        MutationContextExitedError: during backward, if the graph was recorded inside a context
            that has exited since (a ``RuntimeError``, and an ``AssertionError`` as torch's).
        UnguardedHooksError: on an in-place write into a tensor that torch's own
            ``torch.autograd.graph.saved_tensors_hooks`` (or torch's ``save_on_cpu``), pushed
            inside the context, may have saved before the context took them over, or into a
            tensor saved by ``torch.utils.checkpoint``'s recomputation (a ``RuntimeError``).

    Nesting and threads: contexts nest (torch raises); the inner one tracks what is saved inside
    it, so backward of a graph recorded there must run before it exits. Each thread has its own
    dispatch mode and hook stack, so a context covers the forward passes and writes of the
    thread that entered it; a write made under any open context, on any thread, protects the
    tensors saved by all of them. Writes made on a thread with no open context are not seen.
    Pairs pushed inside by tensorhooks (``saved_tensors_hooks``, ``save_on_cpu``) apply to what
    is saved while they are innermost, as usual; if their pack returns the tensor itself or a
    view of it, unpack returns the save-time clone after a write.
    """
    context = MutationContext()
    push_saved_tensors_hooks(context._pack, unpack)
    try:
        with use_save_guard(context._guard), mode_for_this_thread():
            add_open_context(context)
            try:
                yield context
            finally:
                remove_open_context(context)
    finally:
        pop_saved_tensors_hooks()
        context.clear()
