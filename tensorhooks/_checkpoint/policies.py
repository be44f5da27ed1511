"""Selective checkpointing: a policy decides, per op, to save, recompute or offload its output.

See NOTE [Selective checkpointing in eager mode] below.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from tensorhooks._activation_offload import save_on_cpu
from tensorhooks._core.errors import (
    CheckpointArgumentTypeError,
    CheckpointArgumentValueError,
    SavedTensorModifiedError,
)
from tensorhooks._core.guards import PackHook, UnpackHook, current_save_guard, modified_message
from tensorhooks._core.torch_compat import (
    CheckpointPolicy,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    UnwrappedDispatchMode,
    include_inplace_or_view_key,
    is_cacheable_effect,
    returns_alias,
    selective_policy_context,
    torch_selective_checkpoint_modes,
)

__all__ = [
    "SelectiveForward",
    "SelectiveRecompute",
    "adopt_contexts",
    "create_selective_checkpoint_contexts",
]

# NOTE [Selective checkpointing in eager mode]
#
# Two dispatch modes share one `_Plan`. In the forward pass `SelectiveForward` runs every op,
# asks the policy about it and files what the policy chose under ``(op, call number)``:
#
#   *_SAVE        a detached alias of the output and its version (under
#                 ``allow_mutation_on_saved_tensors``, behind the context's save guard, which
#                 keeps the save-time value when a write comes);
#   *_CPU_OFFLOAD the output packed by a ``save_on_cpu`` context (side-stream copy into pinned
#                 host memory on a device, prefetch in backward);
#   *_RECOMPUTE   nothing.
#
# Ops whose outputs alias an input are never filed, whatever the policy says: a view (``t``,
# ``split``, slicing) costs nothing to replay from its base and holds no memory of its own, and
# an in-place or ``out=`` op must run again for its write to reach the recomputed input. Handing
# out a cached view instead would give autograd a tensor that is not a view of the recomputed
# base (torch's "differentiable view" error on a second backward) and keep that base alive.
#
# In recomputation `SelectiveRecompute` answers each filed op from the plan without running it
# and runs the others. Each answer is a fresh alias of the entry, never the entry itself: autograd
# sets the recomputed node as ``grad_fn`` of what the op returns, and an entry carrying it would
# close a cycle (plan -> entry -> recomputed node -> saved hooks -> frame -> plan) through C++
# objects that the collector cannot see, leaking every step. An entry is consumed when it answers
# its op, as torch's is: from then on the output lives only in what the recomputation made of it,
# and is freed as the region's nodes run, so a selective region never holds more than torch's.
# A second backward over a graph kept with ``retain_graph=True`` finds the op consumed and runs it
# again, as a recomputed op (torch raises there): that costs the op, never memory.
#
# A saved output changed in place after it was filed (by the region later in its forward pass,
# or by anyone before backward) no longer holds the value the recomputation needs:
#   - under ``allow_mutation_on_saved_tensors`` the guard kept the save-time value, which is
#     handed out (as a clone when the region itself writes it, so that the recomputation's own
#     write cannot reach the entry);
#   - with ``allow_cache_entry_mutation=True`` the op runs again instead (torch hands out the
#     changed value: an in-place write applied twice);
#   - otherwise taking the entry raises autograd's in-place error, naming the op and the policy.

# NOTE [Ops with ordered side effects]
#
# An op with an ordered side effect (``aten._print``, a custom op registered with
# ``torch.library._register_effectful_op``, one taking a TorchBind object: see
# `is_cacheable_effect`) must not run again in recomputation: its effect would happen twice per
# step. Its output is saved, as ``MUST_SAVE``, when the policy returns ``PREFER_RECOMPUTE`` (or
# False); ``MUST_RECOMPUTE`` is the one explicit request to run it again, and the ``*_CPU_OFFLOAD``
# policies already keep it without running it. This is torch 2.15's rule
# (`_CachingTorchDispatchMode`), followed on every supported release; torch 2.11 to 2.14 run such
# ops again. Ops that alias or write an argument, and raw ``c10d`` collectives, are not covered:
# their output is no value to keep (torch leaves them out too).
#
# The policy handed to torch's checkpoint under torch.compile (`_Plan.policy_fn`) applies the
# same rule, so that torch before 2.15 does not recompute such an op there either (its
# partitioner then fails in backward on the op's effect token).
#
# An entry with no tensor in it (a print's None) is never consumed: it holds nothing, and a
# second backward over a retained graph then does not repeat the effect. An entry holding tensors
# is consumed as any other (see NOTE [Selective checkpointing in eager mode]), and a second
# backward runs the op again, effect included; so does recomputation of a saved output the region
# wrote in place under ``allow_cache_entry_mutation=True``.

PolicyFn = Callable[..., Any]

# By name: a member's kind (save, offload, recompute) is the end of its name.
_SAVE = frozenset({"MUST_SAVE", "PREFER_SAVE"})
_OFFLOAD = frozenset({"MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"})
_RECOMPUTE = frozenset({"MUST_RECOMPUTE", "PREFER_RECOMPUTE"})
_POLICIES = _SAVE | _OFFLOAD | _RECOMPUTE

# Ops checkpointing itself adds a different number of times in forward and recomputation, and
# metadata queries: never counted, never cached (torch's list, where this torch has it).
_IGNORED: frozenset[Any] = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
)


def _identity(value: Any) -> Any:
    return value


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Apply ``fn`` to the tensors of an op's output (a tensor, or a flat tuple/list of them)."""
    return _map(torch.Tensor, fn, value)


def _map(kind: type, fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (tuple, list)):
        mapped = [_map(kind, fn, item) for item in value]
        return tuple(mapped) if isinstance(value, tuple) else mapped
    return value


def _detach(tensor: torch.Tensor) -> torch.Tensor:
    with include_inplace_or_view_key():
        return tensor.detach()


class _Slot:
    """Where a tensor of an op's output sits, in the structure an `_Entry` files."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Entry:
    """One filed op output: its structure, what pack returned for each tensor, how to unpack.

    See NOTE [Selective checkpointing in eager mode] for when a filed value may be used.
    """

    __slots__ = (
        "_pack",
        "aliases",
        "func",
        "index",
        "mutated",
        "packed",
        "policy",
        "structure",
        "unpack",
        "versions",
    )

    def __init__(
        self,
        output: Any,
        pair: tuple[PackHook, UnpackHook],
        *,
        watch: bool,
        func: OpOverload,
        index: int,
        policy: str,
    ) -> None:
        self.func = func
        self.index = index
        self.policy = policy
        self.packed: list[Any] = []
        # Aliases of the saved tensors, whose versions tell a later write; None: not watched
        # (offloaded outputs are copies).
        self.aliases: list[torch.Tensor] | None = [] if watch else None
        self._pack: PackHook | None = pair[0]
        self.structure = _map_tensors(self._file, output)
        self._pack = None  # the entry outlives the forward pass; the pack hook need not
        self.unpack = pair[1]
        self.versions = None if self.aliases is None else [a._version for a in self.aliases]
        # Set at the end of the forward pass when the region wrote a saved alias: which, and the
        # version it was filed at.
        self.mutated: tuple[torch.Tensor, int] | None = None

    def _file(self, tensor: torch.Tensor) -> _Slot:
        alias = _detach(tensor)
        if self.aliases is not None:
            self.aliases.append(alias)
        assert self._pack is not None
        self.packed.append(self._pack(alias))
        return _Slot(len(self.packed) - 1)

    def seal(self) -> None:
        """At the end of the forward pass: note whether the region changed the output since."""
        change = self._change()
        if change is not None:
            self.mutated = change
        if self.aliases is not None:
            self.versions = [alias._version for alias in self.aliases]

    def _change(self) -> tuple[torch.Tensor, int] | None:
        """A saved alias written since its version was noted, with that version."""
        if self.aliases is None or self.versions is None:
            return None
        for alias, version in zip(self.aliases, self.versions, strict=True):
            if alias._version != version:
                return alias, version
        return None

    def usable(self, keeps_saved_values: bool, allow_mutation: bool) -> bool:
        """Whether the filed value may answer the op; raise if it changed and nothing else may.

        ``keeps_saved_values``: the pair's guard hands back save-time values after a write.
        """
        if keeps_saved_values:
            return True
        change = self.mutated or self._change()
        if not change:
            return True
        if allow_mutation:
            return False
        raise self._modified_error(*change)

    def _modified_error(self, alias: torch.Tensor, version: int) -> SavedTensorModifiedError:
        if self.policy in _RECOMPUTE:  # saved for its side effect: see NOTE [Ops with ordered ...]
            saved = (
                "which selective checkpointing saves because the op has an ordered side effect "
                f"(the policy returned {self.policy})"
            )
            recompute = "MUST_RECOMPUTE for this op (its side effect then runs again in backward)"
        else:
            saved = f"which the selective checkpoint policy saves ({self.policy})"
            recompute = "PREFER_RECOMPUTE for this op"
        return SavedTensorModifiedError(
            modified_message(alias.type(), list(alias.shape), alias._version, version)
            + f" Hint: the output of {self.func} (call {self.index}) in a checkpointed region, "
            f"{saved}, was changed in place after it was saved, so recomputation cannot use it. "
            f"Have the policy return {recompute}, pass allow_cache_entry_mutation=True to "
            "recompute such outputs instead, or run the forward pass and backward inside "
            "tensorhooks.allow_mutation_on_saved_tensors() to keep the saved value."
        )

    def value(self) -> Any:
        """The filed output, as fresh aliases (fresh clones if the region changes it in place)."""
        packed, unpack, mutated = self.packed, self.unpack, self.mutated is not None

        def restore(slot: _Slot) -> torch.Tensor:
            tensor = unpack(packed[slot.index])
            return tensor.clone() if mutated else _detach(tensor)

        return _map(_Slot, restore, self.structure)


class _Plan:
    """The policy, its options, and the outputs filed during one region's forward pass."""

    def __init__(
        self, policy_fn: PolicyFn, allow_cache_entry_mutation: bool, offload: save_on_cpu
    ) -> None:
        self.user_policy_fn = policy_fn
        # The policy as checkpointing applies it, for torch's checkpoint under torch.compile.
        self.policy_fn: PolicyFn = functools.partial(_saving_effects, policy_fn)
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.offload = offload
        self.storage: dict[Any, list[_Entry | None]] = {}
        self.save_pair: tuple[PackHook, UnpackHook] = (_identity, _identity)
        self.offload_pair: tuple[PackHook, UnpackHook] = (offload.pack_hook, offload.unpack_hook)
        self.keeps_saved_values = False
        # The hooks around the call, when saved outputs go through them
        # (``respect_saved_tensors_hooks=True``).
        self.ambient: tuple[PackHook, UnpackHook] | None = None

    def start(self) -> None:
        """Take the save guard of the thread running the forward pass."""
        guard = current_save_guard()
        # Under a guard that keeps save-time values, saved outputs go behind it; otherwise each
        # entry checks its own versions (see NOTE [Selective checkpointing in eager mode]).
        self.keeps_saved_values = guard.lets_saved_tensors_change
        if self.ambient is not None:
            self.save_pair = guard.wrap(*self.ambient)
            self.keeps_saved_values = True  # the guard checks or keeps what the pair returns
        elif self.keeps_saved_values:
            self.save_pair = guard.wrap(_identity, _identity)
        self.offload_pair = guard.wrap(self.offload.pack_hook, self.offload.unpack_hook)

    def file(self, func: OpOverload, policy: Any, output: Any) -> None:
        """File ``output`` of ``func`` as ``policy`` says."""
        name = _policy_name(func, policy)
        entries = self.storage.setdefault(func, [])
        keeps = name in _SAVE or name in _OFFLOAD or _saves_effect(func, name)
        if not keeps or returns_alias(func)[0]:
            entries.append(None)
            return
        offload = name in _OFFLOAD
        entries.append(
            _Entry(
                output,
                self.offload_pair if offload else self.save_pair,
                watch=not offload,
                func=func,
                index=len(entries),
                policy=name,
            )
        )

    def seal(self) -> None:
        """At the end of the forward pass (see `_Entry.seal`)."""
        for entries in self.storage.values():
            for entry in entries:
                if entry is not None:
                    entry.seal()

    def take(self, func: OpOverload, index: int) -> _Entry | None:
        """The entry answering call ``index`` of ``func``, consumed; None: run the op again."""
        entries = self.storage.get(func)
        if entries is None or index >= len(entries):
            raise CheckpointError(
                f"tensorhooks.checkpoint: {func} (call {index}) ran during recomputation but not "
                "in the forward pass. The checkpointed function must run the same ops in both: "
                "check for randomness outside torch's generators or global state it reads."
            )
        entry = entries[index]
        if entry is None:
            return None
        usable = entry.usable(self.keeps_saved_values, self.allow_cache_entry_mutation)
        if entry.packed:  # an entry without tensors holds nothing: see NOTE [Ops with ordered ...]
            entries[index] = None  # consumed (or stale): the plan holds the output no longer
        return entry if usable else None


def _policy_name(func: OpOverload, policy: Any) -> str:
    """The name of the `CheckpointPolicy` member ``policy`` is (True: MUST_SAVE)."""
    if isinstance(policy, bool):  # torch accepts booleans: True saves
        policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
    name = policy.name if isinstance(policy, enum.Enum) else None
    if name not in _POLICIES:
        raise CheckpointArgumentTypeError(
            f"selective checkpoint: the policy returned {policy!r} of type "
            f"{type(policy).__name__} for {func}; return a CheckpointPolicy or a bool"
        )
    return name


def _saves_effect(func: OpOverload, name: str) -> bool:
    """Whether ``func``'s output is saved although the policy said PREFER_RECOMPUTE.

    See NOTE [Ops with ordered side effects].
    """
    return name == "PREFER_RECOMPUTE" and is_cacheable_effect(func)


def _saving_effects(policy_fn: PolicyFn, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``policy_fn``'s answer, MUST_SAVE where it would run an op with ordered side effects again.

    Other answers, valid or not, pass unchanged (see NOTE [Ops with ordered side effects]).
    """
    policy = policy_fn(ctx, op, *args, **kwargs)
    replays = policy is CheckpointPolicy.PREFER_RECOMPUTE or (
        isinstance(policy, bool) and not policy
    )
    return CheckpointPolicy.MUST_SAVE if replays and is_cacheable_effect(op) else policy


class SelectiveForward(UnwrappedDispatchMode):
    """The forward context of selective checkpointing (see NOTE [Selective checkpointing])."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.plan = plan

    def save_through(self, pair: tuple[PackHook, UnpackHook] | None) -> None:
        """Keep the outputs the policy saves through ``pair`` (the hooks around the call)."""
        self.plan.ambient = pair

    def offload_context(self) -> contextlib.AbstractContextManager[None]:
        """The ``save_on_cpu`` entry around the region: its copies overlap the region's ops."""
        return self.plan.offload

    def __enter__(self) -> SelectiveForward:
        self.plan.start()
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's __enter__ is untyped
        return self

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)  # type: ignore[no-untyped-call]  # torch's __exit__ is untyped
        self.plan.seal()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        output = func(*args, **kwargs)
        if func in _IGNORED:
            return output
        plan = self.plan
        policy = plan.user_policy_fn(selective_policy_context(output), func, *args, **kwargs)
        plan.file(func, policy, output)
        return output


class SelectiveRecompute(UnwrappedDispatchMode):
    """The recomputation context of selective checkpointing: filed outputs are not recomputed."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is untyped
        self.plan = plan
        self._calls = threading.local()

    def __enter__(self) -> SelectiveRecompute:
        self._calls.counts = {}
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's __enter__ is untyped
        return self

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func in _IGNORED:
            return func(*args, **kwargs)
        counts: dict[Any, int] = self._calls.counts
        index = counts.get(func, 0)
        counts[func] = index + 1
        entry = self.plan.take(func, index)
        if entry is None:
            return func(*args, **kwargs)
        return entry.value()


# One offloading context for policies that name none: every op output the policy offloads is
# copied, whatever its size (it asked for it), into pinned memory where the device has any.
_DEFAULT_OFFLOAD = save_on_cpu(pin_memory=True, min_offload_bytes=0)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: PolicyFn | list[Any],
    allow_cache_entry_mutation: bool = False,
    *,
    offload: save_on_cpu | None = None,
) -> tuple[SelectiveForward, SelectiveRecompute]:
    r"""Return the two contexts that make `checkpoint` save, recompute or offload op by op.

    Same arguments as `torch.utils.checkpoint.create_selective_checkpoint_contexts`. The policy
    is called once per op in the forward pass (never in recomputation) and returns a
    `CheckpointPolicy`: ``*_SAVE`` keeps the output, ``*_RECOMPUTE`` recomputes it, and
    ``*_CPU_OFFLOAD`` keeps it in (pinned) host memory through `save_on_cpu` and copies it back
    in backward without running the op again; torch's eager checkpoint recomputes those. An op
    with an ordered side effect (``aten._print``, a custom op registered as effectful) is saved
    unless the policy says ``MUST_RECOMPUTE``, as torch 2.15 does, so that its effect happens
    once.

    Example:
        >>> import functools, torch, tensorhooks
        >>> ops = [torch.ops.aten.mm.default]
        >>> context_fn = functools.partial(tensorhooks.create_selective_checkpoint_contexts, ops)
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> w = torch.ones(3, 3, requires_grad=True)
        >>> y = tensorhooks.checkpoint(
        ...     lambda a: (a @ w).sin() @ w, x, use_reentrant=False, context_fn=context_fn
        ... )
        >>> y.sum().backward()         # the first mm is not run again, the sin is
        >>> x.grad.shape
        torch.Size([2, 3])

    Args:
        policy_fn_or_list: a function ``policy(ctx, op, *args, **kwargs)`` returning a
            `CheckpointPolicy` (or a bool, True meaning save), or a list of ``OpOverload``\ s
            to save (every other op is recomputed).
        allow_cache_entry_mutation: let a saved output changed in place after the op be used as
            changed; by default that raises autograd's in-place error in backward (inside
            ``allow_mutation_on_saved_tensors`` the save-time value is used instead).
        offload: the `save_on_cpu` context whose machinery keeps offloaded outputs (default:
            ``save_on_cpu(pin_memory=True, min_offload_bytes=0)``).

    Returns:
        ``(forward_context, recompute_context)``, what ``context_fn`` of `checkpoint` returns.

    Raises:
        CheckpointArgumentValueError: if the list holds something other than an ``OpOverload``
            or a higher-order operator (a ``ValueError``).
        CheckpointArgumentTypeError: if ``policy_fn_or_list`` is neither callable nor a list, or
            ``offload`` is not a `save_on_cpu` (a ``TypeError``).

    Nesting and threads: build one pair per `checkpoint` call (a ``functools.partial`` as
    ``context_fn`` does that). Recomputation on several threads at once is supported.
    """
    policy_fn: PolicyFn
    if isinstance(policy_fn_or_list, list):
        ops = list(policy_fn_or_list)
        for op in ops:
            if not isinstance(op, (OpOverload, HigherOrderOperator)):
                packet = isinstance(op, OpOverloadPacket)
                raise CheckpointArgumentValueError(
                    "create_selective_checkpoint_contexts: Expected op in `op_list` to be an "
                    f"OpOverload but got {op!r} of type {type(op).__name__}. "
                    + (
                        "Please update the OpOverloadPacket to a specific OpOverload: for "
                        f"example, name {op!r}.default rather than {op!r}."
                        if packet
                        else "Name an overload, such as torch.ops.aten.mm.default."
                    )
                )
        saved = frozenset(ops)

        def policy_fn(ctx: object, op: OpOverload, *args: object, **kwargs: object) -> Any:
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    elif callable(policy_fn_or_list):
        policy_fn = policy_fn_or_list
    else:
        raise CheckpointArgumentTypeError(
            "create_selective_checkpoint_contexts: policy_fn_or_list must be either a function "
            f"or a list of ops. Got {policy_fn_or_list!r} of type "
            f"{type(policy_fn_or_list).__name__}."
        )
    if offload is None:
        offload = _DEFAULT_OFFLOAD
    elif not isinstance(offload, save_on_cpu):
        raise CheckpointArgumentTypeError(
            f"create_selective_checkpoint_contexts: offload must be a tensorhooks.save_on_cpu, "
            f"got {offload!r} of type {type(offload).__name__}"
        )
    plan = _Plan(policy_fn, bool(allow_cache_entry_mutation), offload)
    return SelectiveForward(plan), SelectiveRecompute(plan)


def adopt_contexts(forward: Any, recompute: Any) -> tuple[Any, Any]:
    """Replace the contexts of torch's ``create_selective_checkpoint_contexts`` by ours.

    Same policy and option, with ``*_CPU_OFFLOAD`` honoured. Other contexts pass unchanged.
    """
    modes = torch_selective_checkpoint_modes()
    if modes is None or not isinstance(forward, modes[0]) or not isinstance(recompute, modes[1]):
        return forward, recompute
    policy_fn: PolicyFn = forward.policy_fn
    return create_selective_checkpoint_contexts(
        policy_fn,
        bool(getattr(recompute, "allow_cache_entry_mutation", False)),
    )
