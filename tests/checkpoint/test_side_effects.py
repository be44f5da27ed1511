"""Selective checkpointing saves the outputs of ops with ordered side effects, as torch 2.15 does.

Differential against torch's own selective checkpoint where the installed torch has the rule
(2.15), against the rule itself on older releases (where torch runs such ops again).
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._library.effects import EffectType
from torch.utils._python_dispatch import TorchDispatchMode

import tensorhooks
from tensorhooks import CheckpointPolicy, checkpoint
from tensorhooks._core import torch_compat
from tests.checkpoint.common import assert_same, grads, input_tensor, weights

aten = torch.ops.aten

# The torch that saves such outputs itself (2.15 on); older ones run the ops again.
TORCH_SAVES_EFFECTS = hasattr(torch_checkpoint, "_is_cacheable_effect")

# How many times each op below ran, by name.
RUNS: Counter[str] = Counter()


@torch.library.custom_op("tensorhooks_effects::tick", mutates_args=())
def tick(x: torch.Tensor) -> torch.Tensor:
    """An op with an ordered side effect (it counts its runs) and a tensor output."""
    RUNS["tick"] += 1
    return x * 2


@tick.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tick.register_autograd(lambda ctx, grad: grad * 2)


@torch.library.custom_op("tensorhooks_effects::note", mutates_args=())
def note(x: torch.Tensor) -> None:
    """An op with an ordered side effect and no output (a logger's)."""
    RUNS["note"] += 1


note.register_fake(lambda x: None)


@torch.library.custom_op("tensorhooks_effects::pure_tick", mutates_args=())
def pure_tick(x: torch.Tensor) -> torch.Tensor:
    """The same as tick, without a registered effect: recomputed as any op."""
    RUNS["pure_tick"] += 1
    return x * 2


@pure_tick.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


pure_tick.register_autograd(lambda ctx, grad: grad * 2)


@torch.library.custom_op("tensorhooks_effects::bump_", mutates_args=("x",))
def bump_(x: torch.Tensor) -> None:
    """An effectful op that writes its argument: not a value to keep, so it runs again."""
    RUNS["bump_"] += 1
    x.add_(1)


for _op in (tick, note, bump_):
    torch.library._register_effectful_op(_op._opoverload, EffectType.ORDERED)

# A raw collective's namespace: effectful ops there are run again (they return Work handles).
_C10D = torch.library.Library("c10d", "FRAGMENT")
_C10D.define("tensorhooks_probe(Tensor x) -> Tensor")


def _probe(x: torch.Tensor) -> torch.Tensor:
    RUNS["probe"] += 1
    return x + 1


_C10D.impl("tensorhooks_probe", _probe, "CompositeExplicitAutograd")
_C10D._register_effectful_op("c10d::tensorhooks_probe", EffectType.ORDERED)
probe = torch.ops.c10d.tensorhooks_probe.default

CONTEXTS = {
    "tensorhooks": tensorhooks.create_selective_checkpoint_contexts,
    "torch": torch_checkpoint.create_selective_checkpoint_contexts,
}
EVERY_POLICY: list[Any] = [*CheckpointPolicy, True, False]


def _effects(x: torch.Tensor) -> torch.Tensor:
    y = tick(x.sin())
    note(y)
    return y.cos()


def _policy_for_all(choice: Any) -> Callable[..., Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return choice

    return policy


def _runs_per_backward(
    run: Callable[..., Any], function: Callable[..., Any], context_fn: Any, **options: Any
) -> tuple[dict[str, int], list[torch.Tensor]]:
    """The runs of each op during one checkpointed forward and backward, and the grads."""
    w, _ = weights()
    x = input_tensor()
    RUNS.clear()
    out = run(lambda a: function(a @ w), x, use_reentrant=False, context_fn=context_fn, **options)
    got = list(torch.autograd.grad(out.sum(), [x, w]))
    return dict(RUNS), got


def _expected_runs(choice: Any) -> dict[str, int]:
    again = choice is CheckpointPolicy.MUST_RECOMPUTE
    return {"tick": 1 + again, "note": 1 + again}


@pytest.mark.parametrize("factory", sorted(CONTEXTS))
@pytest.mark.parametrize("choice", EVERY_POLICY, ids=str)
def test_effectful_ops_run_once_unless_must_recompute(factory: str, choice: Any) -> None:
    """An op with ordered side effects runs once under every policy but MUST_RECOMPUTE."""
    context_fn = functools.partial(CONTEXTS[factory], _policy_for_all(choice))
    runs, got = _runs_per_backward(checkpoint, _effects, context_fn)
    assert runs == _expected_runs(choice)
    w, _ = weights()
    x = input_tensor()
    RUNS.clear()
    assert_same(got, grads(lambda: _effects(x @ w), [x, w]))


@pytest.mark.parametrize("choice", EVERY_POLICY, ids=str)
def test_runs_as_torch_does_on_every_release(choice: Any) -> None:
    """Effectful ops run as torch 2.15 runs them, on every release (older torch runs them again)."""
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, _policy_for_all(choice)
    )
    ours, our_grads = _runs_per_backward(checkpoint, _effects, context_fn)
    torchs, torch_grads = _runs_per_backward(torch_checkpoint.checkpoint, _effects, context_fn)
    assert_same(our_grads, torch_grads)
    if TORCH_SAVES_EFFECTS:
        assert ours == torchs
        return
    # torch 2.11 to 2.14 save an output only for the SAVE policies (True among them).
    saves = choice is True or (
        isinstance(choice, CheckpointPolicy) and choice.name.endswith("_SAVE")
    )
    assert torchs == {"tick": 2 - saves, "note": 2 - saves}
    assert ours == _expected_runs(choice)


def test_a_list_of_ops_saves_effectful_ops_too() -> None:
    """With a list of ops to save, effectful ops outside it are saved, not recomputed."""
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, [aten.mm.default]
    )
    runs, _ = _runs_per_backward(checkpoint, _effects, context_fn)
    assert runs == {"tick": 1, "note": 1}


def _pure(x: torch.Tensor) -> torch.Tensor:
    return pure_tick(x.sin()).cos()


def _writes_a_buffer(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros(())
    bump_(buffer)
    return x.sin() * buffer


def _collective(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * probe(x.detach())


@pytest.mark.parametrize("factory", sorted(CONTEXTS))
@pytest.mark.parametrize(
    ("function", "name"),
    [(_pure, "pure_tick"), (_writes_a_buffer, "bump_"), (_collective, "probe")],
    ids=["no-effect", "writes-an-argument", "c10d"],
)
def test_ops_outside_the_rule_are_recomputed(
    function: Callable[[torch.Tensor], torch.Tensor], name: str, factory: str
) -> None:
    """Ops without an effect, effectful ops writing an argument and c10d ops run again."""
    context_fn = functools.partial(
        CONTEXTS[factory], _policy_for_all(CheckpointPolicy.PREFER_RECOMPUTE)
    )
    ours, our_grads = _runs_per_backward(checkpoint, function, context_fn, early_stop=False)
    assert ours == {name: 2}
    torchs, torch_grads = _runs_per_backward(
        torch_checkpoint.checkpoint, function, context_fn, early_stop=False
    )
    assert torchs == ours
    assert_same(our_grads, torch_grads)


def _torch_rule() -> Callable[[Any], bool]:
    """The rule of the installed torch: its predicate from 2.15 on, its registry query before."""
    if TORCH_SAVES_EFFECTS:
        predicate: Callable[[Any], bool] = torch_checkpoint._is_cacheable_effect
        return predicate
    from torch._higher_order_ops.effects import has_effects

    # torch registers aten::_linalg_check_errors from 2.13 on, and 2.15 saves it.
    check_errors = aten._linalg_check_errors.default
    return lambda op: (op is check_errors or has_effects(op)) and op.namespace != "c10d"


def _every_op() -> list[Any]:
    ops = [tick._opoverload, note._opoverload, pure_tick._opoverload, bump_._opoverload, probe]
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace in ("aten", "prim", "c10d", "_c10d_functional", "profiler"):
            packet = getattr(getattr(torch.ops, namespace), op_name.split(".")[0], None)
            overload = op_name.partition(".")[2] or "default"
            op = getattr(packet, overload, None) if packet is not None else None
            if isinstance(op, torch._ops.OpOverload):
                ops.append(op)
    return ops


def test_the_rule_matches_torchs_on_every_op() -> None:
    """The rule answers as the installed torch's on every op, also from its cache."""
    torchs = _torch_rule()
    ops = _every_op()
    assert len(ops) > 1000
    for _ in range(2):
        assert [op for op in ops if torch_compat.is_cacheable_effect(op) != torchs(op)] == []
    assert {str(op) for op in ops if torchs(op)} >= {"aten._print.default", str(tick._opoverload)}


def test_an_effect_registered_later_counts() -> None:
    """An op asked about before its effect is registered counts once it is, and not after."""
    with torch.library._scoped_library("tensorhooks_later", "FRAGMENT") as library:
        library.define("step(Tensor x) -> Tensor")
        op = torch.ops.tensorhooks_later.step.default
        assert not torch_compat.is_cacheable_effect(op)
        library._register_effectful_op("tensorhooks_later::step", EffectType.ORDERED)
        assert torch_compat.is_cacheable_effect(op)
    assert not torch_compat.is_cacheable_effect(op)


@pytest.mark.parametrize(
    ("op", "saved"),
    [
        (aten._print.default, True),
        (aten._linalg_check_errors.default, True),
        (tick._opoverload, True),
        (note._opoverload, True),
        (pure_tick._opoverload, False),
        (bump_._opoverload, False),
        (probe, False),
        (aten.mm.default, False),
    ],
    ids=str,
)
def test_which_ops_count(op: Any, saved: bool) -> None:
    """Registered effects on non-aliasing ops outside c10d count, on every release."""
    assert torch_compat.is_cacheable_effect(op) is saved


def test_aten_print_prints_once(capfd: pytest.CaptureFixture[str]) -> None:
    """aten._print in a region prints once per step, also when it is recomputed."""

    def printing(x: torch.Tensor) -> torch.Tensor:
        torch.ops.aten._print("tensorhooks-effect-print")
        return x.sin().cos()

    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts,
        _policy_for_all(CheckpointPolicy.PREFER_RECOMPUTE),
    )
    x = input_tensor()
    out = checkpoint(printing, x, context_fn=context_fn, use_reentrant=False, early_stop=False)
    out.sum().backward()
    assert capfd.readouterr().out.count("tensorhooks-effect-print") == 1


def test_effects_save_under_torch_compile() -> None:
    """Under torch.compile, tensorhooks' contexts save effectful ops too (torch 2.13 would fail)."""
    context_fn = functools.partial(
        tensorhooks.create_selective_checkpoint_contexts,
        _policy_for_all(CheckpointPolicy.PREFER_RECOMPUTE),
    )
    w, _ = weights()
    x = input_tensor()

    def step(a: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda h: _effects(h @ w), a, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    RUNS.clear()
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    got = torch.autograd.grad(out.sum(), [x, w])
    assert RUNS["tick"] == 1
    RUNS.clear()
    assert_same(list(got), grads(lambda: _effects(x @ w), [x, w]))


def _written_after_save(x: torch.Tensor) -> torch.Tensor:
    scores = tick(x.sin())
    scores.mul_(0.5)  # after tick's output was saved; nothing autograd saved is written
    return scores.softmax(-1).sum()


def _selective(choice: Any, allow_mutation: bool = False) -> Any:
    return functools.partial(
        tensorhooks.create_selective_checkpoint_contexts, _policy_for_all(choice), allow_mutation
    )


def test_saved_effect_output_written_in_place_raises_naming_must_recompute() -> None:
    """An effectful op's saved output written in place raises, naming the op and MUST_RECOMPUTE."""
    x = input_tensor()
    out = checkpoint(
        _written_after_save,
        x,
        use_reentrant=False,
        context_fn=_selective(CheckpointPolicy.PREFER_RECOMPUTE),
    )
    with pytest.raises(
        tensorhooks.SavedTensorModifiedError,
        match=r"tensorhooks_effects.tick.default \(call 0\).*ordered side effect \(the policy "
        r"returned PREFER_RECOMPUTE\).*return MUST_RECOMPUTE for this op",
    ):
        out.backward()


def test_saved_effect_output_written_in_place_under_allow_mutation() -> None:
    """Under allow_mutation_on_saved_tensors the effectful op's saved value is used, run once."""
    x = input_tensor()
    expected = torch.autograd.grad(_written_after_save(x), [x])
    RUNS.clear()
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = checkpoint(
            _written_after_save,
            x,
            use_reentrant=False,
            context_fn=_selective(CheckpointPolicy.PREFER_RECOMPUTE),
        )
        got = torch.autograd.grad(out, [x])
    assert RUNS["tick"] == 1
    assert_same(got, expected)


def test_allow_cache_entry_mutation_runs_a_written_effect_again() -> None:
    """With allow_cache_entry_mutation=True a written saved output is recomputed, effect too."""
    x = input_tensor()
    expected = torch.autograd.grad(_written_after_save(x), [x])
    RUNS.clear()
    out = checkpoint(
        _written_after_save,
        x,
        use_reentrant=False,
        context_fn=_selective(CheckpointPolicy.PREFER_RECOMPUTE, allow_mutation=True),
    )
    assert_same(torch.autograd.grad(out, [x]), expected)
    assert RUNS["tick"] == 2


def test_second_backward_repeats_no_effect_without_tensors() -> None:
    """On a retained graph's second backward, note (no output) stays saved; tick runs again."""
    context_fn = _selective(CheckpointPolicy.PREFER_RECOMPUTE)
    w, _ = weights()
    x = input_tensor()
    loss = checkpoint(lambda a: _effects(a @ w), x, use_reentrant=False, context_fn=context_fn)
    loss = loss.sum()
    expected = grads(lambda: _effects(x @ w), [x, w])
    RUNS.clear()
    runs = []
    for retain in (True, False):
        got = torch.autograd.grad(loss, [x, w], retain_graph=retain)
        runs.append(dict(RUNS))
        assert_same(got, expected)
    assert runs == [{}, {"tick": 1}]


@pytest.mark.parametrize("early_stop", [True, False])
def test_saved_effect_outputs_die_after_backward(early_stop: bool) -> None:
    """The outputs saved for their effects, like every tensor of the region, die after backward."""
    made: list[weakref.ref[torch.Tensor]] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                made.append(weakref.ref(out))
            return out

    context_fn = _selective(CheckpointPolicy.PREFER_RECOMPUTE)
    w, _ = weights()
    for _ in range(2):
        x = input_tensor()
        with Spy():
            out = checkpoint(
                lambda a: _effects(a @ w) + tick(a).sum(),
                x,
                use_reentrant=False,
                context_fn=context_fn,
                early_stop=early_stop,
            )
            torch.autograd.grad(out.sum(), [x, w])
        del out, x
    gc.collect()
    assert made
    assert [ref() for ref in made if ref() is not None] == []


STEPS = ("sin", "tick", "note", "pure_tick", "mm")


def _program(steps: list[str], w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(h: torch.Tensor) -> torch.Tensor:
        h = h @ w
        for step in steps:
            if step == "sin":
                h = h.sin()
            elif step == "tick":
                h = tick(h)
            elif step == "note":
                note(h)
            elif step == "pure_tick":
                h = pure_tick(h)
            else:
                h = h @ w
        return h.tanh()

    return run


def _policy_by_op(choices: dict[str, Any]) -> Callable[..., Any]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return choices.get(op._opname, CheckpointPolicy.PREFER_RECOMPUTE)

    return policy


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=8),
    choices=st.dictionaries(
        st.sampled_from(["tick", "note", "pure_tick", "mm", "sin"]), st.sampled_from(EVERY_POLICY)
    ),
    factory=st.sampled_from(sorted(CONTEXTS)),
)
def test_programs_run_each_effect_once(
    steps: list[str], choices: dict[str, Any], factory: str
) -> None:
    """Over random programs and policies: effects run once unless MUST_RECOMPUTE; same grads."""
    w, _ = weights()
    function = _program(steps, w)
    context_fn = functools.partial(CONTEXTS[factory], _policy_by_op(choices))
    x = input_tensor()
    expected = grads(lambda: function(x), [x, w])
    RUNS.clear()
    out = checkpoint(function, x, use_reentrant=False, context_fn=context_fn, early_stop=False)
    got = torch.autograd.grad(out.sum(), [x, w])
    ours = {name: RUNS[name] for name in ("tick", "note")}
    assert_same(list(got), expected)
    for name, runs in ours.items():
        again = choices.get(name) is CheckpointPolicy.MUST_RECOMPUTE
        assert runs == steps.count(name) * (1 + again)
    if TORCH_SAVES_EFFECTS:  # (torch recomputes pure_tick under an offload policy: not compared)
        RUNS.clear()
        out = torch_checkpoint.checkpoint(
            function, x, use_reentrant=False, context_fn=context_fn, early_stop=False
        )
        torch.autograd.grad(out.sum(), [x, w])
        assert {name: RUNS[name] for name in ours} == ours
