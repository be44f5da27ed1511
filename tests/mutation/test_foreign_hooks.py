"""allow_mutation_on_saved_tensors with saved-tensor hooks that tensorhooks did not install."""

from __future__ import annotations

import gc
import threading
import types
from collections.abc import Callable

import pytest
import torch
import torch.autograd.graph as torch_graph
import torch.utils.checkpoint

import tensorhooks
from tensorhooks._core import guards as _guards
from tests.mutation.programs import grad_under, leaf_4x6

pytestmark = pytest.mark.usefixtures("no_open_contexts")


def test_torch_hooks_inside_make_writes_raise() -> None:
    """What torch's hooks saved before the takeover: a write to it raises, not a wrong grad."""
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        with torch_graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = (b**2).sum()
            with pytest.raises(
                tensorhooks.UnguardedHooksError,
                match=r"in-place operator aten\.mul_\.Tensor writes a tensor that "
                r"saved-tensor hooks not pushed by tensorhooks \(pack hook '.*<lambda>'\)",
            ):
                b.mul_(2.0)
        with torch_graph.save_on_cpu(), pytest.raises(RuntimeError, match="save_on_cpu"):
            b.add_(1.0)
        out.backward()
    torch.testing.assert_close(a.grad, 2 * leaf_4x6())


def test_trust_comes_from_the_registry_not_the_code() -> None:
    """A pack hook is trusted once registered; a copy of a trusted one's code is not."""
    guarded_pack, _ = _guards.VersionGuard().wrap(lambda t: t, lambda t: t)
    assert _guards.is_protected_pack_hook(guarded_pack)
    same_code = types.FunctionType(
        guarded_pack.__code__,
        guarded_pack.__globals__,  # type: ignore[attr-defined]
        "pack",
        None,
        guarded_pack.__closure__,  # type: ignore[attr-defined]
    )
    assert not _guards.is_protected_pack_hook(same_code)

    def stores_nothing(tensor: torch.Tensor) -> None:
        return None

    _guards.register_protected_pack_hook(stores_nothing)
    a = leaf_4x6().requires_grad_()
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        with torch_graph.saved_tensors_hooks(stores_nothing, lambda p: p):
            b.mul_(2.0)  # trusted: no raise
        with torch_graph.saved_tensors_hooks(same_code, lambda p: p):
            _ = b * b  # saved by the copy before the context sees it
            with pytest.raises(
                tensorhooks.UnguardedHooksError, match=r"pack hook 'VersionGuard\.wrap\."
            ):
                b.mul_(2.0)
    torch.testing.assert_close(b.detach(), 2 * leaf_4x6())  # the refused write never ran


def test_registry_keeps_no_hook_alive() -> None:
    """A registered pack hook that is dropped leaves the registry."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    gc.collect()
    before = len(_guards._protected_pack_hooks)
    _guards.register_protected_pack_hook(pack)
    assert len(_guards._protected_pack_hooks) == before + 1
    del pack
    assert len(_guards._protected_pack_hooks) == before


def test_checkpoint_inside_is_allowed() -> None:
    """torch.utils.checkpoint (non-reentrant) stores no tensor data: writes are fine."""

    def block(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        y.mul_(2.0)  # in-place inside the checkpointed region, also during recomputation
        return y.cos()

    def program(a: torch.Tensor) -> torch.Tensor:
        b = a * 1
        out = torch.utils.checkpoint.checkpoint(block, b, use_reentrant=False).sum()
        b.mul_(3.0)  # the checkpoint's saved input, changed before backward
        return out  # type: ignore[no-any-return]

    expected = grad_under(None, lambda a: block(a * 1).sum(), leaf_4x6())
    got = grad_under(tensorhooks.allow_mutation_on_saved_tensors, program, leaf_4x6())
    torch.testing.assert_close(got, expected)


# --- what torch's hooks saved before the takeover -------------------------------------------------


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def test_fresh_write_under_torch_save_on_cpu_is_allowed() -> None:
    """A write into a tensor nothing saved (T5's ``scores += bias``) runs; grads are right."""
    q = torch.randn(3, 4, requires_grad=True)
    bias = torch.randn(3, 3)

    def program(q: torch.Tensor) -> torch.Tensor:
        scores = q @ q.t()
        scores += bias  # matmul saved q, not scores
        return scores.softmax(-1).sum(0).pow(2).sum()

    expected = torch.autograd.grad(program(q), q)[0]
    with tensorhooks.allow_mutation_on_saved_tensors(), torch_graph.save_on_cpu():
        got = torch.autograd.grad(program(q), q)[0]
    torch.testing.assert_close(got, expected)


def test_fresh_writes_of_routing_code_under_foreign_hooks() -> None:
    """Division and index_put_ into fresh tensors (MoE routing) run under foreign hooks."""
    logits = torch.randn(5, 4, requires_grad=True)

    def program(logits: torch.Tensor) -> torch.Tensor:
        weights = logits.softmax(-1)
        top, chosen = weights.topk(2, dim=-1)
        top /= top.sum(-1, keepdim=True)  # topk's values: not saved
        mask = torch.zeros(5, 4)
        mask.index_put_((torch.arange(5), chosen[:, 0]), torch.ones(5))
        return (top.sum(-1) * mask.sum(-1)).pow(2).sum()

    expected = torch.autograd.grad(program(logits), logits)[0]
    with (
        tensorhooks.allow_mutation_on_saved_tensors(),
        torch_graph.saved_tensors_hooks(_identity, _identity),
    ):
        got = torch.autograd.grad(program(logits), logits)[0]
    torch.testing.assert_close(got, expected)


def test_write_to_a_tensor_saved_under_foreign_hooks_is_cloned() -> None:
    """A tensor saved under foreign hooks after the context took them over keeps its value."""
    a = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            c = b.sin()  # the first op under the pair: taken over here
            out = (c * c).sum()  # saves c through the taken-over pair
            c.mul_(10)
        out.backward()
    torch.testing.assert_close(a.grad, 2 * a.sin() * a.cos())


def test_write_to_a_tensor_the_foreign_pair_saved_before_takeover_raises() -> None:
    """What the foreign pair saved before the context saw it cannot be protected: raise."""
    a = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            out = (b * b).sum()  # mul saves b before the context sees the op
            with pytest.raises(
                tensorhooks.UnguardedHooksError,
                match=r"in-place operator aten\.mul_\.Tensor .* saved-tensor hooks",
            ):
                b.mul_(10)
        out.backward()
    torch.testing.assert_close(a.grad, 2 * a)


def test_write_after_foreign_pair_pushed_and_popped() -> None:
    """Saved under torch's hooks, the hooks popped, then written: never a wrong gradient."""
    a = torch.randn(4, requires_grad=True)

    def program(a: torch.Tensor) -> torch.Tensor:
        b = a * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            c = b.exp()  # exp saves its result c
            out = (c * b).sum()  # saves c and b
        c.mul_(3)  # written after the pair was popped
        return out

    expected = torch.autograd.grad(((a * 1).exp() * a).sum(), a)[0]
    with tensorhooks.allow_mutation_on_saved_tensors():
        out = program(a)
        got = torch.autograd.grad(out, a)[0]
    torch.testing.assert_close(got, expected)


def test_write_after_pop_into_window_tensor_raises() -> None:
    """A write after the pop into what the pair saved before the takeover raises."""
    a = torch.randn(4, requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = a * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            _ = (b * b).sum()
        with pytest.raises(tensorhooks.UnguardedHooksError):
            b.add_(1)


def _residual_block(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(h: torch.Tensor) -> torch.Tensor:
        n = h * w  # saves h, the checkpointed function's input
        h += n
        return h.sin()

    return block


def _recomputed_residual_block(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(h: torch.Tensor) -> torch.Tensor:
        h = h * 1
        n = h * w  # saves h, a tensor recomputation makes
        h += n
        return h.sin()

    return block


@pytest.mark.parametrize(
    "make_block",
    [_residual_block, _recomputed_residual_block],
    ids=["write_to_the_input", "write_to_a_recomputed_saved_tensor"],
)
def test_in_place_residual_inside_checkpoint(
    make_block: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
) -> None:
    """An in-place residual (h += f(h)) in torch's checkpoint: right gradient or raise."""
    x0 = torch.randn(4)

    def run(checkpointed: bool) -> torch.Tensor:
        w = torch.linspace(0.5, 1.5, 4, requires_grad=True)
        block = make_block(w)
        with tensorhooks.allow_mutation_on_saved_tensors():
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(block, x0 * w, use_reentrant=False)
            else:
                out = block(x0 * w)
            out.sum().backward()  # type: ignore[union-attr]
        assert w.grad is not None
        return w.grad

    expected = run(checkpointed=False)
    try:
        got = run(checkpointed=True)
    except RuntimeError as error:  # either outcome is allowed; a wrong gradient is not
        assert "modified by an inplace operation" in str(error) or isinstance(  # noqa: PT017 (right or raise)
            error, tensorhooks.UnguardedHooksError
        )
    else:
        torch.testing.assert_close(got, expected)


def test_checkpoint_parameters_can_be_written_after_backward() -> None:
    """Tensors recomputation saved are released with its backward: a later step writes them."""
    start = torch.randn(4)

    def train(ctx: tensorhooks.MutationContext | None) -> torch.Tensor:
        w = start.clone().requires_grad_()
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(2):
            out = torch.utils.checkpoint.checkpoint(
                lambda h: (h * w).sin(), torch.ones(4), use_reentrant=False
            )
            out.sum().backward()  # type: ignore[union-attr]
            if ctx is not None:
                assert ctx.num_saved() == 0, "backward left saved tensors held"
            opt.step()  # writes w, which recomputation saved
            opt.zero_grad()
        return w.detach()

    expected = train(None)
    with tensorhooks.allow_mutation_on_saved_tensors() as ctx:
        got = train(ctx)
        assert ctx.num_cloned() == 0  # nothing held was written: no clone was needed
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, start)


@pytest.mark.parametrize("consumed", [True, False], ids=["output_consumed", "output_backwarded"])
def test_write_from_a_thread_without_context_to_a_foreign_save_raises(consumed: bool) -> None:
    """A foreign save changed where the mode cannot see it raises in backward: no wrong grad."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = x * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            y = b * b
            if consumed:
                y = y.sum()
        writer = threading.Thread(target=lambda: b.mul_(10))
        writer.start()
        writer.join()
        with pytest.raises(
            tensorhooks.SavedTensorModifiedError,
            match=r"is at version 1; expected version 0 instead\. Hint: the tensor was saved in",
        ):
            y.backward(None if consumed else torch.ones(3))
    assert x.grad is None


def test_foreign_save_unchanged_from_other_thread_gives_plain_gradient() -> None:
    """With no write, tying foreign saves to their node leaves the gradient as plain autograd's."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with tensorhooks.allow_mutation_on_saved_tensors():
        b = x * 1
        with torch_graph.saved_tensors_hooks(_identity, _identity):
            y = (b * b).sum()
        y.backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0, 6.0]))  # type: ignore[arg-type]
