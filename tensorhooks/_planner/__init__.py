"""plan_activations: an activation memory planner for eager mode.

Read top-down: `plan` -> `profiling` -> `recording` -> `summary` -> `costs` / `accounting` ->
`solver` -> `apply`.

- `plan`: `plan_activations` and the plan it returns; `report`: the plan in words.
- `profiling`: `profile_step`, one recorded step; `profiles`: what it says (`StepProfile`).
- `recording`: the recorded step itself (a dispatch mode and saved-tensor hooks); `checks`: what
  it refuses, and the state planning puts back after it.
- `summary`: the recorded step as a profile, a storage saved by several parts counted once.
- `shapes`: how each byte figure grows with the sizes of the step's inputs; `sizing`: a plan
  solved again for larger inputs, before the step runs.
- `calibration`: what checkpointing and a policy cost beyond their ops, once per process.
- `costs`: the cost model, bytes held and time per choice of a block.
- `solver`: the exact dynamic programme over blocks.
- `apply`: blocks run as a plan says, through `checkpoint` and `save_on_cpu`; `layers`: a
  Hugging Face layer's KV cache and its own gradient checkpointing under a plan.
- `accounting`: what autograd holds, measured while a planned step runs.
- `presets`: the hand choices (no checkpointing, full, save matmuls, offload) as plans.
- `blocks`: which modules are blocks.
- `ranks`: one plan for every rank under FSDP2.
- `explain`: what holds a step's peak as the user runs it (`tracing`, `timeline`), the traps
  in it (`lints`), and the cheapest plan under a budget; `explained` puts it in words,
  `explain_chart` draws it.
"""

from .explain import explain
from .explained import Explanation, HeldTensor, Lint
from .plan import ActivationPlan, ActivationPlanHandle, plan_activations
from .presets import PRESETS, preset_plan
from .profiling import StepProfile, profile_step
from .report import BlockPlan, PlanReport

__all__ = [
    "PRESETS",
    "ActivationPlan",
    "ActivationPlanHandle",
    "BlockPlan",
    "Explanation",
    "HeldTensor",
    "Lint",
    "PlanReport",
    "StepProfile",
    "explain",
    "plan_activations",
    "preset_plan",
    "profile_step",
]
