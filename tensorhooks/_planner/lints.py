"""The known traps of activation memory, found in a traced step, each with its fix.

See NOTE [The traps explain looks for] below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .explained import HeldTensor, Lint
from .report import mib
from .timeline import cached_ops
from .tracing import Call, Pair, Trace

__all__ = [
    "CACHE",
    "CHILDREN",
    "IDENTITY",
    "INPUTS",
    "SAVES_EVERYTHING",
    "SAVES_NOTHING",
    "LintInputs",
    "find_lints",
]

# NOTE [The traps explain looks for]
#
# Each is found from what the step did, not from how the model was configured, so it is found
# whoever set the step up (accelerate, trl, a hand-written loop):
# - Children checkpointed instead of the layer: two or more checkpoint regions inside a layer of
#   a repeated stack, the layer itself not checkpointed. What passes between the children stays
#   saved; a checkpoint of the layer keeps its inputs alone.
# - A selective policy that saves nothing or everything: of a selective region's ops that make a
#   tensor before its last save, its recomputation ran again all (the policy cached none: a full
#   checkpoint that pays the policy's dispatch) or none (nothing recomputed: the region holds
#   what no checkpoint holds, and pays the dispatch).
# - A region whose inputs are larger than what its ops save: checkpointing it keeps more than
#   not checkpointing it would.
# - A KV cache handed to a checkpointed layer: the recomputation writes it again. Hugging Face's
#   own checkpointing turns it off (its layers say ``gradient_checkpointing``), and layers that
#   only read it say ``_can_checkpoint_with_cache``; others are found.
# - Saved-tensor hooks the user pushed whose pack returns the tensor it is given for every save:
#   they keep everything where it was, and cost a Python call per save.

CHILDREN = "children-checkpointed"
SAVES_NOTHING = "policy-saves-nothing"
SAVES_EVERYTHING = "policy-saves-everything"
INPUTS = "inputs-larger-than-saves"
CACHE = "cache-under-checkpoint"
IDENTITY = "identity-pack"


@dataclass(frozen=True)
class LintInputs:
    """What the lints look at."""

    trace: Trace
    regions: dict[int, int]
    """Each checkpoint region's pair -> its module call (-1: outside the model)."""
    layers: dict[str, str]
    """The layers of the model's repeated stacks: name -> class name."""
    held: Sequence[HeldTensor]
    peak: int


def _names(names: Sequence[str], most: int = 3) -> str:
    """``a, b, c and 4 more``."""
    unique = list(dict.fromkeys(names))
    shown = ", ".join(unique[:most])
    return shown if len(unique) <= most else f"{shown} and {len(unique) - most} more"


def _region_names(inputs: LintInputs) -> dict[int, str]:
    calls = inputs.trace.calls
    return {pair: calls[call].name for pair, call in inputs.regions.items() if call >= 0}


def _children(inputs: LintInputs) -> list[Lint]:
    names = set(_region_names(inputs).values())
    affected: dict[str, list[str]] = {}
    for layer in inputs.layers:
        inside = [name for name in names if name.startswith(layer + ".")]
        covered = any(name == layer or layer.startswith(name + ".") for name in names)
        if len(inside) >= 2 and not covered:
            affected[layer] = sorted(inside)
    if not affected:
        return []
    held = sum(
        tensor.nbytes
        for tensor in inputs.held
        if tensor.status == "saved"
        and any(tensor.module.startswith(f"{layer}.") for layer in affected)
    )
    calls = [call for call in inputs.trace.calls if call.name in affected and not call.backward]
    kept = sum(dict(key_bytes for call in calls for key_bytes in call.tensors).values())
    layers = list(affected)
    children = _names([name.rpartition(".")[2] for name in affected[layers[0]]], 4)
    kind = inputs.layers[layers[0]]
    message = (
        f"{len(layers)} layers ({_names(layers, 2)}) checkpoint their children ({children}) "
        "one by one instead of the whole layer: what passes between the children stays saved "
        f"for backward, {mib(held)} of the {mib(inputs.peak)} peak, where a checkpoint of each "
        f"layer keeps its inputs alone (about {mib(kept)}). Checkpoint the layer itself: "
        f"apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, {kind})) "
        "(torch.distributed.algorithms._checkpoint.checkpoint_wrapper), "
        "model.gradient_checkpointing_enable() on a Hugging Face model, or "
        "tensorhooks.plan_activations(model, step, budget)."
    )
    return [Lint(CHILDREN, tuple(layers), max(0, held - kept), message)]


def _compute_ops(trace: Trace, pair: Pair) -> int:
    return sum(
        1
        for op in trace.ops
        if op.pair == pair.index and not op.backward and op.tick < pair.last_save and op.outputs
    )


def _policies(inputs: LintInputs) -> list[Lint]:
    trace, names = inputs.trace, _region_names(inputs)
    nothing: list[tuple[str, int]] = []
    everything: list[tuple[str, int, int]] = []
    for index in inputs.regions:
        pair = trace.pairs[index]
        if not pair.selective or not pair.recomputed:
            continue
        asked, cached = _compute_ops(trace, pair), cached_ops(trace, pair)
        name = names.get(index, "(outside the model)")
        if asked and not cached:
            nothing.append((name, asked))
        elif asked and len(cached) == asked:
            held = sum(nbytes for op in cached for _, nbytes in op.outputs)
            everything.append((name, asked, held))
    lints = []
    if nothing:
        regions = [name for name, _ in nothing]
        lints.append(
            Lint(
                SAVES_NOTHING,
                tuple(regions),
                0,
                f"the selective checkpoint policy of {_names(regions)} kept none of the "
                f"{nothing[0][1]} ops it was asked about: the region runs as a full checkpoint "
                "and pays the policy's call on every op for nothing. A policy usually misses "
                "because it compares with another operator than the one that runs: it is "
                "handed overloads (torch.ops.aten.mm.default), not packets "
                "(torch.ops.aten.mm), so test func.overloadpacket; on a CPU attention runs as "
                "aten._scaled_dot_product_flash_attention_for_cpu, not the CUDA kernels. Print "
                "the ops your policy is asked about to see their names.",
            )
        )
    if everything:
        regions = [name for name, _, _ in everything]
        held = sum(nbytes for _, _, nbytes in everything)
        lints.append(
            Lint(
                SAVES_EVERYTHING,
                tuple(regions),
                held,
                f"the selective checkpoint policy of {_names(regions)} kept all "
                f"{everything[0][1]} ops its recomputation would run: nothing is recomputed, so "
                f"the regions hold what no checkpoint holds ({mib(held)} kept by the policy) "
                "and pay the policy's call on every op too. Return "
                "CheckpointPolicy.PREFER_RECOMPUTE for cheap ops (elementwise, norms) and save "
                "only the costly ones (matmuls, attention), or drop the checkpoint.",
            )
        )
    return lints


def _inputs_larger(inputs: LintInputs) -> list[Lint]:
    trace = inputs.trace
    found: list[tuple[str, int, int]] = []
    for index, call_index in inputs.regions.items():
        pair = trace.pairs[index]
        if call_index < 0:
            continue
        call: Call = trace.calls[call_index]
        kept = sum(dict(call.tensors).values())
        saves = sum(pair.positions.values())
        if kept > saves:
            found.append((call.name, kept, saves))
    if not found:
        return []
    regions = [name for name, _, _ in found]
    kept = sum(item[1] for item in found)
    saves = sum(item[2] for item in found)
    message = (
        f"{_names(regions)}: a checkpoint keeps its inputs ({mib(kept)} in all) to recompute, "
        f"more than its ops save for backward without one ({mib(saves)}): checkpointing costs "
        f"{mib(kept - saves)} and a recomputation here. Remove the checkpoint there, or "
        "checkpoint a larger region that contains it."
    )
    return [Lint(INPUTS, tuple(regions), kept - saves, message)]


def _cache(inputs: LintInputs) -> list[Lint]:
    trace = inputs.trace
    found: list[tuple[str, str]] = []
    for call_index in inputs.regions.values():
        if call_index < 0:
            continue
        call = trace.calls[call_index]
        module = call.module
        if call.cache is None or getattr(type(module), "_can_checkpoint_with_cache", False):
            continue
        if getattr(module, "gradient_checkpointing", False) is True:
            continue  # Hugging Face's own checkpointing turns the cache off
        found.append((call.name, call.cache))
    if not found:
        return []
    layers = [name for name, _ in found]
    message = (
        f"{_names(layers)} are checkpointed and called with {found[0][1]}: the recomputation "
        "in backward runs each layer again and writes its keys and values into the cache a "
        "second time, and the cache keeps every layer's keys and values to the end of the step. "
        "Pass use_cache=False in training (model.config.use_cache = False, or "
        "model(..., use_cache=False)), or checkpoint with model.gradient_checkpointing_enable() "
        "or tensorhooks.plan_activations, which turn the cache off in checkpointed layers."
    )
    return [Lint(CACHE, tuple(layers), 0, message)]


def _identity(inputs: LintInputs) -> list[Lint]:
    found: dict[str, int] = {}
    for pair in inputs.trace.pairs:
        if pair.internal or pair.offloader or pair.region or not pair.saves:
            continue
        if pair.identity == pair.saves:
            found[pair.name] = found.get(pair.name, 0) + pair.saves
    if not found:
        return []
    names = list(found)
    held = sum(tensor.nbytes for tensor in inputs.held if tensor.how in found)
    message = (
        f"saved-tensor hooks {_names(names)} return the tensor they are given for each of "
        f"their {sum(found.values())} saves: autograd keeps every tensor on the device as "
        f"without hooks ({mib(held)} of the peak), and each save pays a Python call. If the "
        "hooks are meant to move or compress the tensor, return the copy (on a CPU, "
        "tensor.to('cpu') returns the tensor itself; tensorhooks.save_on_cpu offloads for "
        "you); if not, remove them."
    )
    return [Lint(IDENTITY, tuple(names), held, message)]


def find_lints(inputs: LintInputs) -> list[Lint]:
    """Every trap found in the traced step, the costliest first."""
    lints = [
        *_children(inputs),
        *_policies(inputs),
        *_inputs_larger(inputs),
        *_cache(inputs),
        *_identity(inputs),
    ]
    return sorted(lints, key=lambda lint: -lint.nbytes)
