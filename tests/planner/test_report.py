"""The plan's table: 80 columns for every choice and GPU-sized figures, no text lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tensorhooks._planner.report import BlockPlan, plan_table

_MIB = 1 << 20

# Blocks as a plan on a GPU can hold them: names as transformers models give them
# ("model.layers.31"), up to 9,999 MiB held, up to a second's difference in step time, and every
# combination of choices (saved and offloaded ops by the dozen, inputs offloaded or not).
_blocks = st.builds(
    BlockPlan,
    name=st.text("abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=15),
    checkpoint=st.booleans(),
    saved=st.lists(st.just("aten.mm.default#0"), max_size=40).map(tuple),
    offloaded=st.lists(st.just("aten.mm.default#1"), max_size=40).map(tuple),
    offload_input=st.booleans(),
    recomputed=st.integers(0, 99_999),
    device_bytes=st.integers(0, 9_999 * _MIB),
    backward_bytes=st.integers(0, 9_999 * _MIB),
    host_bytes=st.integers(0, 9_999 * _MIB),
    seconds=st.floats(-0.999, 0.999),
)


@given(st.lists(_blocks, min_size=1, max_size=6, unique_by=lambda block: block.name))
def test_every_line_fits_80_columns_and_keeps_each_choice_whole(blocks: list[BlockPlan]) -> None:
    """A choice too long for its column goes on below its row; nothing is cut or lost."""
    lines = plan_table(blocks)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    header = lines[0]
    name_width = max([len("block"), *(len(block.name) for block in blocks)])
    start = name_width + 2
    end = header.index("again") - 2  # the choice column, right-padded up to the next one
    rows = lines[2 : len(lines) - 4]  # the legend's four lines close the table
    for block in blocks:
        first = next(i for i, row in enumerate(rows) if row[:name_width].rstrip() == block.name)
        parts = [rows[first][start:end].rstrip()]
        for row in rows[first + 1 :]:
            if row[:start].strip():  # the next block's row
                break
            parts.append(row[start:].rstrip())
        assert " ".join(parts) == block.choice
        assert len(rows[first]) == len(header)  # its figures under their headers


def test_a_long_choice_continues_after_its_comma() -> None:
    """The longest choice, beside a block named as in a stack of layers, takes two lines."""
    block = BlockPlan(
        name="layers.10",
        checkpoint=True,
        saved=("aten.mm.default#0",) * 12,
        offloaded=("aten.mm.default#1",) * 3,
        offload_input=True,
        recomputed=148,
        device_bytes=3 * _MIB,
        backward_bytes=40 * _MIB,
        host_bytes=_MIB,
        seconds=-0.0042,
    )
    table = plan_table([block])
    assert block.choice == "recompute, save 12, offload 3, offload input"
    assert table[2].startswith("layers.10  recompute, save 12,    ")
    assert table[3] == " " * 11 + "offload 3, offload input"
    assert len(table[2]) == len(table[0]) <= 80
