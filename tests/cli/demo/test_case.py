"""What a case is made of, and the sentence an error is shown by."""

from __future__ import annotations

import pytest

from tensorhooks.cli._demo.case import what_went_wrong


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (
            RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your module has parameters that were not "
                "used in producing loss."
            ),
            (
                "RuntimeError: Expected to have finished reduction in the prior iteration "
                "before starting a new one."
            ),
        ),
        (ValueError("x.grad is None; call backward() first"),
         "ValueError: x.grad is None; call backward() first"),
        (RuntimeError("torch.ops.aten.mm.default ran twice. Hint: ..."),
         "RuntimeError: torch.ops.aten.mm.default ran twice."),
        (RuntimeError(""), "RuntimeError: "),
    ],
)  # fmt: skip
def test_an_error_is_shown_by_its_first_sentence(error: Exception, shown: str) -> None:
    """The first sentence, whole: dots inside names do not end it, and no word is cut."""
    assert what_went_wrong(error) == shown
