"""Random autograd programs for `tensorhooks.testing`, drawn by hypothesis as Python source.

A program is drawn step by step and written down as the Python it runs: the source shown when a
check fails is exactly the code that ran. See NOTE [Random autograd programs].
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from .compiled import compiled_source
from .drawing import SHAPE, Scope, alias, compute, leaves_source, pick, write
from .errors import CheckArgumentValueError
from .reached import change
from .regions import REGION_KINDS, draw_region, policy_source
from .rounding import perturbing
from .stateful import Held, outside_block, swap

_PROGRAM_MODULE = "tensorhooks_testing_program"

__all__ = ["BACKWARDS", "REGION_KINDS", "Program", "SavedOutputExp", "Square", "programs"]

# NOTE [Random autograd programs]
#
# A program starts from one to three leaves of shape (4, 4) (float64, requiring grad, seeded)
# and a constant that does not require grad. Each step either computes a new value from aliases
# of earlier values, or writes in place through an alias. An alias is a chain of zero to two
# views (row and column slices, strided slices, transposes, selects, diagonals, flat slices,
# ``as_strided`` windows), so writes reach saved tensors through views of views, bases and
# unrelated-looking windows of the same storage. Ops cover elementwise functions that save their
# input or their output, matmul and ``linear`` (which save a view they make of their second
# operand), reductions, and two custom Functions (one saves its input, one its output). Writes
# are in-place ops, ``out=`` into a view, and (on computed values) in-place ops recorded by
# autograd. The loss sums every computed value, each taken right after it is made. Backward
# runs one of BACKWARDS (those the caller allows): ``backward()``, ``backward(inputs=...)``,
# ``autograd.grad``, ``backward(retain_graph=True)`` twice, a double backward through
# ``create_graph=True``, or ``backward()`` or ``autograd.grad`` on a worker thread (a
# ``threading.Thread`` the program starts and joins; an error it raises there is raised again
# on the program's thread). With ``checkpoint``, a third of the computing steps are checkpoint
# regions; see NOTE [Random checkpoint regions].
#
# Shapes are tracked while drawing by applying each view and op to an empty tensor of the
# value's shape, so every line is written with concrete indices.

BACKWARDS = ("backward", "inputs", "grad", "twice", "double", "thread")


class Square(torch.autograd.Function):
    """``x * x`` saving its input with ``save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """Return ``x * x``."""
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        """Return ``2 * x * grad``."""
        (x,) = ctx.saved_tensors
        result: torch.Tensor = 2 * x * grad
        return result


class SavedOutputExp(torch.autograd.Function):
    """``exp(x)`` saving its output with ``save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        """Return ``exp(x)``."""
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        """Return ``grad * exp(x)``."""
        (y,) = ctx.saved_tensors
        result: torch.Tensor = grad * y
        return result


@dataclass(frozen=True)
class Program:
    """A random autograd program: Python source defining ``make_leaves()`` and ``program(leaves)``.

    ``program(leaves)`` runs the forward pass and one backward variant, and returns the
    gradients that variant produced (a list of tensors or None), followed by the state its
    checkpoint regions write when they write some (``const`` and ``count``, then the hidden
    states, counters and running statistics of the objects its regions keep state in).
    """

    source: str
    n_leaves: int = field(compare=False)

    def __repr__(self) -> str:
        return f"Program(<{self.source.count(chr(10))} lines of Python>)"

    def _namespace(self) -> dict[str, Any]:
        # A module of its own, registered: Dynamo (torch 2.11) imports the module a compiled
        # function's globals name.
        module = types.ModuleType(_PROGRAM_MODULE)
        sys.modules.setdefault(_PROGRAM_MODULE, module)
        namespace: dict[str, Any] = {"__name__": _PROGRAM_MODULE}
        exec(compile(self.source, "<random autograd program>", "exec"), namespace)
        if namespace.get("threading") is threading:
            namespace["threading"] = _WORKERS
        return namespace

    def make_leaves(self) -> list[torch.Tensor]:
        """Fresh leaves, with the same values on every call."""
        leaves: list[torch.Tensor] = self._namespace()["make_leaves"]()
        return leaves

    def run(
        self,
        leaves: list[torch.Tensor],
        *,
        checkpoint: Callable[..., Any] | None = None,
        checkpoint_module: Callable[[torch.nn.Module], Any] | None = None,
        plain: bool = False,
    ) -> list[torch.Tensor | None]:
        """Run forward and backward on ``leaves``; return the gradients.

        Args:
            leaves: from `make_leaves`.
            checkpoint: runs the program's checkpoint regions in place of the
                ``tensorhooks.checkpoint`` its source imports (called as
                ``checkpoint(function, *args, use_reentrant=False, ...)``); None: that one.
            checkpoint_module: applied to the program's module regions in place of the
                ``tensorhooks.checkpointing.checkpoint_module`` its source imports (called as
                ``checkpoint_module(module)`` before or after hooks are registered on it);
                None: that one.
            plain: for a program drawn with ``compile=True``: run its function eagerly and
                enter no context in it (plain autograd, the reference).
        """
        namespace = self._namespace()
        if plain:
            namespace["compiler"] = lambda function: function
            namespace["context"] = contextlib.nullcontext
        if checkpoint is not None:
            namespace["checkpoint"] = checkpoint
        if checkpoint_module is not None:
            namespace["checkpoint_module"] = checkpoint_module
        grads: list[torch.Tensor | None] = namespace["program"](leaves)
        return grads


class _Worker(threading.Thread):
    """A worker thread, run on the calling thread inside a perturbed run.

    The rounding measurement's `Perturbation` is a dispatch mode of the thread that entered it;
    run there, backward is perturbed as the forward pass is (NOTE [Rounding, not wrong
    gradients] in rounding.py). Anywhere else it is a thread of its own.
    """

    inline = False

    def start(self) -> None:
        if perturbing():
            self.inline = True
            self.run()
        else:
            super().start()

    def join(self, timeout: float | None = None) -> None:
        if not self.inline:
            super().join(timeout)


_WORKERS = types.SimpleNamespace(Thread=_Worker)


class _Builder:
    """Writes a program's lines, with the values in scope and what its regions did."""

    def __init__(
        self, draw: st.DrawFn, n_leaves: int, *, writes: bool, kinds: frozenset[str] | None
    ) -> None:
        self.draw = draw
        self.writes = writes
        self.with_regions = kinds is not None
        self.kinds = kinds or frozenset()
        self.lines: list[str] = []
        self.scope = Scope()
        empty = torch.empty(SHAPE, dtype=torch.float64)
        for index in range(n_leaves):
            self.scope.add(f"leaf{index}", empty, requires_grad=True, computed=False)
        self.scope.add("const", empty, requires_grad=False, computed=False)
        if "state" in self.kinds:
            self.scope.add("count", torch.empty(()), requires_grad=False, computed=False)
        self.regions = 0  # how many regions were drawn
        self.outside_reads: list[int] = []  # values regions read outside their arguments
        self.writes_state = False  # whether a region writes state
        self.uses_policy = False  # whether a region takes the selective policy
        self.n_leaves = n_leaves
        self.rebinds: list[tuple[str, int]] = []  # how to bind a new tensor where regions read
        self.modules = 0  # how many regions are modules
        self.global_hooks = False  # whether a module region registered a global hook
        self.held = Held()  # the Python objects regions keep state in

    def add_value(self, expr: str, dummy: torch.Tensor, requires_grad: bool) -> None:
        """Append ``v<n> = expr`` and its term of the loss."""
        name = f"v{len(self.scope.names)}"
        weight = 1 + len(self.scope.names) / 8
        self.lines.append(f"{name} = {expr}")
        self.lines.append(f"terms.append({name}.sum() * {weight})")
        self.scope.add(name, dummy, requires_grad, computed=True)


def _compute(builder: _Builder) -> None:
    builder.add_value(*compute(builder.draw, builder.scope))


def _write(builder: _Builder) -> None:
    draw, scope = builder.draw, builder.scope
    if len(builder.outside_reads) > 0 and draw(st.booleans()):
        index = draw(st.sampled_from(builder.outside_reads))  # what a region read from outside
    else:
        index = pick(draw, scope)
    if scope.requires_grad[index] and not scope.computed[index] and draw(st.integers(0, 3)) == 0:
        builder.lines.extend(_refill(scope.names[index]))  # a leaf: a weight, as FSDP2's
        return
    recorded = draw(st.booleans()) and scope.computed[index]
    x, _ = alias(draw, scope.names[index], scope.dummies[index], for_recorded_write=recorded)
    line = write(draw, x, recorded=recorded)
    builder.lines.extend([line] if recorded else ["with torch.no_grad():", f"    {line}"])


def _refill(name: str) -> list[str]:
    """Free the storage of leaf ``name`` and write its values back as FSDP2 does with weights.

    The storage is resized to zero bytes and back (no operator sees that), then refilled under
    ``torch.autograd._unsafe_preserve_version_counter``: autograd does not count the write, and
    backward reads the same values. In between, the new memory is filled with NaN by a write no
    operator hook sees and no version counter counts, as freed memory holds anything: a copy
    taken of it before the refill would show in the gradients. Only where the tensor covers its
    whole storage.
    """
    return [
        (
            f"if {name}.is_contiguous() and "
            f"{name}.untyped_storage().nbytes() == {name}.numel() * {name}.element_size():"
        ),
        "    with torch.no_grad():",
        f"        kept = {name}.clone()",
        f"        {name}.untyped_storage().resize_(0)",
        f"        {name}.untyped_storage().resize_(kept.numel() * kept.element_size())",
        "        with torch.utils._python_dispatch._disable_current_modes():",
        f"            {name}.data.fill_(float('nan'))",
        f"        with torch.autograd._unsafe_preserve_version_counter({name}):",
        f"            {name}.copy_(kept)",
    ]


def _backward(builder: _Builder, n_leaves: int, backwards: tuple[str, ...]) -> list[str]:
    """The lines running backward; they set ``grads``."""
    draw = builder.draw
    kind = draw(st.sampled_from(backwards))
    leaves = ", ".join(f"leaf{i}" for i in range(n_leaves))
    if kind == "thread":
        builder.held.thread = True
        return _on_thread(builder, leaves)
    if kind in ("inputs", "grad"):
        inputs = _inputs(builder)
        if kind == "grad":
            return [f"grads = list(torch.autograd.grad(loss, [{inputs}], allow_unused=True))"]
        retain = [f"{name}.retain_grad()" for name in inputs.split(", ") if name.startswith("v")]
        return [
            *retain,
            f"loss.backward(inputs=[{inputs}])",
            f"grads = [t.grad for t in [{inputs}]]",
        ]
    if kind == "twice":
        return [
            "loss.backward(retain_graph=True)",
            "loss.backward()",
            f"grads = [t.grad for t in [{leaves}]]",
        ]
    if kind == "double":
        return [
            f"first = torch.autograd.grad(loss, [{leaves}], create_graph=True, allow_unused=True)",
            "second = sum((g * g).sum() for g in first if g is not None and g.requires_grad)",
            "if isinstance(second, torch.Tensor):",
            "    second.backward()",
            (
                "grads = [*(g.detach() if g is not None else None for g in first), "
                f"*(t.grad for t in [{leaves}])]"
            ),
        ]
    return ["loss.backward()", f"grads = [t.grad for t in [{leaves}]]"]


def _inputs(builder: _Builder) -> str:
    """One to three values requiring grad, for ``backward(inputs=...)`` or ``autograd.grad``."""
    scope = builder.scope
    wanted = [i for i, flag in enumerate(scope.requires_grad) if flag]
    chosen = builder.draw(st.lists(st.sampled_from(wanted), min_size=1, max_size=3, unique=True))
    return ", ".join(scope.names[i] for i in sorted(chosen))


def _on_thread(builder: _Builder, leaves: str) -> list[str]:
    """``backward()`` or ``autograd.grad`` on a worker thread; its error raised again here."""
    if builder.draw(st.booleans()):
        run = f"torch.autograd.grad(loss, [{_inputs(builder)}], allow_unused=True)"
        result = "grads = list(outcome[0])"
    else:
        run = "loss.backward()"
        result = f"grads = [t.grad for t in [{leaves}]]"
    return [
        "outcome = []",
        "def on_thread():",
        "    try:",
        f"        outcome.append({run})",
        "    except BaseException as error:  # raised again on the program's thread",
        "        outcome.append(error)",
        "worker = threading.Thread(target=on_thread)",
        "worker.start()",
        "worker.join()",
        "if isinstance(outcome[0], BaseException):",
        "    raise outcome[0]",
        result,
    ]


def programs(
    *,
    max_steps: int = 8,
    writes: bool = True,
    checkpoint: bool | Collection[str] = False,
    backwards: Collection[str] = BACKWARDS,
    compile: bool = False,
) -> st.SearchStrategy[Program]:
    """Random autograd programs of 1 to ``max_steps`` steps, as a hypothesis strategy.

    Example:
        >>> from hypothesis import given, settings
        >>> from tensorhooks.testing import programs
        >>> @settings(max_examples=3, database=None)
        ... @given(programs(checkpoint=True, backwards=["backward", "grad"]))
        ... def test(program):
        ...     print(program.source.splitlines()[0])
        >>> test()  # doctest: +ELLIPSIS
        import torch
        ...

    Args:
        max_steps: the most steps (computations, writes, regions) a program has.
        writes: whether programs change tensors in place.
        checkpoint: whether a third of the computing steps are ``tensorhooks.checkpoint``
            regions. True draws every kind of region; a collection of their names draws only
            those kinds: "aliasing" (arguments alias each other),
            "inplace" (the region writes its arguments and intermediates in place), "outside"
            (it reads an earlier value through a view it makes, as ``nn.Linear`` reads its
            weight), "policy" (a random selective checkpoint policy), "reached" (it reads a
            value through a list, tuple, dict, plain object, global, module or ModuleDict, and
            the program binds a new tensor there, swaps its data or steps an optimizer of each
            implementation before backward), "state" (it writes state in place, a buffer or a
            counter, and reads it back), "module" (half the regions are a module's forward,
            checkpointed by ``tensorhooks.checkpointing.checkpoint_module``, with forward hooks
            and pre-hooks that change its arguments, keyword arguments or output, or not,
            registered before or after it, with ``prepend=True``, or globally); and what
            regions keep in Python objects: "kept" (a mask or constant it makes without grad
            and keeps on a module, in a cache dict or a buffer registered in forward, shared by
            every region, or returns inside a nested output), "data" (an idempotent ``.data``
            swap of a leaf before reading it: a gather of the same values, ``torch.renorm``, a
            view of one flat buffer), "lazy" (the first call of a ``torch.nn.LazyLinear``),
            "rebound" (a hidden state, running mean or int or tensor counter read from a
            module's attribute and rebound there, the same cell sometimes used again), "swapped"
            (a layer of a pair in a dict, ``ModuleList`` or list, swapped, or their weights,
            before backward), "parent" (blocks, BatchNorm among them, reached through a parent
            module, some also run outside regions), "norm" (a ``BatchNorm1d`` in training
            mode, sometimes run twice); an empty collection draws regions of plain ops on their
            arguments only.
        backwards: which backward variants programs run, among "backward",
            "inputs" (``backward(inputs=...)``), "grad" (``torch.autograd.grad``), "twice"
            (``backward(retain_graph=True)`` then ``backward()``), "double" (a double
            backward) and "thread" (``backward()`` or ``torch.autograd.grad`` on a worker
            ``threading.Thread``, its error raised again on the program's thread). A
            pack/unpack pair that frees what it stored on unpack can only run one backward over
            a graph: pass ``["backward", "inputs", "grad", "thread"]``.
        compile: draw compiled programs instead: their steps run inside a function compiled
            with ``torch.compile(backend="aot_eager")``, with a tensorhooks context entered
            inside it (identity or copying hooks, ``save_on_cpu``,
            ``allow_mutation_on_saved_tensors``), an optional in-place write of a value
            computed there, and backward inside the context, after it, or outside the compiled
            function (``checkpoint``, ``writes`` and ``backwards`` do not apply; check them
            with `check_compiled`). Each such program compiles, which costs seconds: draw few.

    Returns:
        A strategy of `Program`.

    Raises:
        CheckArgumentValueError: when ``checkpoint`` or ``backwards`` names a kind or variant
            that does not exist, or ``backwards`` is empty.
    """
    kinds = _region_kinds(checkpoint)
    if compile:
        return _compiled_programs()
    variants = tuple(backwards)
    unknown = sorted(set(variants) - set(BACKWARDS))
    if unknown or not variants:
        raise CheckArgumentValueError(
            f"programs(backwards=...): got {list(variants)}; pass a non-empty collection of "
            f"{list(BACKWARDS)}"
        )
    return _programs(max_steps=max_steps, writes=writes, kinds=kinds, backwards=variants)


def _region_kinds(checkpoint: bool | Collection[str]) -> frozenset[str] | None:
    if checkpoint is True:
        return frozenset(REGION_KINDS)
    if checkpoint is False:
        return None
    kinds = frozenset(checkpoint)
    if isinstance(checkpoint, str) or not kinds <= set(REGION_KINDS):
        raise CheckArgumentValueError(
            f"programs(checkpoint=...): got {checkpoint!r}; pass True, False, or a collection "
            f"of {list(REGION_KINDS)}"
        )
    return kinds


@st.composite
def _compiled_programs(draw: st.DrawFn) -> Program:
    n_leaves = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**16))
    return Program(compiled_source(draw, n_leaves, seed), n_leaves)


@st.composite
def _programs(
    draw: st.DrawFn,
    *,
    max_steps: int,
    writes: bool,
    kinds: frozenset[str] | None,
    backwards: tuple[str, ...],
) -> Program:
    n_leaves = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    builder = _Builder(draw, n_leaves, writes=writes, kinds=kinds)
    for _ in range(draw(st.integers(1, max_steps))):
        if "swapped" in builder.kinds and builder.held.pairs and draw(st.integers(0, 2)) == 0:
            swap(builder)
        elif "parent" in builder.kinds and builder.held.parent and draw(st.integers(0, 2)) == 0:
            builder.add_value(*outside_block(builder), requires_grad=True)
        elif writes and "reached" in builder.kinds and draw(st.integers(0, 3)) == 0:
            change(builder)
        elif writes and draw(st.integers(0, 2)) == 0:
            _write(builder)
        elif builder.with_regions and draw(st.integers(0, 2)) == 0:
            draw_region(builder)
        else:
            _compute(builder)
    if not any(builder.scope.computed):
        _compute(builder)
    if len(builder.held.pairs) > 0 and draw(st.booleans()):
        swap(builder)  # a layer swapped after the last region that used it, too
    state = [*(("const", "count") if builder.writes_state else ()), *builder.held.state]
    returned = f"[*grads, {', '.join(state)}]" if state else "grads"
    seed_modules = [f"torch.manual_seed({seed})  # modules start alike in every run"]
    body = [
        *(seed_modules if builder.held.seeded else ()),
        "terms = []",
        *builder.lines,
        "loss = torch.stack(terms).sum() if terms else leaf0.sum()",
        *_backward(builder, n_leaves, backwards),
        f"return {returned}",
    ]
    if builder.global_hooks:  # global module hooks are removed however the program ends
        body = [
            "handles = []",
            "try:",
            *(f"    {line}" for line in body),
            "finally:",
            "    for handle in handles:",
            "        handle.remove()",
        ]
    return Program(_source(builder, n_leaves, seed, body, draw), n_leaves)


def _source(builder: _Builder, n_leaves: int, seed: int, body: list[str], draw: st.DrawFn) -> str:
    imports = ["import torch"]
    if builder.held.thread:
        imports.insert(0, "import threading")
    if "reached" in builder.kinds:
        imports.append("import types")
    if builder.regions > builder.modules:
        imports.append("from tensorhooks import checkpoint")
    if builder.modules:
        imports.append("from tensorhooks.checkpointing import checkpoint_module")
    policy: list[str] = []
    if builder.uses_policy:
        imports.append(
            "from tensorhooks import CheckpointPolicy, create_selective_checkpoint_contexts"
        )
        policy = [*policy_source(draw), "", ""]
    leaves = ", ".join(f"leaf{i}" for i in range(n_leaves))
    state = ["count = torch.zeros((), dtype=torch.float64)"] if "state" in builder.kinds else []
    return "\n".join(
        [
            *imports,
            "from tensorhooks.testing import SavedOutputExp, Square",
            "",
            "",
            *policy,
            *leaves_source(seed, n_leaves),
            "def program(leaves):",
            f"    {leaves}, = leaves",
            "    const = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)",
            *(f"    {line}" for line in state),
            *(f"    {line}" for line in body),
            "",
        ]
    )
