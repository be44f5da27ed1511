"""The fixture every test module of allow_mutation_on_saved_tensors uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tensorhooks._mutation import dispatch_mode


@pytest.fixture
def no_open_contexts() -> Iterator[None]:
    """Each test starts and ends with no open context."""
    assert dispatch_mode._open_contexts == ()
    yield
    assert dispatch_mode._open_contexts == ()
