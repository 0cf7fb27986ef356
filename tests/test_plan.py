"""Work units: shard-aligned, whole contexts, covering every row exactly once."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError
from pipeline.plan import Layout, Unit, check_plan, choose_layout, make_units


def test_units_cover_rows_once_and_align_to_shards():
    layout = choose_layout(n_rows=10 * 64, context_size=64, point_row_bytes=256, n_points=4,
                           num_actors=2, shard_rows=128, unit_shards=2)
    units = make_units(10 * 64, layout)
    assert [(u.row_start, u.row_end) for u in units] == [(0, 256), (256, 512), (512, 640)]
    assert [u.unit_id for u in units] == [0, 1, 2]
    check_plan(units, 640, 128, 64)
    assert Unit.from_dict(units[1].as_dict()) == units[1]


def test_shard_rows_must_be_a_multiple_of_context_size():
    with pytest.raises(ConfigError, match=r"store.shard_rows=100 is not a multiple of "
                                          r"packing.context_size=64: use 128 or 64"):
        choose_layout(640, 64, 256, 1, shard_rows=100)
    with pytest.raises(ConfigError, match="store.chunk_rows=48 must divide"):
        choose_layout(640, 64, 256, 1, shard_rows=128, chunk_rows=48)


def test_derived_layout_gives_every_actor_several_units_and_bounded_shards():
    C = 128
    n_rows = 1000 * C
    big = choose_layout(n_rows, C, point_row_bytes=576 * 2, n_points=30, num_actors=2)
    assert big.shard_rows % C == 0
    assert big.shard_rows * 30 * 576 * 2 <= 128 << 20  # one shard set stays in memory budget
    assert big.shard_rows % big.chunk_rows == 0
    small = choose_layout(64 * C, C, point_row_bytes=128 * 2, n_points=4, num_actors=2)
    assert len(make_units(64 * C, small)) >= 8


def test_check_plan_refuses_gaps_and_misalignment():
    layout = Layout(shard_rows=128, chunk_rows=64, unit_rows=128)
    units = make_units(512, layout)
    with pytest.raises(ValueError, match="starts at 256, expected 128"):
        check_plan([units[0]] + units[2:], 512, 128, 64)
    with pytest.raises(ValueError, match="not aligned"):
        check_plan([Unit(0, 0, 64), Unit(1, 64, 512)], 512, 128, 64)
    with pytest.raises(ValueError, match="cover 384 rows of 512"):
        check_plan(units[:3], 512, 128, 64)
    assert make_units(0, layout) == []
