"""The checkers of `tensorhooks.testing`: run programs with and without hooks, compare.

See the module docstring of `tensorhooks.testing` for what a check asserts, and
NOTE [Rounding, not wrong gradients] for how gradients are compared.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import torch
from hypothesis import HealthCheck, assume, given, settings
from torch.utils.checkpoint import CheckpointError

from tensorhooks._checkpoint import checkpoint as tensorhooks_checkpoint
from tensorhooks._checkpoint import checkpoint_module as tensorhooks_checkpoint_module
from tensorhooks._hooks import saved_tensors_hooks

from .errors import GradientMismatchError
from .explained import Inline, tensors_in
from .programs import BACKWARDS, Program, programs
from .rounding import RUNS, Perturbation, differences, tolerances

__all__ = [
    "ContextFactory",
    "Outcome",
    "Verdict",
    "assert_context_preserves_gradients",
    "assert_hooks_preserve_gradients",
    "check_checkpoint",
    "check_compiled",
    "check_program",
    "copying_hooks",
    "outcome",
    "tensors_in",
    "within",
]

ContextFactory = Callable[[], AbstractContextManager[Any]]
Results = list[torch.Tensor | None]
_INPLACE_ERROR = "modified by an inplace operation"
# tensorhooks.checkpoint's words for a tensor it read that was replaced, or had its data swapped.
_REPLACED_ERRORS = ("recomputation read a different tensor", "was replaced between the forward")


class Outcome:
    """What one run gave: its results (gradients, then any state), or the exception it raised."""

    __slots__ = ("error", "grads")

    def __init__(self, grads: Results | None, error: BaseException | None) -> None:
        self.grads = grads
        self.error = error

    @property
    def inplace_error(self) -> bool:
        """Whether the run raised autograd's in-place error (or one worded like it)."""
        message = str(self.error)
        return isinstance(self.error, RuntimeError) and (
            _INPLACE_ERROR in message or any(words in message for words in _REPLACED_ERRORS)
        )

    def __str__(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {self.error}"
        return f"gradients {self.grads}"


def outcome(step: Callable[[], Results], context: ContextFactory | None) -> Outcome:
    """Run ``step()`` inside ``context()`` (if any); what it returned, or what it raised."""
    try:
        if context is None:
            grads = step()
        else:
            with context():
                grads = step()
    except Exception as error:
        return Outcome(None, error)
    return Outcome(grads, None)


def within(*factories: ContextFactory | None) -> ContextFactory:
    """A context factory entering each of ``factories`` (None skipped), the first outermost."""

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for factory in factories:
                if factory is not None:
                    stack.enter_context(factory())
            yield

    return enter


def copying_hooks() -> AbstractContextManager[None]:
    """Torch's own pair copying every saved tensor at save time: the save-time reference."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda tensor: tensor.detach().clone(), lambda tensor: tensor
    )


Runner = Callable[[ContextFactory | None], Outcome]


class Verdict:
    """Judges a run against plain autograd's: same gradients, or its in-place error, or save-time.

    Args:
        reference: runs plain autograd's variant of the subject under a context (None: none).
        save_time: runs plain autograd under a context that copies every saved tensor at save.
        shown: what a failure's message ends with (the program as Python).
        label: names result ``i`` in messages.
        subject: what ran the run under test, as messages name it.
        rtol, atol, precision: the comparison's; see NOTE [Rounding, not wrong gradients].
    """

    def __init__(
        self,
        reference: Runner,
        save_time: Runner,
        shown: str,
        label: Callable[[int], str],
        *,
        rtol: float,
        atol: float,
        precision: torch.dtype | None,
        subject: str = "the context",
    ) -> None:
        self.subject = subject
        self.reference = reference
        self.save_time = save_time
        self.shown = shown
        self.label = label
        self.rtol, self.atol, self.precision = rtol, atol, precision

    def judge(self, plain: Outcome, got: Outcome, *, inplace_allowed: bool = False) -> None:
        """Raise GradientMismatchError unless ``got`` is one of the results plain allows.

        ``inplace_allowed``: autograd's in-place error is accepted where plain autograd succeeds.
        """
        if plain.error is None:
            if got.error is not None:
                if not (inplace_allowed and got.inplace_error):
                    self.fail("raised where plain autograd does not", plain, got)
                return
            difference = self._differences(plain, got, self.reference)
            if difference is not None:
                self.fail(f"changed a gradient ({difference})", plain, got)
            return
        if got.inplace_error:
            return
        save_time = self.save_time(None)
        if got.error is not None:
            if save_time.error is None:
                self.fail("raised neither the in-place error nor a gradient", plain, got)
            return
        if save_time.error is not None:
            self.fail("gave a gradient where autograd raises its in-place error", plain, got)
        difference = self._differences(save_time, got, self.save_time)
        if difference is not None:
            self.fail(
                "gave a gradient that is neither the save-time one nor autograd's in-place error "
                f"({difference})",
                plain,
                got,
            )

    def _differences(self, want: Outcome, got: Outcome, again: Runner) -> str | None:
        assert want.grads is not None  # both runs succeeded
        assert got.grads is not None
        rtol, atol = self.rtol, self.atol
        if differences(want.grads, got.grads, self.label, rtol=rtol, atol=atol) is None:
            return None
        runs = [again(self._perturbation(seed)).grads for seed in range(1, RUNS + 1)]
        rounding = tolerances(want.grads, runs)
        return differences(
            want.grads, got.grads, self.label, rtol=rtol, atol=atol, rounding=rounding
        )

    def _perturbation(self, seed: int) -> ContextFactory:
        return lambda: Perturbation(seed, self.precision)

    def fail(self, what: str, plain: Outcome, got: Outcome) -> NoReturn:
        """Raise GradientMismatchError: ``what`` the run did, both outcomes, the subject."""
        raise GradientMismatchError(
            f"{self.subject} {what}.\nplain autograd: {plain}\n{self.subject}: {got}\n{self.shown}"
        ) from got.error


def _program_runner(
    program: Program,
    checkpoint: Callable[[], Any] | None,
    checkpoint_module: Callable[[torch.nn.Module], Any] | None = None,
) -> Runner:
    """Runs ``program`` under a context, its regions run by ``checkpoint()`` (None: as written).

    Its module regions are given to ``checkpoint_module``; with neither, to the ``module``
    method of what ``checkpoint()`` returned, if it has one; otherwise they run as written.
    """

    def run(context: ContextFactory | None) -> Outcome:
        leaves = program.make_leaves()
        regions = checkpoint() if checkpoint is not None else None
        modules = checkpoint_module or getattr(regions, "module", None)
        return outcome(
            lambda: program.run(leaves, checkpoint=regions, checkpoint_module=modules), context
        )

    return run


def _refused_hooks(error: BaseException | None) -> bool:
    """Whether ``error`` is checkpoint_module refusing a pre-hook that changes arguments again.

    A pre-hook that runs before the region and changes its arguments would change them twice in
    recomputation; tensorhooks raises rather than give the gradient of that.
    """
    return isinstance(error, CheckpointError) and "changed the arguments in recomputation" in str(
        error
    )


def _program_verdict(
    program: Program,
    reference: Runner,
    runs: str,
    *,
    rtol: float,
    atol: float,
    precision: torch.dtype | None,
    subject: str = "the context",
) -> Verdict:
    inline = _program_runner(program, Inline)
    return Verdict(
        reference,
        lambda context: inline(within(copying_hooks, context)),
        f"The program, as Python (run program(make_leaves()) {runs}):\n\n{program.source}",
        lambda index: f"result {index}",
        rtol=rtol,
        atol=atol,
        precision=precision,
        subject=subject,
    )


def check_program(
    program: Program,
    context_factory: ContextFactory,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    precision: torch.dtype | None = None,
) -> bool:
    """Run ``program`` with and without ``context_factory()``; raise if gradients differ.

    The program runs as written (its checkpoint regions through ``tensorhooks.checkpoint``) both
    times. Gradients are compared bitwise first; where they differ, within a tolerance measured
    on the program: see "How gradients are compared" on the docs page.

    Example:
        >>> import tensorhooks
        >>> from hypothesis import assume, given, settings
        >>> from tensorhooks.testing import check_program, programs
        >>> @settings(max_examples=5, database=None)
        ... @given(programs())
        ... def test_save_on_cpu(program):
        ...     assume(check_program(program, tensorhooks.save_on_cpu))
        >>> test_save_on_cpu()

    Args:
        program: drawn from `programs`.
        context_factory: returns a new context manager each call.
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: None when the context keeps saved values exactly (in any layout); a
            floating dtype such as ``torch.bfloat16`` when it keeps them rounded to it, so that
            the measured tolerance is what rounding to that dtype can change.

    Returns:
        False when plain autograd rejects the program in a way unrelated to saved tensors (an
        op it refuses), which the caller should skip; True when the program was checked.

    Raises:
        GradientMismatchError: when the context changed a gradient, raised where plain autograd
            does not, or gave a gradient that is neither plain autograd's in-place error nor
            the save-time gradient (an ``AssertionError``; the message holds the program).
    """
    as_written = _program_runner(program, None)
    runs = "with and without the context"
    verdict = _program_verdict(program, as_written, runs, rtol=rtol, atol=atol, precision=precision)
    plain = as_written(None)
    if _refused_hooks(plain.error):
        return False  # checkpoint_module refuses the program's hooks: nothing to compare
    if plain.error is not None and not plain.inplace_error and verdict.save_time(None).error:
        # Plain autograd refuses this program for a reason of its own; so does the save-time
        # reference, so there is nothing to compare.
        return False
    got = as_written(context_factory)
    if _refused_hooks(got.error):
        # The same refusal, met in the context's run only (plain autograd's in-place error came
        # first without it): an error that says why, never a gradient, so nothing to compare.
        return False
    verdict.judge(plain, got)
    return True


def check_checkpoint(
    program: Program,
    checkpoint: Callable[..., Any] | None = None,
    *,
    checkpoint_module: Callable[[torch.nn.Module], Any] | None = None,
    context_factory: ContextFactory | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    precision: torch.dtype | None = None,
) -> bool:
    """Run ``program``'s checkpoint regions through ``checkpoint``; compare with plain autograd.

    The reference runs each region as a plain call of its function. The checkpointed run must
    give plain autograd's gradients (and leave the state the regions write as plain autograd
    does); where plain autograd raises its in-place error, raise it too or give the save-time
    gradient. Since a region saves its arguments and reads what it reaches again in
    recomputation, autograd's in-place error (or tensorhooks' error naming a replaced tensor)
    is also accepted where plain autograd succeeds if the program changed something the region
    read after the region's call and before backward: an argument or a tensor it read written
    in place, rebound to a tensor of other values or given other data (a layer swapped, an
    optimizer step), a counter it read rebound; or if a region under a selective policy writes
    in place (a policy refuses a saved output written later). State the region writes,
    rebinds or rebuilds itself (a running statistic, a mask kept on a module, a ``.data`` swap
    to the same values) and what it reaches but never reads (a later block of its parent
    module) explain no error: plain autograd's results are required there. A program's module
    regions (region kind
    "module") are given to ``checkpoint_module`` and compared with the plain module; its
    ``CheckpointError`` refusing a pre-hook that would change the arguments twice in
    recomputation is accepted (an error, not a wrong gradient). Gradients are compared as
    `check_program` compares them.

    Example:
        >>> import torch
        >>> from hypothesis import assume, given, settings
        >>> from tensorhooks.testing import check_checkpoint, programs
        >>> @settings(max_examples=5, database=None, deadline=None)
        ... @given(programs(checkpoint=["outside", "reached", "state"], backwards=["grad"]))
        ... def test_checkpoint(program):
        ...     assume(check_checkpoint(program))
        >>> test_checkpoint()

    Args:
        program: drawn from ``programs(checkpoint=...)``.
        checkpoint: called as ``checkpoint(function, *args, use_reentrant=False, ...)`` for each
            region; default ``tensorhooks.checkpoint``.
        checkpoint_module: called as ``checkpoint_module(module)`` for each module region;
            default ``tensorhooks.checkpointing.checkpoint_module`` (torch's composable
            ``torch.distributed._composable.checkpoint`` takes the same call).
        context_factory: returns a context manager that the checkpointed run (forward and
            backward) runs inside; None: none. The reference runs without it.
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: as for `check_program`.

    Returns:
        False when plain autograd rejects the program in a way unrelated to saved tensors;
        True when the program was checked.

    Raises:
        GradientMismatchError: when the checkpointed run gave another gradient or state, or
            raised where neither plain autograd nor a changed input explains it.
    """
    regions = checkpoint if checkpoint is not None else tensorhooks_checkpoint
    modules = checkpoint_module or tensorhooks_checkpoint_module
    inline = _program_runner(program, Inline)
    runs = "as written, and with each region's function called directly"
    verdict = _program_verdict(
        program,
        inline,
        runs,
        rtol=rtol,
        atol=atol,
        precision=precision,
        subject="the checkpointed run",
    )
    read = Inline()
    plain = outcome(
        lambda: program.run(program.make_leaves(), checkpoint=read, checkpoint_module=read.module),
        None,
    )
    if plain.error is not None and not plain.inplace_error and verdict.save_time(None).error:
        return False
    got = _program_runner(program, lambda: regions, modules)(context_factory)
    if _refused_hooks(got.error):
        return True  # an error, not a wrong gradient
    verdict.judge(plain, got, inplace_allowed=read.explains_inplace_error)
    return True


def check_compiled(
    program: Program, *, rtol: float = 0.0, atol: float = 0.0, precision: torch.dtype | None = None
) -> bool:
    """Run a compiled program as written and eagerly without its context; compare.

    The program, drawn by ``programs(compile=True)``, runs its steps in a function compiled
    with ``torch.compile(backend="aot_eager")`` and enters a tensorhooks context inside it. The
    reference runs the same function eagerly, with no context: plain autograd. The compiled
    run must give plain autograd's gradients; where plain autograd raises its in-place error
    (a saved tensor was written before backward), raise it too or give the save-time gradient.
    Gradients are compared as `check_program` compares them.

    Example:
        >>> from hypothesis import assume, given, settings
        >>> from tensorhooks.testing import check_compiled, programs
        >>> @settings(max_examples=2, database=None, deadline=None)
        ... @given(programs(compile=True))
        ... def test_compiled(program):
        ...     assume(check_compiled(program))
        >>> test_compiled()

    Args:
        program: drawn from ``programs(compile=True)``.
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: as for `check_program`.

    Returns:
        False when plain autograd rejects the program in a way unrelated to saved tensors;
        True when the program was checked.

    Raises:
        GradientMismatchError: when the compiled run gave another gradient, or raised where
            plain autograd does not.
    """

    def runner(plain: bool) -> Runner:
        def run(context: ContextFactory | None) -> Outcome:
            leaves = program.make_leaves()
            return outcome(lambda: program.run(leaves, plain=plain), context)

        return run

    reference = runner(plain=True)
    verdict = Verdict(
        reference,
        lambda context: reference(within(copying_hooks, context)),
        "The program, as Python (run program(make_leaves()) as written, and with compiler "
        f"and context doing nothing):\n\n{program.source}",
        lambda index: f"result {index}",
        rtol=rtol,
        atol=atol,
        precision=precision,
        subject="the compiled run",
    )
    plain = reference(None)
    if plain.error is not None and not plain.inplace_error and verdict.save_time(None).error:
        return False
    import torch._dynamo  # noqa: PLC0415 (only compiled programs need the compiler stack)

    torch._dynamo.reset()  # each program compiles afresh, within Dynamo's recompile limit
    with warnings.catch_warnings():
        # allow_mutation_on_saved_tensors says, once, that Dynamo compiles nothing inside it.
        warnings.filterwarnings("ignore", message="torch.compile compiles nothing inside")
        # Dynamo's own deprecation warnings (tracing a custom Function), not the program's.
        warnings.simplefilter("ignore", DeprecationWarning)
        got = runner(plain=False)(None)
    verdict.judge(plain, got)
    return True


def _check_settings(max_examples: int | None) -> settings:
    profile = settings()  # the active profile
    return settings(
        profile,
        max_examples=max_examples or profile.max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def assert_context_preserves_gradients(
    context_factory: ContextFactory,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    precision: torch.dtype | None = None,
    max_examples: int | None = None,
    writes: bool = True,
    backwards: Collection[str] = BACKWARDS,
) -> None:
    """Check on random programs that ``context_factory()`` never changes a gradient.

    Each program runs forward and backward inside a fresh ``context_factory()``. See the module
    docstring for what counts as a failure, and `check_program` for how gradients are compared.
    Hypothesis shrinks a failing program before it is shown; the active hypothesis profile
    (``derandomize``, ``database``) applies.

    Example:
        >>> import tensorhooks
        >>> from tensorhooks.testing import assert_context_preserves_gradients
        >>> assert_context_preserves_gradients(tensorhooks.save_on_cpu, max_examples=5)

    Args:
        context_factory: returns a new context manager each call (a class such as
            ``tensorhooks.save_on_cpu`` works).
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: None when the context keeps saved values exactly; a dtype such as
            ``torch.bfloat16`` when it keeps them rounded to it (see `check_program`).
        max_examples: how many programs to try; default: the active hypothesis profile's.
        writes: whether programs change tensors in place (turn off for hooks that are not
            meant to survive in-place writes, and that autograd's check cannot see).
        backwards: the backward variants programs run (see `programs`); leave out "twice"
            and "double" for hooks that free what they stored on unpack.

    Raises:
        GradientMismatchError: on the first (shrunk) program whose gradients differ.
        CheckArgumentValueError: when ``backwards`` names no known variant.
    """
    strategy = programs(writes=writes, backwards=backwards)

    @_check_settings(max_examples)
    @given(strategy)
    def check(program: Program) -> None:
        assume(check_program(program, context_factory, rtol=rtol, atol=atol, precision=precision))

    check()


def assert_hooks_preserve_gradients(
    pack_hook: Callable[[torch.Tensor], Any],
    unpack_hook: Callable[[Any], torch.Tensor],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    precision: torch.dtype | None = None,
    max_examples: int | None = None,
    writes: bool = True,
    backwards: Collection[str] = BACKWARDS,
) -> None:
    """Check on random programs that a pack/unpack pair never changes a gradient.

    The pair is pushed with `tensorhooks.saved_tensors_hooks`, so a pack that returns the tensor
    itself passes (its safety net raises autograd's in-place error); use
    `assert_context_preserves_gradients` to check a pair under another context.

    Example:
        >>> import torch
        >>> from tensorhooks.testing import assert_hooks_preserve_gradients
        >>> assert_hooks_preserve_gradients(
        ...     lambda t: t.detach().clone(), lambda t: t, max_examples=5)
        >>> import itertools
        >>> store, keys = {}, itertools.count()
        >>> def pack(tensor):  # frees on unpack: one backward per graph only
        ...     key = next(keys)
        ...     store[key] = tensor.detach().to(torch.bfloat16)
        ...     return key, tensor.dtype
        >>> def unpack(packed):
        ...     return store.pop(packed[0]).to(packed[1])
        >>> assert_hooks_preserve_gradients(
        ...     pack, unpack, precision=torch.bfloat16,
        ...     backwards=["backward", "inputs", "grad"], max_examples=5)

    Args:
        pack_hook: ``pack_hook(tensor) -> Any``.
        unpack_hook: ``unpack_hook(packed) -> Tensor``.
        rtol: relative tolerance added to the measured rounding tolerance.
        atol: absolute tolerance added to it.
        precision: None when the pair keeps saved values exactly; the dtype it rounds them to
            otherwise (see `check_program`).
        max_examples: how many programs to try; default: the active hypothesis profile's.
        writes: whether programs change tensors in place.
        backwards: the backward variants programs run (see `programs`).

    Raises:
        GradientMismatchError: on the first (shrunk) program whose gradients differ.
        CheckArgumentValueError: when ``backwards`` names no known variant.
    """
    assert_context_preserves_gradients(
        lambda: saved_tensors_hooks(pack_hook, unpack_hook),
        rtol=rtol,
        atol=atol,
        precision=precision,
        max_examples=max_examples,
        writes=writes,
        backwards=backwards,
    )
