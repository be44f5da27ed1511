"""Every private torch entry point tensorhooks uses, in one place.

No other module of the package touches ``torch._C``, the autograd engine object, an underscore
module of ``torch.utils`` or an underscore attribute of torch's objects (a node's sequence number,
an operator's schema, a storage's address): they import from here. Each entry says the first
torch release it is known on and what happens where it is missing: a fallback, or a clear error
naming the release needed. Entries read at import time go through `_required`, so a torch
lacking one fails ``import tensorhooks`` with an ImportError naming the entry and the release,
never a bare AttributeError. "Known on" is the oldest release checked, not necessarily the first
that has it. CI runs the suite on the ``torch`` floor of ``pyproject.toml`` (2.11), the pinned
release of ``constraints.txt`` and the newest release; every entry below exists on all three
except `make_saved_tensor` (from 2.12; its fallback runs on 2.11). See docs/torch-versions.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

# torch.library's per-operator registry, and the module that registers torch's own effectful ops
# (``aten::_print``, ...) in it, which ``import torch`` imports too: known on torch 2.11 (see
# `is_cacheable_effect`).
import torch._higher_order_ops.effects
from torch._library import simple_registry as _simple_registry

# An operator overload (read by allow_mutation_on_saved_tensors through `op_schema` and `op_call`)
# and a higher-order operator (a checkpoint policy may be asked about one), the node base class,
# and the dispatch-mode module with its base class: known on torch 2.4. A torch without them fails
# this import with its own ImportError.
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.autograd.graph import Node
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "PYTHON_DISPATCH_KEY",
    "SUPPORTED_FLOOR",
    "TORCH_VERSION",
    "CheckpointPolicy",
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "UnwrappedDispatchMode",
    "below_python_modes",
    "current_autograd_node",
    "current_dispatch_mode",
    "current_graph_task_id",
    "default_device_in_force",
    "disable_saved_tensors_hooks_with",
    "enable_saved_tensors_hooks",
    "fsdp2_modules",
    "fsdp2_sharded_parameters",
    "fsdp_meshes",
    "fsdp_unsharded_tensors",
    "get_disabled_hooks_message",
    "include_inplace_or_view_key",
    "is_alias_of",
    "is_cacheable_effect",
    "is_captured_accumulator",
    "is_dispatch_key_excluded",
    "is_newest_node",
    "make_saved_tensor",
    "neg_view",
    "next_sequence_nr",
    "op_call",
    "op_schema",
    "pop_saved_tensors_hooks",
    "post_accumulate_grad_hooks",
    "push_saved_tensors_hooks",
    "queue_callback",
    "returns_alias",
    "selective_policy_context",
    "sequence_nr",
    "set_dispatch_key_excluded",
    "set_version_counters",
    "skip_code_in_dynamo",
    "storage_key",
    "top_saved_tensors_hooks",
    "torch_checkpoint_debug_override",
    "torch_checkpoint_debug_tools",
    "torch_checkpoint_early_stop_override",
    "torch_checkpoint_takes",
    "torch_selective_checkpoint_modes",
    "will_engine_execute_node",
    "will_engine_execute_nodes",
]


def _takes(function: Callable[..., Any], keyword: str) -> bool:
    import inspect  # noqa: PLC0415 (a signature read once at import)

    return keyword in inspect.signature(function).parameters


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _release(torch.__version__)
"""The installed torch's (major, minor) release."""

# The oldest torch tensorhooks supports: the floor of pyproject.toml (see docs/torch-versions.md).
SUPPORTED_FLOOR = "2.11"


def _required(owner: Any, path: str, since: str) -> Any:
    """``owner.<path>`` (a dotted attribute path), read at import time.

    Raises:
        ImportError: where this torch lacks it, naming the entry and the torch release needed
            (``since``, the oldest release it is known on), instead of a bare AttributeError.
    """
    value = owner
    try:
        for name in path.split("."):
            value = getattr(value, name)
    except AttributeError:
        where = f"{getattr(owner, '__name__', type(owner).__name__)}.{path}"
        raise ImportError(
            f"tensorhooks needs {where}, which torch {torch.__version__} does not have (it is "
            f"known on torch {since} and later); install torch>={SUPPORTED_FLOOR}, the "
            "releases tensorhooks is tested on (see docs/torch-versions.md)"
        ) from None
    return value


# --- The autograd engine ----------------------------------------------------------------------

# The id of the graph task (one backward()/autograd.grad() call) running on this thread, -1
# outside backward. Known on torch 2.4.
current_graph_task_id: Callable[[], int] = _required(torch, "_C._current_graph_task_id", "2.4")

# Queue a callback to run at the successful end of the current graph task; the engine drops its
# reference to it when the task dies either way (see NOTE [Releasing graph-task state] in
# _store.py). Known on torch 2.4.
queue_callback: Callable[[Callable[[], None]], None] = _required(
    torch, "autograd.Variable._execution_engine.queue_callback", "2.4"
)

# The node being executed on this thread during backward (None outside). Known on torch 2.4.
current_autograd_node: Callable[[], Node | None] = _required(
    torch, "_C._current_autograd_node", "2.4"
)

_will_engine_execute_node: Callable[[Node], bool] = _required(
    torch, "_C._will_engine_execute_node", "2.4"
)


def will_engine_execute_node(node: Node) -> bool:
    """Whether ``node`` runs in the current graph task. Known on torch 2.4.

    One quirk is answered here for every caller: ``autograd.grad(..., inputs=leaf)`` makes the
    engine raise for a captured leaf's gradient accumulator (pytorch issue 131753), whose tensor
    hooks do fire; such a node counts as running.
    """
    try:
        return _will_engine_execute_node(node)
    except RuntimeError:
        return True


def is_captured_accumulator(node: Node) -> bool:
    """Whether ``node`` is a leaf's accumulator whose gradient this ``autograd.grad`` captures.

    The engine raises exactly there when asked whether the node runs (pytorch issue 131753).
    """
    try:
        _will_engine_execute_node(node)
    except RuntimeError:
        return True
    return False


def will_engine_execute_nodes(nodes: list[Node]) -> int:
    """How many of ``nodes`` run in the current graph task (one call on the common path)."""
    try:
        return sum(map(_will_engine_execute_node, nodes))
    except RuntimeError:
        return sum(map(will_engine_execute_node, nodes))


# The sequence number the next autograd node created on this thread will get. Known on torch 2.4.
next_sequence_nr: Callable[[], int] = _required(torch, "_C._autograd._get_sequence_nr", "2.4")

# Every node's own number, ``Node._sequence_nr()`` (declared by torch.autograd.graph.Node and
# implemented by every C++ and Python node). Known on torch 2.4; checked here, once, on the class.
_required(Node, "_sequence_nr", "2.4")


def sequence_nr(node: Node) -> int:
    """The number ``node`` took from its thread's counter when autograd created it.

    A node's inputs were made by older nodes, so on one thread they have smaller numbers.
    """
    return node._sequence_nr()


def is_newest_node(node: Node) -> bool:
    """Whether ``node`` is the last autograd node created on this thread.

    Pack hooks ask it of a saved tensor's ``grad_fn``: autograd creates a node before saving
    anything for it, so the saving node is the newest one (see
    `_guards.is_output_of_saving_node`). Pack hooks call it on their hot path: one Python call
    around the two counter reads, about 30 ns more per saved tensor than reading them inline.
    """
    return node._sequence_nr() == next_sequence_nr() - 1


# --- Saved-tensor hooks -----------------------------------------------------------------------

# The thread's default saved-tensor hook stack. Known on torch 2.4.
_push_saved_tensors_hooks: Callable[[Callable[..., Any], Callable[..., Any]], None] = _required(
    torch, "_C._autograd._push_saved_tensors_default_hooks", "2.4"
)
pop_saved_tensors_hooks: Callable[[], None] = _required(
    torch, "_C._autograd._pop_saved_tensors_default_hooks", "2.4"
)

# The switch of disable_saved_tensors_hooks. Known on torch 2.4.
get_disabled_hooks_message: Callable[[], str | None] = _required(
    torch, "_C._autograd._saved_tensors_hooks_get_disabled_error_message", "2.4"
)
disable_saved_tensors_hooks_with: Callable[[str], None] = _required(
    torch, "_C._autograd._saved_tensors_hooks_disable", "2.4"
)
enable_saved_tensors_hooks: Callable[[], None] = _required(
    torch, "_C._autograd._saved_tensors_hooks_enable", "2.4"
)

_HookPair = tuple[Callable[..., Any], Callable[..., Any]]

# The innermost (pack, unpack) pair pushed on this thread, or None. Known on torch 2.8; its reader
# takes one argument (ignore the "is tracing" state) on every release from 2.8 to 2.15. A partial
# of a builtin is called without a Python frame: this runs once per autograd node created under
# allow_mutation_on_saved_tensors.
top_saved_tensors_hooks: Callable[[], _HookPair | None] = functools.partial(
    _required(torch, "_C._autograd._top_saved_tensors_default_hooks", "2.8"), False
)


# --- Tensors ----------------------------------------------------------------------------------

# Whether two tensors share a storage. Known on torch 2.4; not in torch's stubs.
is_alias_of: Callable[[torch.Tensor, torch.Tensor], bool] = _required(
    torch, "_C._is_alias_of", "2.4"
)


# How many TorchFunctionModes are active on this thread. Known on torch 2.0.
_function_modes: Callable[[], int] = _required(torch, "_C._len_torch_function_stack", "2.0")


def default_device_in_force() -> torch.device | None:
    """The default device set by ``torch.set_default_device`` or ``with torch.device(...)``.

    None where neither is in force (the common case: no function mode is active), read in
    one call; ``torch.get_default_device()`` walks the mode stack in Python every time.
    """
    if not _function_modes():
        return None
    return torch.get_default_device()


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s StorageImpl, equal for every alias; None without a storage.

    ``UntypedStorage._cdata``. Known on torch 2.4, no fallback needed (every supported release
    has it). Sparse and other storage-less layouts give None.
    """
    try:
        key: int = tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
    return key


# --- Dispatch ---------------------------------------------------------------------------------

# The innermost TorchDispatchMode of this thread, or None. Known on torch 2.4.
current_dispatch_mode: Callable[[], Any] = _required(
    _python_dispatch, "_get_current_dispatch_mode", "2.4"
)

# Thread-local exclusion of a dispatch key. Known on torch 2.4.
set_dispatch_key_excluded: Callable[[Any, bool], None] = _required(
    torch, "_C._dispatch_tls_set_dispatch_key_excluded", "2.4"
)
is_dispatch_key_excluded: Callable[[Any], bool] = _required(
    torch, "_C._dispatch_tls_is_dispatch_key_excluded", "2.4"
)
PYTHON_DISPATCH_KEY: Any = _required(torch, "_C.DispatchKey.Python", "2.4")


# Sets version counters back to the given values (tuples of tensors and versions). Known on torch
# 2.3; every supported release has it. checkpoint uses it to undo the version moves that its
# replays of writes into copies cause (see tensorhooks/_checkpoint/state.py).
set_version_counters: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], None] = _required(
    torch, "_C._autograd._unsafe_set_version_counter", "2.3"
)


@contextlib.contextmanager
def below_python_modes() -> Iterator[None]:
    """Run the body with the Python dispatch key excluded: no dispatch mode sees its ops.

    For copies and aliases a feature makes for itself, which a mode counting or caching ops (a
    selective checkpoint context, the user's) must not see. Built on the two entries above.
    """
    was_excluded = is_dispatch_key_excluded(PYTHON_DISPATCH_KEY)
    set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, True)
    try:
        yield
    finally:
        set_dispatch_key_excluded(PYTHON_DISPATCH_KEY, was_excluded)


def op_schema(func: OpOverload) -> Any:
    """The ``torch._C.FunctionSchema`` of an operator overload: its arguments and alias info.

    ``OpOverload._schema``. Known on torch 2.4; no fallback (every supported release has it).
    """
    return func._schema


def returns_alias(func: OpOverload) -> tuple[bool, bool]:
    """Whether ``func`` returns an alias of an input, and whether it writes that input.

    Read from the returns' alias info in its schema: a view (``t``, slicing) returns an alias
    it does not write; an in-place or ``out=`` op returns the input it wrote.
    """
    known = _RETURNS_ALIAS.get(func)
    if known is None:
        returns = op_schema(func).returns
        aliased = any(result.alias_info is not None for result in returns)
        writes = any(
            result.alias_info is not None and result.alias_info.is_write for result in returns
        )
        known = _RETURNS_ALIAS[func] = (aliased, writes)
    return known


# An operator's schema never changes: what its returns alias is read once per overload.
_RETURNS_ALIAS: dict[OpOverload, tuple[bool, bool]] = {}


def op_call(func: OpOverload) -> Callable[..., Any]:
    """What calling ``func`` amounts to, minus the Python frame of ``OpOverload.__call__``.

    ``OpOverload.__call__`` only forwards to ``_op``, the C++ operator, so a handler that runs
    ``func`` on every operator calls ``_op`` directly. Known on torch 2.4. A subclass of
    OpOverload (whose ``__call__`` may do more), or a torch without ``_op``, gives ``func``
    itself: the same result, one frame slower.
    """
    if type(func) is OpOverload:
        call: Callable[..., Any] = getattr(func, "_op", func)
        return call
    return func


# Dynamo's per-code-object execution strategies, in a C module (reading it does not import
# torch._dynamo). Known on torch 2.7.
_set_code_exec_strategy: Callable[[Any, Any], None] = _required(
    torch, "_C._dynamo.eval_frame.set_code_exec_strategy", "2.7"
)
_FrameExecStrategy: Any = _required(torch, "_C._dynamo.eval_frame._FrameExecStrategy", "2.7")
_FRAME_SKIP: Any = _required(torch, "_C._dynamo.eval_frame._FrameAction.SKIP", "2.7")
# One strategy for every code object: ``set_code_exec_strategy`` copies it into the code's state.
_SKIP_STRATEGY: Any = _FrameExecStrategy(_FRAME_SKIP, _FRAME_SKIP)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Code objects seen by `push_saved_tensors_hooks`, by id (a code object hashes its bytecode and
# constants on every lookup), each held so that its id is never reused.
_seen_hook_code: dict[int, Any] = {}


def push_saved_tensors_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
    """Push a pack/unpack pair on the thread's saved-tensor hook stack.

    tensorhooks' own hook functions are made to run eagerly whenever they are called while a
    compiled function runs (see `skip_code_in_dynamo`), as torch's are: torch's hooks live in
    files Dynamo skips. See NOTE [Contexts under torch.compile] in `_core/compile.py`.
    """
    pack_code = getattr(pack, "__code__", None)
    unpack_code = getattr(unpack, "__code__", None)
    if id(pack_code) not in _seen_hook_code or id(unpack_code) not in _seen_hook_code:
        _mark_hook_code(pack_code)
        _mark_hook_code(unpack_code)
    _push_saved_tensors_hooks(pack, unpack)


def _mark_hook_code(code: Any) -> None:
    _seen_hook_code[id(code)] = code
    if code is not None and code.co_filename.startswith(_PACKAGE_DIR):  # a user's code: left
        skip_code_in_dynamo(code)


def skip_code_in_dynamo(code: Any) -> None:
    """Make Dynamo skip ``code`` and everything it calls.

    ``set_code_exec_strategy`` is what ``torch._dynamo.disable(recursive=True)`` amounts to, at no
    per-call cost, without importing ``torch._dynamo``. Known on torch 2.7.
    """
    _set_code_exec_strategy(code, _SKIP_STRATEGY)


class UnwrappedDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped base
    """A TorchDispatchMode whose handler runs without torch's Dynamo wrapper around it.

    TorchDispatchMode wraps each subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``
    (a Python wrapper that costs about as much per operator as a small handler) unless the
    class's ``_should_skip_dynamo()`` answers False; torch asks once, when the subclass is
    created. A subclass of this one that defines (or assigns) a handler has the handler's code
    passed to `skip_code_in_dynamo` (what the wrapper amounts to, at no per-call cost) and sets
    ``handler_skipped_by_dynamo``, which leaves the wrapper off. The hook is known on torch 2.11
    (the oldest release checked); a torch that never asks it wraps or not as it decides, which is
    correct either way.
    """

    handler_skipped_by_dynamo = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        handler = cls.__dict__.get("__torch_dispatch__")
        code = getattr(handler, "__code__", None)
        if code is not None:
            skip_code_in_dynamo(code)
            cls.handler_skipped_by_dynamo = True
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]  # untyped in torch

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not cls.handler_skipped_by_dynamo


# --- Activation checkpointing (tensorhooks.checkpoint) -----------------------------------------

# Save a tensor the way a node saves one (through the default saved-tensor hooks, with autograd's
# version check when none are in force) and get it back with ``.unpack()``. First in torch 2.12
# (pytorch PR 174333, merged February 2026): absent on 2.11, present on 2.13 and 2.15. None
# before, and `_checkpoint` then packs region inputs through the hooks in force by hand.
make_saved_tensor: Callable[..., Any] | None = getattr(
    torch._C._autograd, "_make_saved_tensor", None
)


def include_inplace_or_view_key() -> Any:
    """A context that re-includes ADInplaceOrView inside a dispatch handler. Known on torch 2.0.

    A ``detach()`` made inside ``__torch_dispatch__`` needs it to share the version counter of
    its source, which is what the cached outputs of selective checkpointing are checked by.
    """
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


def torch_selective_checkpoint_modes() -> tuple[Any, Any] | None:
    """The two dispatch modes torch's ``create_selective_checkpoint_contexts`` returns.

    Known on torch 2.4 (``_CachingTorchDispatchMode``, ``_CachedTorchDispatchMode``); None where
    either is missing, and their contexts are then used as they are (offload not honoured).
    """
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415 (imports the profiler)

    caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    cached = getattr(torch_checkpoint, "_CachedTorchDispatchMode", None)
    if caching is None or cached is None:
        return None
    return caching, cached


# The registry torch.library keeps per operator name (its fake kernel, its effect, ...): entries
# are made on first lookup and never removed. Known on torch 2.11.
_operator_registry: Any = _required(_simple_registry, "singleton", "2.11")


class _OrderedBefore2_13:
    """The registry's effect of an op torch registers as effectful from 2.13 on, on 2.11."""

    effect = "Ordered"


# Ops whose effect torch registers itself from 2.13 on; 2.11's registry lacks them.
_REGISTERED_SINCE_2_13 = frozenset({"aten::_linalg_check_errors"})


def _effect_holder(op: Any) -> Any:
    """Where the registry holds ``op``'s effect, or None where no effect can count for it.

    None for an op that aliases or writes an argument, for the ``c10d`` namespace (a raw
    collective writes its inputs and returns a Work handle: no value to keep) and for anything
    but an operator overload or a higher-order operator: the parts of the rule that never change.
    """
    if isinstance(op, HigherOrderOperator):
        name = f"{op.namespace}::{op.name()}"  # type: ignore[no-untyped-call]  # untyped
    elif isinstance(op, OpOverload) and op.namespace != "c10d" and not _has_alias_info(op):
        name = op.__qualname__
    else:
        return None
    if TORCH_VERSION < (2, 13) and name in _REGISTERED_SINCE_2_13:
        return _OrderedBefore2_13
    return _operator_registry.find(name).effect


def _has_alias_info(op: OpOverload) -> bool:
    schema = op_schema(op)
    return any(item.alias_info is not None for item in (*schema.arguments, *schema.returns))


_effect_holders: dict[Any, Any] = {}


def is_cacheable_effect(op: Any) -> bool:
    """Whether selective checkpointing saves ``op``'s output rather than run it again in backward.

    True for an op with an ordered side effect (see NOTE [Ops with ordered side effects] in
    ``_checkpoint/policies.py``): one with an effect in torch.library's registry
    (``aten::_print``, ``aten::_linalg_check_errors``, an op registered through
    ``torch.library._register_effectful_op``, one taking a TorchBind object), none of whose
    arguments or returns alias, outside the ``c10d`` namespace. This is the rule of
    ``torch.utils.checkpoint._is_cacheable_effect`` (torch 2.15), rebuilt for every supported
    release and tested against torch's on 2.15. What never changes for an op (its schema, its
    registry entry) is looked up once; its registered effect is read on each call, so an effect
    registered later counts.
    """
    try:
        holder = _effect_holders[op]
    except KeyError:
        holder = _effect_holders[op] = _effect_holder(op)
    return holder is not None and holder.effect is not None


def torch_checkpoint_early_stop_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_early_stop`` set, or None. Known on 2.1."""
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415

    value: bool | None = getattr(torch_checkpoint, "_enable_checkpoint_early_stop", None)
    return value


def selective_policy_context(output: object) -> Any:
    """The ``SelectiveCheckpointContext`` a policy is called with, for an op's ``output``.

    The ``op_output`` argument is known on torch 2.13; 2.11 takes ``is_recompute`` alone, and
    the output is then set on the context as an attribute, so a policy reads
    ``ctx.op_output`` on every supported release. (A TypeError raised inside a tensor
    operator's dispatch would surface as ``NotImplemented`` from the operator.)
    """
    from torch.utils.checkpoint import SelectiveCheckpointContext  # noqa: PLC0415

    if _POLICY_CONTEXT_TAKES_OUTPUT:
        return SelectiveCheckpointContext(is_recompute=False, op_output=output)
    context = SelectiveCheckpointContext(is_recompute=False)
    context.op_output = output
    return context


def torch_checkpoint_takes(keyword: str) -> bool:
    """Whether torch's ``checkpoint`` accepts ``keyword``.

    ``respect_saved_tensors_hooks`` is new in torch 2.14; tensorhooks' own checkpoint accepts it
    on every release, and passes it on to torch's (under ``torch.compile``) where torch has it.
    """
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415

    return _takes(torch_checkpoint.checkpoint, keyword)


def torch_checkpoint_debug_override() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` set, or None. Known on 2.2."""
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415

    value: bool | None = getattr(torch_checkpoint, "_checkpoint_debug_enabled", None)
    return value


def torch_checkpoint_debug_tools() -> tuple[Callable[[], Any], Callable[[Exception], Any]] | None:
    """Return torch's ``(context_fn, unpack_error_cb)`` of ``checkpoint(debug=True)``. Known on 2.2.

    None where it is missing: ``debug=True`` then only raises the plain error.
    """
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415

    tools = getattr(torch_checkpoint, "_get_debug_context_and_cb", None)
    return None if tools is None else tools()


def _checkpoint_policy() -> Any:
    """Torch's ``CheckpointPolicy``, whose ``*_CPU_OFFLOAD`` members are known on torch 2.11."""
    import torch.utils.checkpoint as torch_checkpoint  # noqa: PLC0415 (imports the profiler)

    policy = _required(torch_checkpoint, "CheckpointPolicy", "2.4")
    _required(policy, "MUST_CPU_OFFLOAD", "2.11")
    return policy


# What `tensorhooks.CheckpointPolicy` is: torch's enum itself.
CheckpointPolicy: Any = _checkpoint_policy()


def neg_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a view with its negative bit flipped (``torch._neg_view``). Known on 1.10.

    No fallback is needed: every supported release has it.
    """
    return torch._neg_view(tensor)


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> OrderedDict[int, Any] | None:
    """The hooks ``tensor.register_post_accumulate_grad_hook`` added, in the order they run.

    ``Tensor._post_accumulate_grad_hooks``, an ordered dict (by handle id) that autograd reads
    when it calls them, or None before the first one; reordering it reorders the calls. Known on
    torch 2.1 (where the method came).
    """
    hooks = tensor._post_accumulate_grad_hooks
    return hooks if isinstance(hooks, OrderedDict) else None


_POLICY_CONTEXT_TAKES_OUTPUT = _takes(
    torch.utils.checkpoint.SelectiveCheckpointContext, "op_output"
)


# --- FSDP2 (fully_shard) -------------------------------------------------------------------------

# Where FSDP2 lives; not imported by tensorhooks: a model can be sharded only once it was.
_FSDP2_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"


def fsdp2_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules that ``fully_shard`` was applied to; [] without FSDP2.

    ``FSDPModule`` is public since torch 2.6; FSDP2 is not imported for the question.
    """
    if _FSDP2_MODULE not in sys.modules:
        return []
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (imported once FSDP2 was)

    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


def fsdp2_sharded_parameters() -> dict[int, torch.Tensor]:
    """The sharded parameters of every live ``fully_shard`` module, by id; {} without FSDP2.

    FSDP2 never gives these an autograd gradient: it sets ``.grad`` after its reduce-scatter and
    then runs their post-accumulate-grad hooks. Read from torch's registry of composable states
    (``torch.distributed._composable_state._module_state_mapping``, a weak dict) and FSDP2's
    private state (``_fsdp_param_group.fsdp_params[i].sharded_param``), known on torch 2.6 to
    2.15; where they are missing nothing is found.
    """
    if _FSDP2_MODULE not in sys.modules:
        return {}
    from torch.distributed import _composable_state  # noqa: PLC0415 (as above)
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (imported once FSDP2 was)

    found: dict[int, torch.Tensor] = {}
    mapping = getattr(_composable_state, "_module_state_mapping", {})
    for module, state_ref in list(mapping.items()):
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(state_ref(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            param = getattr(fsdp_param, "sharded_param", None)
            if isinstance(param, torch.Tensor):
                found[id(param)] = param
    return found


def _fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """The parameter groups of every ``fully_shard`` in ``model``, [] without FSDP2.

    ``FSDPModule._get_fsdp_state()`` and its ``_fsdp_param_groups`` (torch 2.13; a release with
    one ``_fsdp_param_group`` or None is read through that). Checked on torch 2.13, the pinned
    release. A release that moved them leaves FSDP2 models unrecognised: their gathered
    parameters then count as saved activations, which the planner's FSDP2 tests would show.
    """
    found: list[Any] = []
    for module in fsdp2_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]  # an FSDPModule's method
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        found.extend(groups)
    return found


def fsdp_unsharded_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers FSDP2 gathers ``model``'s parameters into, for every ``fully_shard`` in it.

    Each ``FSDPParam``'s ``all_gather_outputs`` (made at the first all-gather, and only resized
    after: FSDP2 frees them by resizing their storage to 0 and all-gathers into them again),
    the unsharded parameter viewing them and, with an all-gather extension, its inner tensors.
    Empty before the first forward, and for a model without ``fully_shard``. Checked on 2.13.
    """
    found: list[torch.Tensor] = []
    for group in _fsdp_param_groups(model):
        for param in group.fsdp_params:
            found.extend(param.all_gather_outputs)
            found.extend(getattr(param, "_unsharded_inner_tensors", ()))
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                found.append(unsharded)
    return found


def fsdp_meshes(model: torch.nn.Module) -> list[Any]:
    """The distinct device meshes of the ``fully_shard`` calls in ``model``, [] if none.

    ``FSDPParamGroup.mesh_info.mesh``; checked on torch 2.13.
    """
    meshes: list[Any] = []
    for group in _fsdp_param_groups(model):
        mesh = group.mesh_info.mesh
        if all(mesh is not other for other in meshes):
            meshes.append(mesh)
    return meshes
