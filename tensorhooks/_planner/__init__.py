"""plan_activations: an activation memory planner for eager mode.

- `profiling`: one profiled step, what each op of each block saves and costs (`profile_step`).
- `costs`: the cost model, bytes held and time per choice of a block.
- `solver`: the exact dynamic programme over blocks.
- `apply`: blocks run as a plan says, through `checkpoint` and `save_on_cpu`.
- `accounting`: what autograd holds, measured while a planned step runs.
- `plan`: `plan_activations` and the plan it returns; `report`: the plan in words.
- `presets`: the hand choices (no checkpointing, full, save matmuls, offload) as plans.
- `blocks`: which modules are blocks.
- `checks`: what planning refuses before profiling, and the state it puts back after.
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
