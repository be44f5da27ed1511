"""Which backward variants the property tests of torch's checkpoint draw, and how kinds show.

torch's checkpoint is judged on backward on the program's thread (ONE_THREAD): on a worker
thread it recomputes outside the graph task's state, which test_stateful_programs.py shows.
tensorhooks' checkpoint is drawn on every kind of region and every backward variant.
"""

from __future__ import annotations

from tensorhooks._testing.programs import BACKWARDS

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
