"""offload_parameters on one GPU, against the resident model, FSDP2's CPU offload and fairscale.

A stack of pre-norm blocks with causal flash attention, fp32 weights, bf16 autocast, trained one
fwd+bwd+AdamW step at a time (AdamW's fused kernel in every setting: on the device for the
resident model, on the host for the offloaded ones) under each setting that can run here:

- ``resident``: the model and its AdamW state on the device;
- ``tensorhooks``: ``tensorhooks.offload_parameters(model, prefetch=1)``, AdamW on the host;
- ``fsdp2``: ``fully_shard(block, mesh=..., offload_policy=CPUOffloadPolicy())`` on every block
  and on the root, over a process group of one process (NCCL, world size 1), AdamW on the host;
- ``fairscale``: fairscale's ``OffloadModel`` with one slice per block, when fairscale can be
  imported (it is not installed on the GPU machine: carry its wheel, see docs/performance.md);
  otherwise skipped with the reason.

Recorded, in this order: each setting's gradients of one step at the initial weights against
the resident model's; peak device memory of a training step (absolute, and above the memory
before it); step time of the training step and of fwd+bwd alone, in interleaved rounds (CUDA
events, which include the host's optimizer time); and the targets: the offloaded step's peak
above its start at most the two largest blocks' parameters plus the activations its forward
keeps (measured in the same setting), and a step faster than FSDP2's CPU offload (and than
fairscale's, when it ran).

Size on the GPU: 6 blocks, d=2048, 16 heads, sequence 1024, batch 4: 201 MiB of fp32
parameters per block, 1.2 GiB in all. A dry run uses 2 blocks of d=64 on the CPU, with a
host-clone stand-in for the device copies and gloo for FSDP2's process group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from harness import FusedAttentionBlock, Timings
from torch import nn

import tensorhooks

from . import common
from .common import GiB, MiB, attempt, gradient_row, mib, peak_above
from .record import FAILED, OK, Recorder, evaluate

PART = "offload_parameters"
FAIRSCALE_HINT = "carry fairscale as a wheel to measure it (docs/performance.md)"


@dataclass(frozen=True)
class Size:
    """The stack, its batch, and how long to time it."""

    blocks: int
    d: int
    seq: int
    batch: int
    rounds: int

    @property
    def heads(self) -> int:
        return max(1, self.d // 128)

    def describe(self) -> str:
        return (
            f"{self.blocks} blocks, d={self.d}, {self.heads} heads, sequence {self.seq}, batch "
            f"{self.batch}, fp32 weights, bf16 autocast, fused AdamW"
        )


GPU_SIZE = Size(blocks=6, d=2048, seq=1024, batch=4, rounds=3)
DRY_SIZE = Size(blocks=2, d=64, seq=16, batch=2, rounds=2)


class Skipped(Exception):  # noqa: N818 (a reason to leave a setting out, not an error)
    """A setting that cannot run here, for a stated reason (not a failure)."""


class HostCloneTransfer:
    """A `tensorhooks.ParameterTransfer` without a device, for dry runs: copies are CPU clones."""

    device = torch.device("cpu")

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        return host.clone(), None

    def wait(self, tensor: torch.Tensor, token: object) -> None:
        pass

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor.detach().clone(), None

    def synchronize(self, token: object) -> None:
        pass


@dataclass
class Setting:
    """A model ready to train, its optimizer, and what its builder says about it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    note: str = ""


def build_base(size: Size) -> tuple[nn.Sequential, list[int]]:
    """The seeded stack on the host, and each block's parameter bytes, largest first."""
    torch.manual_seed(0)
    model = nn.Sequential(*(FusedAttentionBlock(size.d, size.heads) for _ in range(size.blocks)))
    sizes = sorted(
        (sum(p.numel() * p.element_size() for p in block.parameters()) for block in model),
        reverse=True,
    )
    return model, sizes


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every setting: AdamW's fused kernel, on the device or on the host.

    Fused, so that the host's step (every offloaded setting updates host tensors) is one pass
    over the parameters rather than several, and the steps compare the streaming more than
    the optimizer's loop; FSDP2's sharded DTensors take the fused kernel too.
    """
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def resident(base: nn.Sequential, ctx: Any) -> Setting:
    model = copy.deepcopy(base).to(ctx.device)
    return Setting(model, adamw(model))


def offloaded(base: nn.Sequential, ctx: Any) -> Setting:
    model = copy.deepcopy(base)
    if ctx.dry_run:
        tensorhooks.offload_parameters(model, prefetch=1, transfer=HostCloneTransfer())
    else:
        tensorhooks.offload_parameters(model, device="cuda", prefetch=1)
    return Setting(model, adamw(model), "prefetch=1")


def fsdp2(base: nn.Sequential, ctx: Any) -> Setting:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: PLC0415

    backend = common.init_single_process_group(ctx.device, ctx.scratch)
    mesh = init_device_mesh(ctx.device, (1,))
    policy = CPUOffloadPolicy(pin_memory=not ctx.dry_run)
    model = copy.deepcopy(base)
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return Setting(model, adamw(model), f"{backend}, world size 1")


def fairscale(base: nn.Sequential, ctx: Any) -> Setting:
    try:
        from fairscale.experimental.nn.offload import OffloadModel  # noqa: PLC0415
    except ImportError as error:
        raise Skipped(f"fairscale cannot be imported ({error}); {FAIRSCALE_HINT}") from error
    if ctx.dry_run:
        raise Skipped("fairscale's OffloadModel needs a CUDA device")
    model = OffloadModel(
        copy.deepcopy(base),
        device=torch.device("cuda"),
        offload_device=torch.device("cpu"),
        num_slices=len(base),
        checkpoint_activation=False,
    )
    return Setting(model, adamw(model), "one slice per block")


BUILDERS: dict[str, Callable[[nn.Sequential, Any], Setting]] = {
    "resident": resident,
    "tensorhooks": offloaded,
    "fsdp2": fsdp2,
    "fairscale": fairscale,
}


def forward_backward(setting: Setting, x: torch.Tensor) -> Callable[[], None]:
    """One fwd+bwd; the gradients are dropped after it."""

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = setting.model(x).float().square().mean()
        loss.backward()
        for param in setting.model.parameters():
            param.grad = None

    return step


def train_step(setting: Setting, x: torch.Tensor) -> Callable[[], None]:
    """One fwd+bwd+AdamW step."""

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = setting.model(x).float().square().mean()
        loss.backward()
        setting.optimizer.step()
        setting.optimizer.zero_grad(set_to_none=True)

    return step


def gradients(setting: Setting, x: torch.Tensor) -> list[torch.Tensor]:
    """The ``.grad`` of every parameter after one fwd+bwd (plain tensors; DTensors made local)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = setting.model(x).float().square().mean()
    loss.backward()
    grads = []
    for param in setting.model.parameters():
        grad = param.grad
        assert grad is not None, "a parameter got no gradient"
        grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
        param.grad = None
    return grads


def forward_keeps(setting: Setting, x: torch.Tensor, device: str) -> int | None:
    """Device bytes a forward keeps until backward (activations, output); None on the CPU."""
    before = common.allocated(device)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = setting.model(x).float().square().mean()
    after = common.allocated(device)
    loss.backward()
    for param in setting.model.parameters():
        param.grad = None
    return None if before is None or after is None else after - before


def held_on_device(setting: Setting, device: str) -> int | None:
    """Bytes of the setting's parameters, buffers and optimizer state on the device (not CPU)."""
    if device != "cuda":
        return None
    tensors = [*setting.model.parameters(), *setting.model.buffers()]
    for state in setting.optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type == "cuda":
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(rec: Recorder, ctx: Any) -> None:
    """Measure, record the tables, evaluate the targets."""
    size = DRY_SIZE if ctx.dry_run else GPU_SIZE
    base, block_bytes = build_base(size)
    two_blocks = sum(block_bytes[:2])
    rec.note(
        f"{size.describe()}: {sum(block_bytes) / MiB:,.0f} MiB of parameters, the two largest "
        f"blocks {two_blocks / MiB:,.0f} MiB."
    )
    x = torch.randn(size.batch, size.seq, size.d, device=ctx.device)
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}
    built: dict[str, Setting] = {}
    for name, builder in BUILDERS.items():
        setting = _build(name, builder, base, ctx, skipped=skipped, errors=errors)
        if setting is not None:
            built[name] = setting
    del base
    attempt("gradients", errors, lambda: _gradients(rec, built, x, errors))
    steps = {name: train_step(setting, x) for name, setting in built.items()}
    peaks = _peaks(rec, device=ctx.device, built=built, steps=steps, x=x, errors=errors)
    for name in errors:
        steps.pop(name, None)
    # fairscale is a peer measured when it works here, not code of ours: its failures are a
    # reason it was left out, not a failure of this part.
    for name in [name for name in errors if name.startswith("fairscale")]:
        skipped[name] = f"raised {errors.pop(name)}"
    timings = common.timed_rounds(steps, rounds=size.rounds, inner=1, device=ctx.device)
    _time_table(rec, "fwd+bwd+AdamW", timings)
    _targets(rec, peaks, two_blocks, timings, skipped)
    # fwd+bwd alone, without the host's optimizer step, when there is time left for it.
    longest = max((timings.median(name) for name in steps), default=0.0)
    if steps and ctx.seconds_left() > 3 * longest * len(steps) + 10:
        passes = {name: forward_backward(built[name], x) for name in steps}
        _time_table(
            rec,
            "fwd+bwd",
            common.timed_rounds(passes, rounds=size.rounds, inner=2, device=ctx.device),
        )
    rows = [[name, "skipped", reason] for name, reason in skipped.items()]
    rows += [[name, "failed", error] for name, error in errors.items()]
    if rows:
        rec.table("Settings that did not run", ["setting", "what happened", "why"], rows)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # FSDP2's, closed before the process ends
    if errors:
        rec.finish(FAILED, reason="failed: " + ", ".join(errors))
    else:
        rec.finish(OK)


def _build(
    name: str,
    builder: Callable[[nn.Sequential, Any], Setting],
    base: nn.Sequential,
    ctx: Any,
    *,
    skipped: dict[str, str],
    errors: dict[str, str],
) -> Setting | None:
    """Build one setting; a skip or a failure is kept with its reason, and None returned."""
    try:
        return builder(base, ctx)
    except Skipped as reason:
        skipped[name] = str(reason)
    except Exception as error:  # recorded beside the settings that ran
        common.record_failure(name, errors, error)
    return None


def _gradients(
    rec: Recorder, built: dict[str, Setting], x: torch.Tensor, errors: dict[str, str]
) -> None:
    if "resident" not in built:
        return
    reference = gradients(built["resident"], x)
    noise = common.max_difference(gradients(built["resident"], x), reference)
    rows = []
    for name, setting in built.items():
        if name == "resident":
            continue
        got = attempt(name, errors, lambda s=setting: gradients(s, x))
        if got is not None:
            rows.append(gradient_row(name, got, reference, noise)[0])
    rec.table(
        "Gradients of one step at the initial weights, against the resident model's",
        common.GRADIENT_COLUMNS,
        rows,
    )


def _peaks(
    rec: Recorder,
    *,
    device: str,
    built: dict[str, Setting],
    steps: dict[str, Callable[[], None]],
    x: torch.Tensor,
    errors: dict[str, str],
) -> dict[str, tuple[int | None, int | None, int | None]]:
    peaks: dict[str, tuple[int | None, int | None, int | None]] = {}
    rows = []
    for name, step in steps.items():
        if name in errors:
            continue
        measured = attempt(name, errors, lambda s=step: (s(), peak_above(s, device))[1])
        if measured is None:
            continue
        above = measured[0]
        held = held_on_device(built[name], device)
        keeps = attempt(name, errors, lambda n=name: forward_keeps(built[n], x, device))
        peaks[name] = (above, held, keeps)
        total = None if above is None or held is None else above + held
        rows.append([name, built[name].note, mib(held), mib(above), mib(total), mib(keeps)])
    rec.table(
        "Peak device memory of a training step (fwd + bwd + AdamW)",
        [
            "setting",
            "",
            "held between steps (MiB)",
            "peak above the step's start (MiB)",
            "peak of a step (MiB)",
            "forward keeps (MiB)",
        ],
        rows,
        notes=[
            (
                "'Held between steps': the setting's parameters, buffers and optimizer state on "
                "the device (the settings share one process, so the allocator's totals mix "
                "them); 'peak of a step' adds the step's own peak above its start; 'forward "
                "keeps': device memory held after the forward, until backward."
            )
        ],
    )
    rec.put("peaks_bytes", peaks)
    return peaks


def _time_table(rec: Recorder, what: str, timings: Timings) -> None:
    rows = [
        [
            name,
            common.spread_ms(timings, name),
            common.ratio(timings, name, "tensorhooks") if "tensorhooks" in timings.samples else "-",
        ]
        for name in timings.samples
    ]
    rounds = len(next(iter(timings.samples.values()), []))
    rec.table(
        f"Step time ({what}), median (min-max) of {rounds} interleaved rounds",
        ["setting", what, "x tensorhooks"],
        rows,
    )
    rec.put(f"{what} seconds", timings.samples)


def _targets(
    rec: Recorder,
    peaks: dict[str, tuple[int | None, int | None, int | None]],
    two_blocks: int,
    timings: Timings,
    skipped: dict[str, str],
) -> None:
    above, _held, keeps = peaks.get("tensorhooks", (None, None, None))
    value = None if above is None or keeps is None else above / (two_blocks + keeps)
    rec.target(
        evaluate(
            PART,
            "peak over (two largest blocks' parameters + activations)",
            value,
            at_most=1.0,
            fmt="{:.2f}",
            detail=f"peak above the step's start {_gib(above)} GiB; two blocks "
            f"{_gib(two_blocks)} GiB + forward keeps {_gib(keeps)} GiB",
        )
    )
    summary = [] if value is None else [f"peak {value:.2f}x its bound"]
    for peer in ("fsdp2", "fairscale"):
        names = ("tensorhooks", peer)
        ratio = timings.ratio(*names) if all(n in timings.samples for n in names) else None
        missing = skipped.get(peer, f"{peer} or tensorhooks did not run")
        rec.target(
            evaluate(
                PART,
                f"training step over {peer}'s",
                None if ratio is None else ratio.median,
                at_most=1.0,
                fmt="{:.3f}x",
                missing=missing,
                detail="" if ratio is None else f"per-round range {ratio.format(digits=3)}",
            )
        )
        if ratio is not None:
            summary.append(f"{ratio.median:.2f}x {peer}'s step")
    rec.summary(", ".join(summary))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"
