"""The rank side of test_fsdp2.py: drawn models and feature combinations under FSDP2 and DDP.

Run by `tests.distributed.torchrun.launch`; every rank draws the same cases from one seed, trains
each model sharded (or replicated) on its part of the batch, and reports how far the gradients
are from one process training a copy on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

import tensorhooks as th

from .torchrun import cpu_mesh, full_grads, max_difference, run_rank

CASES = 21  # drawn FSDP2 cases per run; each costs a few hundred milliseconds
DDP_CASES = 6
BATCH_PER_RANK = 3
CHECKPOINTS = (None, "full", "save_matmuls", "offload_matmuls")
CONTEXTS = (None, "save_on_cpu", "mutation", "disable_hooks")
SHARDINGS = ("blocks", "blocks_kept_after_forward", "blocks_on_dim_1", "root_only")
# plan_activations' budget, from the least peak any plan reaches (0) to the unplanned peak (1).
PLAN_BUDGETS = (0.0, 0.5, 1.0)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu_": torch.relu_,  # in place, on a tensor `up` did not save
    "relu": torch.relu,
    "tanh": torch.tanh,
    "gelu": nn.functional.gelu,
}
ACTIVATIONS = tuple(_ACTIVATIONS)
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


@dataclass(frozen=True)
class Case:
    """One drawn model and the features it trains under."""

    seed: int
    blocks: int
    width: int
    hidden: int
    activation: str
    norm: bool
    writes_saved: bool  # the block changes a tensor it saved (needs the mutation context)
    checkpoint: str | None
    checkpoint_outside: bool  # the parent checkpoints the sharded block, not its body
    context: str | None
    grad_of_input: bool  # torch.autograd.grad over the input instead of .backward()
    # Which modules fully_shard is applied to: each block and the root, the blocks without
    # freeing their weights after forward or with their matrices sharded on dimension 1 (FSDP2
    # gathers those through another copy), or the root alone (one unit for the whole model).
    sharding: str = "blocks"
    # The blocks run under plan_activations at this budget (see PLAN_BUDGETS), with no
    # checkpoint or context of their own; None: no plan.
    plan: float | None = None


def draw_case(rng: random.Random) -> Case:
    """A random case; combinations that one process refuses too are not drawn."""
    plan = rng.choice(PLAN_BUDGETS) if rng.random() < 0.25 else None
    context = None if plan is not None else rng.choice(CONTEXTS)
    checkpoint = None if context == "disable_hooks" or plan is not None else rng.choice(CHECKPOINTS)
    sharding = rng.choice(SHARDINGS)
    # FSDP2 needs dimension 1 to split evenly over the ranks (two here).
    widths, hiddens = (
        ((6, 8), (12,)) if sharding == "blocks_on_dim_1" else ((5, 6, 7, 8), (7, 9, 12))
    )
    activation = rng.choice(ACTIVATIONS)
    if activation == "relu_" and (checkpoint in ("save_matmuls", "offload_matmuls") or plan):
        activation = "relu"  # it would write a matmul output the policy keeps: raises
    return Case(
        seed=rng.randrange(2**16),
        blocks=rng.randint(2, 4),
        # Odd sizes shard unevenly over two ranks: FSDP2 pads the last shard.
        width=rng.choice(widths),
        hidden=rng.choice(hiddens),
        activation=activation,
        norm=rng.random() < 0.4,
        writes_saved=context == "mutation" and rng.random() < 0.7,
        checkpoint=checkpoint,
        checkpoint_outside=checkpoint is not None and rng.random() < 0.5,
        context=context,
        grad_of_input=plan is None and rng.random() < 0.25,
        sharding=sharding,
        plan=plan,
    )


def _policy(offload: bool, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> th.CheckpointPolicy:
    if op in _MATMULS:
        return th.CheckpointPolicy.MUST_CPU_OFFLOAD if offload else th.CheckpointPolicy.MUST_SAVE
    return th.CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(kind: str | None, function: Callable[..., Any], x: torch.Tensor) -> Any:
    """``function(x)``, under tensorhooks' checkpoint of ``kind`` (None: not checkpointed)."""
    if kind is None:
        return function(x)
    if kind == "full":
        return th.checkpoint(function, x, use_reentrant=False)
    context_fn = functools.partial(
        th.create_selective_checkpoint_contexts,
        functools.partial(_policy, kind == "offload_matmuls"),
    )
    return th.checkpoint(function, x, context_fn=context_fn, use_reentrant=False)


class Block(nn.Module):
    """A residual MLP block; optionally checkpoints its own body."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.up = nn.Linear(case.width, case.hidden)
        self.down = nn.Linear(case.hidden, case.width)
        self.norm = nn.LayerNorm(case.width) if case.norm else nn.Identity()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = _ACTIVATIONS[self.case.activation](h)
        y = self.down(h)
        if self.case.writes_saved:
            h.mul_(0.5)  # `down` saved h: backward must see the value before this write
            y = y + h.sum(-1, keepdim=True)
        return x + y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.case.checkpoint_outside:
            return self.body(x)
        return checkpointed(self.case.checkpoint, self.body, x)


class Net(nn.Module):
    """Blocks, then a head; checkpoints each (sharded) block from outside when asked."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.blocks = nn.ModuleList(Block(case) for _ in range(case.blocks))
        self.head = nn.Linear(case.width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.case.checkpoint_outside:
                x = checkpointed(self.case.checkpoint, block, x)
            else:
                x = block(x)
        return self.head(x)


@contextlib.contextmanager
def feature_context(case: Case) -> Iterator[None]:
    """The context the forward (and backward) pass of ``case`` runs in."""
    if case.context == "save_on_cpu":
        with th.save_on_cpu(min_offload_bytes=0):
            yield
    elif case.context == "mutation":
        with th.allow_mutation_on_saved_tensors():
            yield
    elif case.context == "disable_hooks":
        with th.disable_saved_tensors_hooks("saved-tensor hooks are disabled here"):
            yield
    else:
        yield


def batch(case: Case, step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed * 10 + step)
    return torch.randn(BATCH_PER_RANK * world, case.width, dtype=torch.float64, generator=generator)


def planned(model: nn.Module, case: Case, x: torch.Tensor) -> th.ActivationPlan:
    """``model``'s blocks planned for a step on ``x`` at ``case.plan``; a collective under FSDP2.

    The budget lies ``case.plan`` of the way from the least peak any plan reaches to the unplanned.
    """
    assert case.plan is not None
    blocks = list(model.blocks)  # type: ignore[arg-type]  # a ModuleList

    def step() -> None:
        model(x).pow(2).mean().backward()

    profile = th.profile_step(model, step, blocks=blocks, rounds=1)
    unplanned = th.plan_activations(model, step, 1.0, blocks=blocks, profile=profile)
    least, most = unplanned.least_peak_bytes, unplanned.budget_bytes
    return th.plan_activations(
        model, step, least + round(case.plan * (most - least)), blocks=blocks, profile=profile
    )


def train(
    model: nn.Module, case: Case, xs: list[torch.Tensor], plan: th.ActivationPlan | None = None
) -> tuple[list[list[torch.Tensor | None]], list[torch.Tensor]]:
    """Two steps of SGD; the gradients after each backward, and the input gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, input_grads = [], []
    for batch_x in xs:
        x = batch_x.clone().requires_grad_(case.grad_of_input)
        with feature_context(case), plan if plan is not None else contextlib.nullcontext():
            loss = model(x).pow(2).mean()
            if case.grad_of_input:
                (grad,) = torch.autograd.grad(loss, [x], retain_graph=True)
                input_grads.append(grad)
            loss.backward()
        grads.append(full_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, input_grads


def _compare(
    got: tuple[list[list[Any]], list[torch.Tensor]],
    expected: tuple[list[list[Any]], list[torch.Tensor]],
    rank: int,
    world: int,
) -> dict[str, float]:
    report = {"max_diff": 0.0, "none_mismatch": 0, "max_grad": 0.0}
    for mine, theirs in zip(got[0], expected[0], strict=True):
        diff, mismatched, largest = max_difference(mine, theirs)
        report["max_diff"] = max(report["max_diff"], diff)
        report["none_mismatch"] += mismatched
        report["max_grad"] = max(report["max_grad"], largest)
    for mine, theirs in zip(got[1], expected[1], strict=True):
        # Each rank holds the gradient of its own rows; the whole-batch loss is the mean of the
        # ranks' losses, so the reference's rows are 1/world of this rank's.
        rows = theirs.chunk(world)[rank] * world
        report["max_diff"] = max(report["max_diff"], (mine - rows).abs().max().item())
    return report


def _on_dim_1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


def fsdp2_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Train ``case`` sharded by FSDP2 as it says and in one process."""
    torch.manual_seed(case.seed)
    reference = Net(case).double()
    model = copy.deepcopy(reference)
    mesh = cpu_mesh()
    if case.sharding != "root_only":
        reshard = case.sharding != "blocks_kept_after_forward"
        placement = _on_dim_1 if case.sharding == "blocks_on_dim_1" else None
        for block in model.blocks:
            fully_shard(
                block, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=placement
            )
    fully_shard(model, mesh=mesh)
    xs = [batch(case, step, world) for step in range(2)]
    expected = train(reference, case, xs)
    local = [x.chunk(world)[rank] for x in xs]
    plan = None if case.plan is None else planned(model, case, local[0])
    got = train(model, case, local, plan)
    return {**asdict(case), **_compare(got, expected, rank, world), **_peak(plan)}


def _peak(plan: th.ActivationPlan | None) -> dict[str, int | None]:
    """What the plan's blocks held for backward at most over training, and its budget."""
    if plan is None:
        return {"measured": None, "budget": None}
    return {"measured": plan.measured_peak_bytes, "budget": plan.budget_bytes}


def ddp_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Train ``case`` replicated by DistributedDataParallel and in one process."""
    torch.manual_seed(case.seed)
    reference = Net(case).double()
    model = DistributedDataParallel(copy.deepcopy(reference))
    xs = [batch(case, step, world) for step in range(2)]
    expected = train(reference, case, xs)
    local = [x.chunk(world)[rank] for x in xs]
    plan = None if case.plan is None else planned(model.module, case, local[0])
    got = train(model, case, local, plan)
    return {**asdict(case), **_compare(got, expected, rank, world), **_peak(plan)}


def transformers_case(context: str | None, rank: int, world: int) -> dict[str, Any]:
    """docs/scaling-out.md's recipe: a small GPT-2 whose blocks are checkpointed and sharded.

    Called with a padding mask and ``use_cache=True``, where checkpointing a block's forward by
    hand writes the KV cache again in recomputation.
    """
    from transformers import GPT2Config, GPT2LMHeadModel  # a slow import, for these cases only

    from tensorhooks.integrations.transformers import checkpoint_layers

    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, n_positions=8, vocab_size=40,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).double()
    model = copy.deepcopy(reference)
    mesh = cpu_mesh()
    # The recipe: the layers on tensorhooks' checkpoint, each block sharded, then the root.
    checkpoint_layers(model)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    case = Case(0, 2, 16, 16, "gelu", True, False, "full", False, context, False)
    ids = torch.randint(0, 40, (2 * world, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[:, :2] = 0  # left padding
    got_grads = []
    expected_grads = []
    for net, batch_ids, batch_mask, grads in (
        (reference, ids, mask, expected_grads),
        (model, ids.chunk(world)[rank], mask.chunk(world)[rank], got_grads),
    ):
        with feature_context(case):
            output = net(
                input_ids=batch_ids, attention_mask=batch_mask, labels=batch_ids, use_cache=True
            )
            output.loss.backward()
        grads.append(full_grads(net))
    return {"context": context, **_compare((got_grads, []), (expected_grads, []), rank, world)}


def cases(rank: int, world: int) -> dict[str, Any]:
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    return {
        "fsdp2": [fsdp2_case(draw_case(rng), rank, world) for _ in range(CASES)],
        "ddp": [ddp_case(draw_case(rng), rank, world) for _ in range(DDP_CASES)],
        # transformers is not a test dependency: the recipe is checked where it is installed.
        "transformers": [transformers_case(context, rank, world) for context in (None, "mutation")]
        if importlib.util.find_spec("transformers")
        else None,
    }


if __name__ == "__main__":
    run_rank(cases)
