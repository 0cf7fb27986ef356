"""bench_scale's children at toy sizes: the benchmark that carries issue 14's figures must run.

Its dispatch section once raised KeyError for a month of merges because nothing ran it between
benchmark sessions; these calls are the same code at sizes that take seconds. They check what the
benchmark's figures rest on (every unit done once, every committed unit counted), not speed.
"""

from __future__ import annotations

import pytest

from harvest.benchmarks import bench_scale

pytestmark = pytest.mark.slow  # bench_scale's children (Ray, stores): not in `pytest -m 'not slow'`


def test_dispatch_child_runs_every_unit_once_on_stub_actors(ray_cluster):
    r = bench_scale.dispatch_child({"address": ray_cluster.address, "actors": 3, "units": 300})
    assert r["units"] == 300 and r["done_once"], r
    assert r["units_per_s"] > 0 and r["bare_ray_units_per_s"] > 0


def test_bookkeeping_children_count_a_synthetic_store(tmp_path):
    n = 300
    url = str(tmp_path / "book")
    bench_scale.synthetic_store(url, None, n)
    spec = {"url": url, "storage_options": None, "units": n}
    resume = bench_scale.bookkeeping_child({**spec, "op": "resume"})
    assert (resume["todo"], resume["committed"]) == (0, n)
    assert bench_scale.bookkeeping_child({**spec, "op": "status"})["committed"] == n
    v = bench_scale.bookkeeping_child({**spec, "op": "verify"})
    assert v["ok"] and v["committed"] == n
    raw = bench_scale.bookkeeping_child({**spec, "op": "raw_get"})
    assert raw["bytes"] > 0
    assert bench_scale.bookkeeping_child({**spec, "op": "finalize"})["committed"] == n


def test_shape_children_count_a_layout_3_store(tmp_path):
    """The `shape` section's store and children at a toy shape: every unit committed with a
    fixed-size marker and its table, the reader's dataset built without reading a table."""
    from harvest.benchmarks import scale_shape

    n, shape = 40, {"points": 4, "width": 16, "shard_rows": 128, "unit_shards": 16}
    url = str(tmp_path / "shape")
    built = scale_shape.synthetic_bookkeeping(url, None, n, **shape)
    assert built["marker_bytes_max"] < 1500 and built["table_bytes"] > 16 * 4 * 8  # ~17 B a CRC pair
    spec = {"url": url, "storage_options": None, "units": n, "unit_contexts": 16}
    r = scale_shape.read_open_child(spec)
    assert (r["committed"], r["pieces"], r["rows"], r["tables_read"]) == (n, 16 * n, 2048 * n, 0)
    assert scale_shape.table_child(spec)["shards"] == 16
    resume = bench_scale.bookkeeping_child({**spec, "op": "resume"})
    assert (resume["todo"], resume["committed"]) == (0, n)
    v = bench_scale.bookkeeping_child({**spec, "op": "verify"})
    assert v["ok"] and v["committed"] == n
    assert bench_scale.bookkeeping_child({**spec, "op": "finalize"})["committed"] == n
    a, b = scale_shape.fit([1, 2, 3], [5, 7, 9])
    assert (round(a, 6), round(b, 6)) == (3, 2)
