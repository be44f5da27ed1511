"""Which region kinds and backward variants each property test of a checkpoint draws.

tensorhooks.checkpoint gives plain autograd's results on the first kinds of REGION_KINDS with
backward on the program's thread; the property tests over the kinds of STATEFUL_KINDS and over
backward on a worker thread are in test_stateful_programs.py, as strict xfails where it does not.
Tests that run programs as written (with their regions through tensorhooks.checkpoint) to check
something else, a context around them, draw FIRST_KINDS and ONE_THREAD.
"""

from __future__ import annotations

from tensorhooks._testing.programs import BACKWARDS, REGION_KINDS
from tensorhooks._testing.stateful import STATEFUL_KINDS

FIRST_KINDS = tuple(kind for kind in REGION_KINDS if kind not in STATEFUL_KINDS)
ONE_THREAD = tuple(variant for variant in BACKWARDS if variant != "thread")
# How each kind of STATEFUL_KINDS shows in a program's source.
STATEFUL_SIGNS = {
    "data": r"def region(?s:.)*\n        leaf\d\.data = ",
    "kept": r"masked_fill\((kept|cache)|\* (kept\.scale|cache\['scale)",
    "lazy": r"lazy\d+ = torch\.nn\.LazyLinear(?s:.)*= lazy\d+\(",
    "norm": r"norm\d+ = torch\.nn\.BatchNorm1d(?s:.)*= norm\d+\(",
    "parent": r"model\.blocks = (?s:.)*= model\.blocks\[\d\]\(",
    "rebound": r"\n        cell\d+\.(h|m|step|t) = ",
    "swapped": r"\n    (pair\d+\S*), (pair\d+\S*) = \2, \1\n",
}
