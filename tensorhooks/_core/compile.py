"""How tensorhooks' contexts meet ``torch.compile``.

See NOTE [Contexts under torch.compile].
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

from .torch_compat import skip_code_in_dynamo

__all__ = ["not_traced", "runs_eagerly", "warn_compile_skipped"]

# NOTE [Contexts under torch.compile]
#
# A compiled model called inside any tensorhooks context works: Dynamo compiles the model, and
# AOTAutograd saves its tensors through the hooks in force, as with torch's contexts. Entering a
# context *inside* a compiled function cannot be traced (pushing saved-tensor hooks, thread-local
# state and locks are not something Dynamo can put in a graph), and torch's own contexts are on
# Dynamo's skip list for that reason. Ours are made to behave the same way: their entry points
# are `torch.compiler.disable`d with a reason (`not_traced`), so Dynamo breaks the graph once
# where the context is made, runs it eagerly, and under ``fullgraph=True`` raises an error that
# names the context and says what to do, instead of tracing into the push and breaking the graph
# at every step of it. The marks are made without importing Dynamo (see `not_traced`).
#
# The hooks a context pushes run eagerly too. A graph break runs the rest of the frame eagerly
# while the compiled function is still on the stack, and Dynamo then offers it every Python
# frame that starts, pack and unpack hooks called from autograd's C++ included: traced, ours
# broke the graph at every step (a lock, a weak reference, a version read) and recompiled for
# every shape saved, up to Dynamo's cache limit: a context around a model counted more breaks
# and graphs than torch's (torch 2.13, aot_eager). Traced, the version check was also decided
# at trace time (``t._version``): a saved tensor changed before a backward run inside the
# compiled function gave a silently wrong gradient, an unchanged one could raise. torch's own
# hooks live in files Dynamo skips. `torch_compat.push_saved_tensors_hooks`
# makes every hook function of this package that it pushes skipped by Dynamo, with what it
# calls (`skip_code_in_dynamo`); a user's hook called from one of ours runs eagerly with it.
# The same holds for the other functions autograd calls back: the tensor hooks of
# register_multi_grad_hook, sync_gradients' accumulator hooks, offload_parameters' gradient
# hooks and end-of-task callbacks, allow_mutation_on_saved_tensors' version check on nodes that
# saved through another's hooks, and the graph-task store's end-of-task callback and finalizer,
# run
# by a backward called inside a compiled function, are marked with `runs_eagerly`.
#
# allow_mutation_on_saved_tensors works through a TorchDispatchMode, and Dynamo skips every
# frame while a non-infra dispatch mode is active (torch's context included): a compiled
# function called inside the context runs eagerly. torch says nothing; we warn once per process
# (`warn_compile_skipped`), from the mode's ``ignore_compile_internals``, which Dynamo asks only
# when it is about to compile a frame.

_F = TypeVar("_F", bound=Callable[..., Any])

_warned: set[str] = set()


def not_traced(what: str) -> Callable[[_F], _F]:
    """Make Dynamo run ``fn`` eagerly, with one graph break, and say why under fullgraph.

    Done without importing ``torch._dynamo`` (which pulls in the compiler stack, about a second
    of ``import tensorhooks``): Dynamo skips the frames of a code object whose execution strategy
    says so (`skip_code_in_dynamo`, recursively) and refuses to inline a function carrying
    ``_torchdynamo_disable``, breaking the graph with ``_torchdynamo_disable_msg`` as the reason,
    which is what ``torch.compiler.disable(fn, reason=...)`` sets up. Each marked function gets
    its own code object, so that marking it marks nothing else.
    """
    reason = (
        f"tensorhooks.{what} cannot be entered inside a torch.compile'd function; enter it "
        "outside and call the compiled function (or model) inside it"
    )

    def mark(fn: _F) -> _F:
        entry = _fresh_entry(fn)
        skip_code_in_dynamo(entry.__code__)
        entry._torchdynamo_disable = True  # type: ignore[attr-defined]  # read by Dynamo
        entry._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
        return entry  # type: ignore[return-value]

    return mark


def _fresh_entry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``fn``, with a code object of its own (the one Dynamo is told to skip).

    Closures made by one ``def`` share their code object, and ``contextlib.contextmanager``
    shares one helper among every context manager of the process: marking either would mark
    them all. A code object copied for each call of this function belongs to ``fn`` alone.
    """

    def entry(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    entry.__code__ = entry.__code__.replace()  # a copy: same bytecode, its own identity
    return functools.wraps(fn)(entry)


# Code objects `runs_eagerly` has marked, by id (a code object hashes its bytecode and constants
# on every lookup), each held so that its id is never reused.
_eager_code: dict[int, CodeType] = {}


def runs_eagerly(fn: _F) -> _F:
    """Make ``fn``, and all it calls, run eagerly when it is called while a compiled function runs.

    For the functions autograd calls back (tensor hooks, end-of-task callbacks): Dynamo would
    otherwise compile each as a function of its own. See NOTE [Contexts under torch.compile].
    Every function made by one ``def`` shares its code object, so marking one marks them all:
    a code object is marked once, at the first function of it that comes here, and the closures
    made later from the same ``def`` only cost a dictionary look-up.
    """
    code = fn.__code__
    if id(code) not in _eager_code:
        skip_code_in_dynamo(code)  # marked before it is recorded: no thread sees it unmarked
        _eager_code[id(code)] = code
    return fn


def warn_compile_skipped(what: str) -> None:
    """Warn, once per process, that torch.compile compiles nothing while ``what`` is active."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(
        f"torch.compile compiles nothing inside tensorhooks.{what}: Dynamo skips every frame "
        "while its dispatch mode is active, so compiled functions run eagerly there (torch's "
        "context does the same, silently). Compile outside the context, or run without it.",
        UserWarning,
        stacklevel=3,
    )
