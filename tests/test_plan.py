"""Work units: the layout policy, and placement of tokenised chunks into dense, shard-aligned
units that do not depend on the order chunks arrive in (the frontier), with resume."""

from __future__ import annotations

import random

import pytest

from harvest.pipeline.config import ConfigError, load_config
from harvest.pipeline.placement import Frontier
from harvest.pipeline.plan import choose_layout
from harvest.pipeline.store.layout import MAX_SHARD_SET_BYTES
from harvest.pipeline.store.plans import Unit, check_units


def _cfg(**kw):
    data = {"packing": {"context_size": 64}, "ray": {"num_actors": 2}}
    for k, v in kw.items():
        data.setdefault(k, {}).update(v)
    return load_config(data=data)


def test_shard_rows_must_be_a_multiple_of_context_size():
    with pytest.raises(ConfigError, match=r"store.shard_rows=100 is not a multiple of "
                                          r"packing.context_size=64: use 128 or 64"):
        choose_layout(_cfg(store={"shard_rows": 100}), 128, 2, 1)
    with pytest.raises(ConfigError, match="store.chunk_rows=48 must divide"):
        choose_layout(_cfg(store={"shard_rows": 128, "chunk_rows": 48}), 128, 2, 1)


def test_derived_layout_sizes_units_for_the_engine_and_bounds_shards():
    big = choose_layout(_cfg(packing={"context_size": 128}), 576, 2, 30)  # SmolLM2, all layers
    assert big.shard_rows % 128 == 0 and big.shard_rows % big.chunk_rows == 0
    assert big.shard_rows * 30 * 576 * 2 <= MAX_SHARD_SET_BYTES  # the writer's buffer bound
    assert big.unit_rows % big.shard_rows == 0
    assert 1 << 17 <= big.unit_rows <= 1 << 18  # ~unit_tokens: many shards, many engine steps
    assert big.unit_rows // big.shard_rows > 10
    # a small bounded run still gives every actor several units
    small = choose_layout(_cfg(packing={"context_size": 128, "max_tokens": 64 * 128}), 128, 2, 4)
    assert small.capacity_rows == 64 * 128 and small.capacity_rows // small.unit_rows >= 8
    explicit = choose_layout(_cfg(store={"shard_rows": 128, "unit_shards": 3}), 128, 2, 1)
    assert (explicit.shard_rows, explicit.unit_rows) == (128, 384)


def _chunks(counts: dict[int, list[int]], rows_per_block: int = 10) -> list[dict]:
    """Descriptors of blocks' chunks: counts[block] = contexts per chunk."""
    out = []
    for b, cs in counts.items():
        for j, n in enumerate(cs):
            out.append({"block": b, "chunk": j, "n_contexts": n, "final": j == len(cs) - 1,
                        "rows": rows_per_block, "cursor": {"row": j, "pos": None, "offset": 0},
                        "digest": [b, j, n]})
    return out


def _place(f: Frontier, descs: list[dict]) -> list:
    units = []
    for d in descs:
        units += [e for e in f.add(d) if e.unit.n_rows]
    return units


COUNTS = {0: [3, 3, 1], 1: [0], 2: [5, 2], 3: [4]}  # 18 contexts; block 1 gives none


def test_units_are_dense_shard_aligned_and_independent_of_arrival_order():
    ref = _place(Frontier(8, 4, 4), _chunks(COUNTS))
    assert [(e.unit.row_start, e.unit.row_end) for e in ref] == \
        [(0, 32), (32, 64), (64, 96), (96, 128), (128, 144)]
    check_units([e.unit for e in ref], shard_rows=32, n_rows=1 << 20)
    assert ref[-1].final and not ref[0].final
    # every context placed once, in block order; doc ids offset by earlier blocks' rows
    pieces = [p for e in ref for p in e.unit.pieces]
    assert sum(p[3] - p[2] for p in pieces) == 18
    assert [(p[0], p[1]) for p in pieces][:4] == [(0, 0), (0, 1), (0, 1), (0, 2)]
    assert {p[0]: p[4] for p in pieces} == {0: 0, 2: 20, 3: 30}
    for seed in range(5):
        descs = _chunks(COUNTS)
        random.Random(seed).shuffle(descs)
        got = _place(Frontier(8, 4, 4), descs)
        assert [e.unit for e in got] == [e.unit for e in ref]


def test_budget_cuts_at_a_context_boundary_in_block_order():
    got = _place(Frontier(8, 4, 4, max_contexts=10), _chunks(COUNTS))
    assert [(e.unit.row_start, e.unit.row_end) for e in got] == [(0, 32), (32, 64), (64, 80)]
    assert got[-1].final and got[-1].unit.pieces[-1] == (2, 0, 1, 3, 20)  # 7 + 0 + 3 contexts


def test_resume_from_a_units_state_continues_identically():
    descs = _chunks(COUNTS)
    ref = _place(Frontier(8, 4, 4), descs)
    for k in range(len(ref) - 1):
        f = Frontier.resume(8, 4, 4, None, ref[k].state)
        block, cursor, chunk = f.continuation()
        # re-created from the continuation's chunk on: earlier chunks are not needed
        again = [d for d in descs if (d["block"], d["chunk"]) >= (block, chunk)]
        assert cursor is None or cursor == next(d["cursor"] for d in again)
        assert [e.unit for e in _place(f, again)] == [e.unit for e in ref[k + 1:]]


def test_check_units_refuses_overlaps_and_shared_shards():
    check_units([Unit(0, 0, 128), Unit(1, 128, 200)], 128, 1000)  # the last may end mid-shard
    with pytest.raises(ValueError, match="not shard-aligned"):
        check_units([Unit(0, 0, 64), Unit(1, 128, 256)], 128, 1000)
    with pytest.raises(ValueError, match="overlap"):
        check_units([Unit(0, 0, 256), Unit(1, 128, 384)], 128, 1000)
    with pytest.raises(ValueError, match="appears twice"):
        check_units([Unit(0, 0, 128), Unit(0, 128, 256)], 128, 1000)
    assert Unit.from_dict(Unit(3, 0, 8, ((1, 2, 0, 1, 5),)).as_dict()) == Unit(3, 0, 8, ((1, 2, 0, 1, 5),))


def test_resume_state_retokenises_only_what_uncommitted_units_and_the_frontier_need(tmp_path):
    """A run stopped with units 0..3 planned (not the last) and 0, 1, 3 committed: the resume
    re-creates the chunk of unit 2 only (from its recorded cursor, and no further), and goes on
    placing from the frontier's last chunk; blocks 0 and 1 (units 0 and 1) are not re-tokenised."""
    from types import SimpleNamespace

    from harvest.pipeline.resume import resume_state
    from harvest.pipeline.store import create_store
    from harvest.pipeline.store.commits import create_marker

    counts = {0: [3, 3, 1], 1: [0], 2: [5, 2], 3: [4]}
    emitted = []
    f = Frontier(8, 4, 4)
    for d in _chunks(counts):
        emitted += f.add(d)
    emitted = [e for e in emitted if e.unit.n_rows][:4]  # planned before the stop
    s = create_store(str(tmp_path / "s"), points=["resid_post.0"], width=8, n_rows=1 << 20,
                     shard_rows=32, chunk_rows=32, context_size=8)
    for seq, e in enumerate(emitted):
        s.plans.write_segment(seq, [e.unit], {"chunks": e.chunks, "state": e.state})
    for uid in (0, 1, 3):
        u = emitted[uid].unit
        create_marker(s.location, {"unit_id": uid, "row_start": u.row_start, "row_end": u.row_end})
    prep = SimpleNamespace(sources={"blocks": [[{}]] * 4}, layout=SimpleNamespace(unit_contexts=4),
                           cfg=SimpleNamespace(packing=SimpleNamespace(context_size=8)))
    st = resume_state(s, prep, None)
    assert st.committed == {0, 1, 3} and [u.unit_id for u in st.todo] == [2]
    assert emitted[2].unit.pieces == ((2, 0, 1, 5, 20),)
    # unit 2: chunk 2:0 alone, from its cursor, and no further; the frontier stopped inside chunk
    # 3:0 (unit 3 took 2 of its 4 contexts): block 3 again from that chunk, to its end
    assert [(j.block, j.first_index, j.last_index) for j in st.jobs] == [(2, 0, 0), (3, 0, None)]
    assert st.jobs[0].start == {"row": 0, "pos": None, "offset": 0}
    assert st.fresh_from == 4 and not st.final
    assert (st.frontier.next_block, st.frontier.next_chunk, st.frontier.skip_ctx) == (3, 0, 2)
    # the frontier resumed here places exactly what the uninterrupted run placed after unit 3
    descs = [d for d in _chunks(counts) if (d["block"], d["chunk"]) >= (3, 0)]
    rest = [e.unit for e in _place(st.frontier, descs)]
    ref = [e.unit for e in _place(Frontier(8, 4, 4), _chunks(counts))]
    assert rest == ref[4:] and len(rest) == 1
