"""The list of the demo's cases."""

from __future__ import annotations

from tensorhooks.cli._demo.case import Row
from tensorhooks.cli._demo.cases import CASES


def test_every_case_is_timed_against_torch(rows: list[Row]) -> None:
    """Each feature has a step-time ratio; only the threads case and skipped runs have none."""
    untimed = [row.situation for row in rows if row.timing is None]
    # the threads case, the skipped two-process case, three of the four checkpoint cases, the
    # plan, the explanation
    assert len(untimed) == 7, untimed
    assert all(row.ours.good for row in rows)


def test_every_feature_has_its_cases() -> None:
    """The demo shows the ten features, in the order of the summary."""
    features = list(dict.fromkeys(case.feature for case in CASES))
    assert features == [
        "saved_tensors_hooks",
        "disable_saved_tensors_hooks",
        "save_on_cpu",
        "allow_mutation_on_saved_tensors",
        "register_multi_grad_hook",
        "distributed.sync_gradients",
        "checkpoint",
        "offload_parameters",
        "plan_activations",
        "explain",
    ]
    assert len(features) == 10
