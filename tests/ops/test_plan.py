"""Work units: the layout policy (pipeline/driver/unit_sizes.py), and placement of tokenised chunks into
dense, shard-aligned units that do not depend on the order chunks arrive in (the frontier,
pipeline/data/row_frontier.py), with resume."""

from __future__ import annotations

import json
import random

import pytest

from harvest.engine.models import REPO_ROOT

from harvest.pipeline.config.run import ConfigError, load_config
from harvest.pipeline.messages import ChunkDescriptor
from harvest.pipeline.data.row_frontier import Frontier
from harvest.pipeline.driver.unit_sizes import choose_layout
from harvest.store.format.layout import MAX_BLOCK_SET_BYTES, TARGET_SHARD_BYTES, block_rows
from harvest.store.commit.plan import Unit, check_units


def _cfg(**kw):
    data = {"packing": {"context_size": 64}, "ray": {"num_actors": 2}}
    for k, v in kw.items():
        data.setdefault(k, {}).update(v)
    return load_config(data=data)


def _layout(cfg, *shape):
    return choose_layout(cfg.store, cfg.packing, cfg.ray.num_actors, *shape)


def test_shard_rows_must_be_a_multiple_of_context_size():
    with pytest.raises(ConfigError, match=r"store.shard_rows=100 is not a multiple of "
                                          r"packing.context_size=64: use 128 or 64"):
        _layout(_cfg(store={"shard_rows": 100}), 128, 2, 1)
    with pytest.raises(ConfigError, match="store.chunk_rows=48 must divide"):
        _layout(_cfg(store={"shard_rows": 128, "chunk_rows": 48}), 128, 2, 1)


def test_derived_layout_sizes_units_for_the_engine_and_bounds_shards():
    big = _layout(_cfg(packing={"context_size": 128}), 576, 2, 30)  # SmolLM2, all layers
    assert big.shard_rows % 128 == 0 and big.shard_rows % big.chunk_rows == 0
    # shards ~128 MiB per point (issue 24: few, large objects); the writer's buffer bound is a
    # block set, independent of the shard size
    assert TARGET_SHARD_BYTES // 2 < big.shard_rows * 576 * 2 <= TARGET_SHARD_BYTES
    assert block_rows(big.shard_rows, big.chunk_rows, 30, 576 * 2, 128) * 30 * 576 * 2 \
        <= MAX_BLOCK_SET_BYTES
    assert big.unit_rows % big.shard_rows == 0
    assert 1 << 17 <= big.unit_rows <= 1 << 18  # ~unit_tokens: many engine steps
    assert big.unit_rows // big.shard_rows >= 2
    # a small bounded run still gives every actor several units
    small = _layout(_cfg(packing={"context_size": 128, "max_tokens": 64 * 128}), 128, 2, 4)
    assert small.capacity_rows == 64 * 128 and small.capacity_rows // small.unit_rows >= 8
    explicit = _layout(_cfg(store={"shard_rows": 128, "unit_shards": 3}), 128, 2, 1)
    assert (explicit.shard_rows, explicit.unit_rows) == (128, 384)


def _chunks(counts: dict[int, list[int]], rows_per_block: int = 10) -> list[ChunkDescriptor]:
    """Descriptors of blocks' chunks: counts[block] = contexts per chunk."""
    out = []
    for b, cs in counts.items():
        for j, n in enumerate(cs):
            out.append(ChunkDescriptor(block=b, chunk=j, n_contexts=n, final=j == len(cs) - 1,
                                       rows=rows_per_block, cursor={"row": j, "pos": None, "offset": 0},
                                       digest=(b, j, n)))
    return out


def _place(f: Frontier, descs: list[ChunkDescriptor]) -> list:
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


def test_a_unit_ending_exactly_at_the_data_s_end_still_marks_the_plan_final():
    """16 contexts in units of 4: the last unit ends at the last chunk of the last block; the
    frontier still says the plan is final (an empty last emission), or finalize would refuse
    a finished store as "not read to its end"."""
    emitted = []
    f = Frontier(8, 4, 2)
    for d in _chunks({0: [3, 5], 1: [4, 4]}):
        emitted += f.add(d)
    assert [(e.unit.row_start, e.unit.row_end) for e in emitted if e.unit.n_rows] == \
        [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert f.done and any(e.final for e in emitted) and emitted[-1].final


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
        again = [d for d in descs if (d.block, d.chunk) >= (block, chunk)]
        assert cursor is None or cursor == next(d.cursor for d in again)
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


def _stopped_after(tmp_path, emitted, committed):
    """A store whose driver stopped after planning `emitted` (each unit its own plan segment)
    with the units `committed` committed, and the Prepared fields resume_state reads."""
    from types import SimpleNamespace

    from harvest.store import create_store
    from harvest.store.commit.markers import create_marker
    from harvest.store.commit.records import Marker

    s = create_store(str(tmp_path / "s"), points=["resid_post.0"], width=8, n_rows=1 << 20,
                     shard_rows=32, chunk_rows=32, context_size=8)
    for seq, e in enumerate(emitted):
        s.ledger.plans.write_segment(seq, [e.unit], {"chunks": e.chunks, "state": e.state})
    for uid in committed:
        u = emitted[uid].unit
        create_marker(s.location, Marker.from_json(
            {"unit_id": uid, "row_start": u.row_start, "row_end": u.row_end}, "test"))
    prep = SimpleNamespace(sources={"blocks": [[{}]] * 4}, layout=SimpleNamespace(unit_contexts=4),
                           context_size=8)
    return s, prep


def test_resume_state_retokenises_only_what_uncommitted_units_and_the_frontier_need(tmp_path):
    """A run stopped with units 0..3 planned (not the last) and 0, 1, 3 committed: the resume
    re-creates the chunk of unit 2 only (from its recorded cursor, and no further), and goes on
    placing from the frontier's last chunk; blocks 0 and 1 (units 0 and 1) are not re-tokenised."""
    from harvest.pipeline.driver.resume import resume_state

    counts = {0: [3, 3, 1], 1: [0], 2: [5, 2], 3: [4]}
    emitted = []
    f = Frontier(8, 4, 4)
    for d in _chunks(counts):
        emitted += f.add(d)
    emitted = [e for e in emitted if e.unit.n_rows][:4]  # planned before the stop
    s, prep = _stopped_after(tmp_path, emitted, committed=(0, 1, 3))
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
    descs = [d for d in _chunks(counts) if (d.block, d.chunk) >= (3, 0)]
    rest = [e.unit for e in _place(st.frontier, descs)]
    ref = [e.unit for e in _place(Frontier(8, 4, 4), _chunks(counts))]
    assert rest == ref[4:] and len(rest) == 1



def test_resume_state_gives_the_continuation_the_budget_left_at_its_chunk(tmp_path):
    """With packing.max_tokens (17 contexts of 18), the continuation job re-reads chunk 3:0 from
    its cursor; the packer counts the budget from there, so the job carries what is left at that
    chunk (17 - the 14 contexts of blocks 0..2 = 3), not 17: with 17 it would pack past the end
    of the run. Jobs that end at a last chunk (unit 2's) need no budget."""
    from harvest.pipeline.driver.resume import resume_state

    counts = {0: [3, 3, 1], 1: [0], 2: [5, 2], 3: [4]}
    f = Frontier(8, 4, 4, max_contexts=17)
    emitted = [e for d in _chunks(counts) for e in f.add(d) if e.unit.n_rows]
    assert [e.unit.row_end // 8 for e in emitted] == [4, 8, 12, 16, 17]
    emitted = emitted[:4]  # planned before the stop: the frontier is inside chunk 3:0, not done
    s, prep = _stopped_after(tmp_path, emitted, committed=(0, 1, 3))
    st = resume_state(s, prep, 17)
    assert [(j.block, j.first_index, j.last_index, j.budget) for j in st.jobs] == \
        [(2, 0, 0, None), (3, 0, None, 3)]
    # the budget is where the frontier's next context lands, less what it re-reads of the chunk
    assert st.frontier.placed - st.frontier.skip_ctx == 17 - st.jobs[1].budget


def test_a_resume_is_checked_once_against_the_config_then_against_the_prepared_run(tmp_path):
    """check_resume (the config, before prepare) and check_resume_plan (what prepare found) each
    check their own facts: a store made by this config passes the first, and the second still
    refuses other resolved points or a data file that changed size since the store was planned."""
    from types import SimpleNamespace

    from harvest.pipeline.driver.resume import RUN_ATTR, check_resume, check_resume_plan
    from harvest.pipeline.errors import ResumeMismatch
    from harvest.store import create_store

    data = tmp_path / "c.jsonl"
    data.write_text('{"text": "a"}\n')
    cfg = _cfg(data={"source": str(data)})
    blocks = [[{"kind": "lines", "path": str(data), "size": data.stat().st_size}]]
    key = {"content": cfg.content_key(), "points": ["resid_post.0"], "context_size": 64}
    s = create_store(str(tmp_path / "s"), points=["resid_post.0"], width=8, n_rows=128,
                     context_size=64, dtype=cfg.store_dtype(), attrs={RUN_ATTR: key})

    def prep(points):
        return SimpleNamespace(run_key=lambda: {**key, "points": points},
                               sources={"blocks": blocks}, source=None)

    check_resume(s, cfg)
    check_resume_plan(s, prep(["resid_post.0"]), cfg.data)
    with pytest.raises(ResumeMismatch, match=r"\(points: the store has \['resid_post.0'\], this "
                                             r"config says \['resid_post.1'\]\)"):
        check_resume_plan(s, prep(["resid_post.1"]), cfg.data)
    data.write_text('{"text": "ab"}\n')
    with pytest.raises(ResumeMismatch, match=r"the data changed since the store was planned "
                                             r"\(.*c.jsonl was 14 bytes when the store was planned, now 15\)"):
        check_resume_plan(s, prep(["resid_post.0"]), cfg.data)
    with pytest.raises(ResumeMismatch, match=r"packing.context_size: the store has 64, this config "
                                             r"says 32"):
        check_resume(s, _cfg(data={"source": str(data)}, packing={"context_size": 32}))

# ---- `harvest plan`: objects, sizes and requests of the layout (issue 24) -------------------

DEFAULT_RATIO = 1.45   # compression.EXPECTED_RATIO_DEFAULT: split-huffman on SmolLM2's rows


def _model_dir(tmp_path, n_layers: int, width: int, vocab: int = 128256) -> str:
    """A Llama config.json of this shape beside the test tokenizer: `plan` reads both and no
    weights, so an 8B model's plan needs no download."""
    import json

    from harvest.engine.models import shared_tokenizer

    d = tmp_path / f"llama-{n_layers}x{width}"
    shared_tokenizer().save_pretrained(d)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": width,
        "intermediate_size": 3 * width, "num_hidden_layers": n_layers,
        "num_attention_heads": max(1, width // 128), "num_key_value_heads": max(1, width // 512),
        "vocab_size": vocab, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}))
    return str(d)


def _plan_json(tmp_path, capsys, model: str, *sets: str) -> dict:
    """`harvest plan --json` on a parquet corpus (its size is unknown from metadata, so the
    budget is the token count) and a fresh store."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from harvest.pipeline.cli.main import main

    # enough text for one context of 128 tokens: plan refuses a corpus that cannot fill one
    pq.write_table(pa.table({"text": ["some text " * 40] * 8}), tmp_path / "c.parquet")
    cfg = {"name": "plan", "model": {"path": model},
           "data": {"source": str(tmp_path / "c.parquet"), "text_column": "text"},
           "packing": {"context_size": 128}, "capture": {"points": ["resid_post.*"]},
           "store": {"url": str(tmp_path / "store")}, "ray": {"num_actors": 2}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--json",
                 *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n"):])


def _recount(p: dict, ratio: float) -> dict:
    """The layout's figures from the plan's own fields and FORMAT.md's rules, not from the code
    that computes them: one object per shard per point, one chunk per unit of each of the 3
    row-metadata columns (int32, int64, int32), a stats sidecar, an object table and a marker
    per unit, the index
    compacted into one segment; every object a multipart upload (start, parts, completion
    after the marker): a data object's parts are its blocks (8 MiB per point, a block set at
    most 128 MiB: power-of-two rows here) gathered to the writer's part size (16 MiB), a metadata chunk one
    part; a sidecar, a table and a marker PUT per unit; a marker GET per shard and one before the marker."""
    T, U, S, P = p["estimate"]["tokens"], p["unit_rows"], p["shard_rows"], p["points"]
    units, shards, per_unit = -(-T // U), -(-T // S), U // S
    row = p["width"] * 2
    cap = min((8 << 20) // row, (128 << 20) // (row * P))
    block = min(S, 1 << (cap.bit_length() - 1))
    data = int(S * row / ratio)
    stored_block = int(block * row / ratio)
    from harvest.store.storage.s3 import S3Storage

    part = stored_block * -(-S3Storage.part_min_bytes // stored_block)  # whole blocks, >= a part
    parts = -(-data // part)
    writes = per_unit * P * (2 + parts) + 3 * 3 + 3
    return {"units": units, "shards": shards,
            "objects": shards * P + units * 3 + units + units + units + 1,
            "data_object_bytes": int(S * p["width"] * 2 / ratio),
            "meta_object_bytes": round(U * (4 + 8 + 4) / 3),
            "writes": writes, "requests": writes + per_unit + 1}


def _check_consistent(p: dict, ratio: float) -> dict:
    lay, want = p["layout"], _recount(p, ratio)
    assert p["estimate"]["compression"] == lay["compression"] == ratio
    assert lay["units"] == want["units"] and lay["shards"] == want["shards"]
    assert lay["objects"] == want["objects"] == sum(lay["objects_by_kind"].values())
    assert lay["data_object_bytes"] == want["data_object_bytes"]
    assert lay["meta_object_bytes"] == want["meta_object_bytes"]
    # the index adds a fraction of a request per unit (a segment per 256..2048 markers)
    assert want["requests"] <= lay["requests_per_unit"] < want["requests"] + 1
    assert want["writes"] <= lay["writes_per_unit"]["total"] < want["writes"] + 1
    rate = lay["rate_tokens_per_second"]
    assert rate == p["estimate"]["tokens_per_second"]
    assert lay["writes_per_second"] == pytest.approx(
        lay["writes_per_unit"]["total"] * rate / p["unit_rows"], abs=1)
    return lay


def test_plan_layout_at_an_8b_shape(tmp_path, capsys):
    """Llama-3.1-8B's shape, resid_post at all 32 layers, 10^9 tokens on GPUs: the figures of
    issue 24: streamed 128 MiB shards make ~95 MB data objects and ~2.0 M objects (the old
    4 MiB shards made 68 M), with no warning left about object sizes or counts; markers of ~1 KB
    whatever the shard count (layout 3: the per-shard records are in the unit's object table)."""
    model = _model_dir(tmp_path, 32, 4096)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "ray.num_gpus_per_actor=1")
    assert (p["points"], p["width"], p["shard_rows"], p["unit_rows"]) == (32, 4096, 16384, 1 << 18)
    lay = _check_consistent(p, DEFAULT_RATIO)  # the default codec is compressed, not 1.0x
    assert lay["data_object_bytes_logical"] == 128 << 20 and lay["shards_per_unit"] == 16
    assert lay["data_object_bytes"] >= 32_000_000
    assert lay["objects"] == 61036 * 32 + 3815 * 3 + 3 * 3815 + 1 == 1_976_043 <= 3_000_000
    assert lay["objects_by_kind"]["meta"] == 11_445 and lay["units"] == 3815
    assert lay["meta_object_bytes"] >= 1 << 20  # one chunk per unit: ~1.4 MB logical
    # issue 24: a marker was ~35 B per shard x point (574 KB at 4 MiB shards); now it does not grow
    # (a few digits more in the summed sizes and the table's length: < 1 B per shard x point)
    assert lay["marker_bytes_per_shard_point"] < 1 and lay["marker_bytes"] < 2000
    # the records went to the table: ~17 B per shard x point gzip'ed (the CRCs do not compress)
    assert 8 * 16 * 32 < lay["table_bytes"] < 20 * 16 * 32
    warnings = "\n".join(lay["warnings"])
    assert "too small for object storage" not in warnings and "over 10 M" not in warnings
    assert "commit markers of ~" not in warnings
    assert "write requests/s" not in warnings  # a local store: no per-prefix request limit
    est = p["estimate"]  # GPUs asked for: priced as GPUs, and said to be a guess
    assert est["rate_platform"] == "gpu" and "no measured GPU rate" in est["rate_source"]
    assert "ray.num_gpus_per_actor=1" in est["rate_source"]


def test_plan_warns_of_the_request_rate_on_object_storage(tmp_path, capsys):
    model = _model_dir(tmp_path, 32, 4096)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "ray.num_gpus_per_actor=1", f"store.url=memory://plan-{tmp_path.name}/s",
                   "store.compression=none")
    lay = _check_consistent(p, 1.0)
    assert lay["object_store"] and lay["data_object_bytes"] == 128 << 20
    w = lay["writes_per_second"]
    assert w < 3500 and "write requests/s" not in "\n".join(lay["warnings"])  # issue 24: fixed
    from harvest.pipeline.cli.main import main

    # --rate prices requests (and time) at the given rate
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--rate", "2000", "--set",
                 "packing.max_tokens=1000000000", "--set", f"store.url=memory://r{tmp_path.name}/s",
                 "--set", "store.compression=none"]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.startswith("requests  ")]
    per_s = round(lay["writes_per_unit"]["total"] * 2000 / p["unit_rows"])
    assert len(lines) == 1 and f"at 2,000 tok/s ~{per_s:,} writes/s" in lines[0]
    assert "rate      given with --rate 2000, instead of ~" in text
    assert "write requests/s" not in text  # ~410/s: under the limit
    assert "objects   1,976,043 for 1,000,000,000 tokens: 1,953,152 data of ~134.2 MB" in text


def test_plan_at_64_gpus_checks_every_limit_it_names_and_the_data_plane(tmp_path, capsys):
    """Issue 38 item 4: 64 GPU actors at the 8B shape (plan's own GPU guess): every limit the
    requests line names is checked at that rate, on object storage and for a local store, the
    requests are the v3 publish path's, and the host cores the write path needs per GPU are
    printed and warned about against ray.num_cpus_per_actor."""
    from harvest.pipeline.cli.main import main
    from harvest.store.format import compression

    model = _model_dir(tmp_path, 32, 4096)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000", "ray.num_actors=64",
                   "ray.num_gpus_per_actor=1", f"store.url=memory://g{tmp_path.name}/s")
    lay = _check_consistent(p, DEFAULT_RATIO)
    rate = p["estimate"]["tokens_per_second"]
    assert rate > 1_000_000 and lay["writes_per_second"] > 3500
    b, w = lay["writes_per_unit_by_request"], lay["writes_per_unit"]
    objs = 16 * 32 + 3
    assert b["create_multipart_upload"] == b["complete_multipart_upload"] == objs
    assert b["create_multipart_upload"] + b["upload_part"] + b["complete_multipart_upload"] == w["objects"]
    assert (b["put_marker"], b["put_object_table"], b["put_stats_sidecar"]) == (1, 1, 1)
    warnings = "\n".join(lay["warnings"] + p["warnings"])
    assert f"~{lay['writes_per_second']:,} write requests/s" in warnings
    # the data plane: rows per GPU x the measured write-path CPU, against 1 CPU per GPU actor
    d = p["dataplane"]
    gb_s = rate / 64 * 32 * 4096 * 2 / 1e9
    core_s = compression.write_core_s_per_gb("default")
    assert d["per"] == "GPU" and d["gb_per_second_per"] == pytest.approx(gb_s, rel=1e-3)
    assert d["cores_needed_per"] == pytest.approx(gb_s * core_s, abs=0.01) and d["cores_needed_per"] > 1
    assert d["cores_reserved_per"] == 1.0
    assert "the data plane needs ~" in warnings and "ray.num_cpus_per_actor=1 reserves 1 per GPU" in warnings
    # enough CPUs reserved: no data-plane warning; the text names the publish path, not copies
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--set", "packing.max_tokens=1000000000",
                 "--set", "ray.num_actors=64", "--set", "ray.num_gpus_per_actor=1", "--set",
                 f"ray.num_cpus_per_actor={int(d['cores_needed_per']) + 1}", "--set",
                 f"store.url=memory://h{tmp_path.name}/s"]) == 0
    text = capsys.readouterr().out
    assert "the data plane needs" not in text and "dataplane ~" in text
    assert "CompleteMultipartUpload" in text and "copy and delete" not in text
    assert "write requests/s" in text   # still over S3's per-prefix rate
    # a local store at the same rate: the limits the line names are still checked, and said so
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000", "ray.num_actors=64",
                   "ray.num_gpus_per_actor=1")
    assert any(x.startswith("on object storage (this store is local), ~") and "write requests/s" in x
               for x in p["layout"]["warnings"])


def test_plan_layout_at_a_small_shape(tmp_path, capsys):
    """SmolLM2's shape (30 x 576) at the default budget: consistent figures, no warnings, CPU
    rates said to be CPU rates."""
    model = _model_dir(tmp_path, 30, 576, vocab=49152)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=16384",
                   "ray.num_gpus_per_actor=0")
    lay = _check_consistent(p, DEFAULT_RATIO)
    assert lay["objects"] == 8 * 30 + 8 * 3 + 3 * lay["units"] + 1
    assert lay["marker_bytes"] < 64_000 and lay["warnings"] == []
    est = p["estimate"]
    # SmolLM2's shape on CPU was measured (benchmarks/results/): that figure, said to be one
    bench = json.loads((REPO_ROOT / "benchmarks/results/results.json").read_text())
    freeze = max(r["tok_s"] for r in bench["sections"]["engine"]["rows"] if r["mode"] == "freeze")
    assert est["rate_platform"] == "cpu" and est["rate_source"].startswith("measured: ")
    assert f"{freeze:,.0f} tok/s on {bench['machine']['cpus']} CPU cores" in est["rate_source"]
    # all layers of SmolLM2 at 10^9 tokens: streamed shards of ~64 MiB, no small objects left
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000")
    lay = _check_consistent(p, DEFAULT_RATIO)
    assert lay["data_object_bytes"] > 32_000_000
    assert not any("too small for object storage" in w for w in lay["warnings"])
    if p["estimate"]["rate_platform"] == "cpu":  # no GPU here and none asked for: said so
        assert "ray.num_gpus_per_actor is unset" in p["estimate"]["rate_source"]


def test_marker_size_estimate_matches_a_written_marker(tmp_path):
    """`plan`'s marker size is the real marker's: a unit of 8 shards x 32 points written by the
    store's writer, against markersize.marker_size for the same shape and sizes."""
    import numpy as np

    from harvest.store import create_store
    from harvest.store.format.markersize import marker_size, table_size
    from harvest.store.format.layout import commit_key
    from harvest.store.commit.tables import unit_shards
    from harvest.testing import synthetic

    points = [f"resid_post.{i}" for i in range(32)]
    s = create_store(str(tmp_path / "s"), points=points, width=64, n_rows=512, shard_rows=32,
                     chunk_rows=32)
    units = s.ledger.write_plan([{"unit_id": 1, "row_start": 256, "row_end": 512}])
    data = synthetic.activations((32, 512, 64))
    [m] = synthetic.fill(s, data, units=units)
    raw = s.location.read_bytes(commit_key(1, 256, 512))
    assert raw == m.encode()
    shards = unit_shards(s, m)
    obj = round(np.mean([n for sh in shards for n in sh.nbytes]))
    meta = {c: r.nbytes for c, r in shards[0].meta.items()}
    est = marker_size(points, 1, 256, len(shards), 32, 64 * 2, obj, meta)
    # the estimate writes the actor's `extra` (fill passes none): ~90 bytes of a fixed-size marker
    assert abs(est - len(raw)) < 150
    # and the table the marker names: built whole, so close (10-digit CRCs vs real ones)
    tab = table_size(points, 1, 256, len(shards), 32, 64 * 2, obj, meta)
    assert abs(tab - m.table.nbytes) < 0.1 * m.table.nbytes


def test_plan_prices_an_existing_store_at_its_own_last_run(tmp_path):
    """A store with history (a scheduled tick's record) is priced at its measured pace, per
    actor, scaled to the config's actors; a store without any falls through (None)."""
    from harvest.pipeline.cli.estimate import store_rate
    from harvest.pipeline.driver.schedule_log import record_tick
    from harvest.store import create_store

    s = create_store(str(tmp_path / "s.zarr"), points=["resid_post.0"], width=8, n_rows=512,
                     shard_rows=256, chunk_rows=128)
    cfg = load_config(data={"ray": {"num_actors": 6}})
    assert store_rate(cfg, s) is None
    record_tick(s.location, {"tokens_per_second": 900.0, "tokens_this_run": 4096,
                             "per_actor": [{}, {}, {}], "finished_at": "2026-12-04"}, 0.0)
    r = store_rate(cfg, s)
    assert r["tokens_per_second"] == 1800  # 300 tok/s per actor x 6
    assert r["rate_source"].startswith("measured: this store's last run (4,096 tokens at 900")


def test_plan_warns_when_a_parquet_corpus_cannot_fill_the_budget(tmp_path, capsys):
    """400 short rows and 10 M tokens asked: the parquet files' sizes bound the corpus (no row is
    read), and the bound is far below the budget: a warning with the numbers."""
    model = _model_dir(tmp_path, 2, 64)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=10000000")
    warn = [w for w in p["warnings"] if "more than the corpus can hold" in w]
    assert len(warn) == 1 and "1 parquet file(s)" in warn[0], p["warnings"]
    size = (tmp_path / "c.parquet").stat().st_size
    assert f"at most ~{int(size * 4 / 3):,} tokens" in warn[0]
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=128")
    assert not [w for w in p["warnings"] if "corpus" in w]


def test_plan_prices_an_fp8_store_at_the_8b_shape(tmp_path, capsys):
    """store.dtype: float8_e4m3fn at Llama-3.1-8B's shape: a row is 4,096 fp8 bytes and a 4-byte
    scale, compressed by fp8's own codec (zstd-1, ~1.17x): at most 0.65x the stored bytes of
    the bf16 plan of the same tokens, with shards and objects sized for the fp8 rows."""
    model = _model_dir(tmp_path, 32, 4096)
    sets = ("packing.max_tokens=1000000000", "ray.num_gpus_per_actor=1")
    bf = _plan_json(tmp_path, capsys, model, *sets)
    q = _plan_json(tmp_path, capsys, model, *sets, "store.dtype=float8_e4m3fn")
    assert q["store_dtype"] == "float8_e4m3fn" and bf["store_dtype"] == "bfloat16"
    assert q["bytes_per_token"] == 32 * (4096 + 4) and bf["bytes_per_token"] == 32 * 4096 * 2
    assert q["estimate"]["compression"] == q["layout"]["compression"] == 1.17
    assert q["estimate"]["bytes_stored"] <= 0.65 * bf["estimate"]["bytes_stored"]
    # data objects priced from the fp8 rows, still well above object storage's small-object range
    assert q["layout"]["data_object_bytes"] == int(q["shard_rows"] * 4100 / 1.17) >= 32_000_000
    assert q["layout"]["objects"] <= bf["layout"]["objects"]
    # the data plane: the same GB/s of rows (per bf16 number), priced by fp8's measured write path
    from harvest.store.format import compression

    dq, db = q["dataplane"], bf["dataplane"]
    assert dq["gb_per_second_per"] == db["gb_per_second_per"]
    assert dq["write_core_s_per_gb"] == compression.write_core_s_per_gb("zstd", "float8_e4m3fn")
    assert db["write_core_s_per_gb"] == compression.write_core_s_per_gb("default")
    assert dq["write_core_s_per_gb"] < db["write_core_s_per_gb"]
    assert dq["cores_needed_per"] < db["cores_needed_per"]

def test_plan_refuses_a_tensor_parallel_size_the_model_cannot_split(tmp_path, capsys):
    """SmolLM2's shape (9 attention heads, 3 KV heads, MLP 1536, vocab 49152): TP=2 is refused
    when the config loads (a local config.json is read), by `harvest plan`, naming the field,
    what does not divide and the sizes that do; TP=3 plans. `prepare` (every run and plan, hub
    names and aliases too) checks the same before Ray, and an actor's pydantic-wrapped error
    is reported by its message, not its "For further information" footer."""
    from harvest.engine.parallel import tp_problems
    from harvest.pipeline.cli.main import main
    from harvest.pipeline.driver.cluster import root_cause
    from harvest.pipeline.driver.prepare import model_facts

    model = _model_dir(tmp_path, 30, 576, vocab=49152)
    path = tmp_path / "llama-30x576" / "config.json"
    hf = json.loads(path.read_text())
    hf.update(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    path.write_text(json.dumps(hf))
    p = _plan_json(tmp_path, capsys, model, "model.tensor_parallel_size=3",
                   "ray.num_gpus_per_actor=3")
    assert p["width"] == 576
    argv = ["plan", "--config", str(tmp_path / "run.yaml"), "--set",
            "model.tensor_parallel_size=2", "--set", "ray.num_gpus_per_actor=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.tensor_parallel_size=2 does not fit" in err
    assert "num_attention_heads=9 is not divisible by 2" in err
    assert "num_key_value_heads=3 is not divisible by 2" in err
    assert "[1, 3]" in err and "For further information" not in err
    cfg = load_config(tmp_path / "run.yaml")
    object.__setattr__(cfg.model, "tensor_parallel_size", 2)  # as a hub name would: prepare reads it
    with pytest.raises(ConfigError, match="num_attention_heads=9"):
        model_facts(cfg.model)
    # vLLM's rules: KV heads fewer than ranks are replicated when the ranks are a multiple
    gqa = {"num_attention_heads": 32, "num_key_value_heads": 2, "intermediate_size": 14336,
           "vocab_size": 128256}
    assert tp_problems(4, gqa) == [] and tp_problems(8, gqa) == []
    assert tp_problems(3, {**gqa, "num_attention_heads": 6, "num_key_value_heads": 2}) != []
    assert tp_problems(2, {"vocab_size": 50257, "n_head": 12, "n_inner": None}) == []
    assert "intermediate_size=1537" in tp_problems(2, {**gqa, "intermediate_size": 1537})[0]
    wrapped = RuntimeError(
        "1 validation error for VllmConfig\n  Value error, Total number of attention heads (9) "
        "must be divisible by tensor parallel size (2). [type=value_error]\n"
        "    For further information visit https://errors.pydantic.dev/2.12/v/value_error\n")
    assert "Total number of attention heads (9)" in root_cause(wrapped)


def test_plan_prices_points_of_several_widths_each_at_its_own(tmp_path, capsys):
    """A transcoder's pair and the MLP's hidden units (3 x 576 here) at every layer: bytes per
    token and per point at each point's width, one shard size (for the widest) and the same
    objects per point; router_logits on a dense model is refused by name before anything runs."""
    from harvest.pipeline.cli.main import main

    model = _model_dir(tmp_path, 30, 576, vocab=49152)
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "capture.points=[mlp_in.*, mlp_act.*]")
    assert p["points"] == 60 and p["widths"]["mlp_in.7"] == 576 and p["widths"]["mlp_act.7"] == 1728
    assert p["bytes_per_token"] == 30 * (576 + 1728) * 2
    per = p["layout"]["per_point"]
    S, T = p["shard_rows"], p["estimate"]["tokens"]
    assert per["mlp_act.0"]["data_object_bytes_logical"] == S * 1728 * 2 == 3 * per["mlp_in.0"][
        "data_object_bytes_logical"]
    assert per["mlp_act.0"]["bytes_logical"] == T * 1728 * 2
    assert per["mlp_in.0"]["objects"] == per["mlp_act.0"]["objects"] == p["layout"]["shards"]
    # shards sized for the widest point: ~128 MiB of mlp_act rows, never more
    assert S * 1728 * 2 <= 128 << 20 < 2 * S * 1728 * 2
    assert main(["plan", "--config", str(tmp_path / "run.yaml"),
                 "--set", "capture.points=[router_logits.*]"]) == 2
    err = capsys.readouterr().err
    assert "router_logits" in err and "needs a MoE model" in err, err


def test_plan_prices_attention_heads_and_mlp_pre_at_their_widths(tmp_path, capsys):
    """q (every head), k and v (the KV heads: 1 of 4 here, grouped-query attention) and the
    gated MLP's two pre-activations, each at its own width from the table's width kinds; a MoE
    model refuses the MLP's pre-activations by name before anything runs."""
    import json

    from harvest.pipeline.cli.main import main

    model = _model_dir(tmp_path, 2, 512, vocab=49152)  # 4 heads of 128, 1 KV head, MLP 1536
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "capture.points=[q.*, k.1, v.1, mlp_pre.0, mlp_pre_linear.0]")
    assert p["widths"] == {"q.0": 512, "q.1": 512, "k.1": 128, "v.1": 128, "mlp_pre.0": 1536,
                           "mlp_pre_linear.0": 1536}
    assert p["bytes_per_token"] == (2 * 512 + 2 * 128 + 2 * 1536) * 2
    cfg = json.loads((tmp_path / "llama-2x512" / "config.json").read_text())
    (tmp_path / "llama-2x512" / "config.json").write_text(json.dumps(
        {**cfg, "num_local_experts": 8, "architectures": ["MixtralForCausalLM"]}))
    assert main(["plan", "--config", str(tmp_path / "run.yaml"),
                 "--set", "capture.points=[mlp_pre_linear.*]"]) == 2
    err = capsys.readouterr().err
    assert "mlp_pre_linear is a dense MLP's point" in err and "MoE blocks" in err, err


def test_plan_prices_the_scores_as_float32_row_columns(tmp_path, capsys):
    """capture.points logprob / entropy: no point arrays, 4 bytes per token each as row
    metadata columns (one more object per unit each); alone they are refused by name."""
    from harvest.pipeline.cli.main import main

    model = _model_dir(tmp_path, 2, 512, vocab=49152)
    base = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                      "capture.points=[resid_post.1]")
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "capture.points=[resid_post.1, logprob, entropy]")
    assert p["points"] == 1 and p["scores"] == ["logprob", "entropy"]
    assert p["bytes_per_token"] == base["bytes_per_token"] + 8 == 512 * 2 + 8
    assert p["layout"]["meta_columns"] == base["layout"]["meta_columns"] + 2
    assert main(["plan", "--config", str(tmp_path / "run.yaml"),
                 "--set", "capture.points=[logprob]"]) == 2
    assert "name at least one point besides them" in capsys.readouterr().err


def test_plan_prices_a_stream_beside_the_store_at_the_8b_shape(tmp_path, capsys):
    """Issue 49: `harvest plan` prices streaming the run to trainers beside writing and reading
    the store: per GPU the capture side's host cores and the network bytes (each row once to
    its trainer), the trainers' cores, against the store's write cores, stored bytes and the
    reader's cores per epoch, from bench_stream's measured core-s per GB; an fp8 stream moves
    (and is priced by) half the bytes."""
    from harvest.pipeline.cli.main import main
    from harvest.pipeline.stream import cost

    model = _model_dir(tmp_path, 32, 4096)
    sets = ("packing.max_tokens=1000000000", "ray.num_actors=64", "ray.num_gpus_per_actor=1")
    p = _plan_json(tmp_path, capsys, model, *sets)
    s, d = p["stream"], p["dataplane"]
    gb_s = d["gb_per_second_per"]
    tokens = p["estimate"]["tokens"]
    assert s["per"] == "GPU" and s["gb_per_second_per"] == pytest.approx(gb_s, rel=1e-3)
    assert s["network_bytes"] == tokens * 32 * 4096 * 2
    assert s["capture_cores_per"] == pytest.approx(gb_s * cost.STREAM_CAPTURE_CORE_S_PER_GB, abs=0.01)
    assert s["trainer_cores_total"] == pytest.approx(64 * gb_s * cost.STREAM_TRAINER_CORE_S_PER_GB, rel=0.01)
    assert s["store_write_cores_per"] == pytest.approx(gb_s * cost.STORE_WRITE_CORE_S_PER_GB, abs=0.01)
    assert s["store_read_cores_total_per_epoch"] == pytest.approx(
        64 * gb_s * cost.STORE_READ_CORE_S_PER_GB, rel=0.01)
    assert s["bytes_stored"] == p["estimate"]["bytes_stored"]
    q = _plan_json(tmp_path, capsys, model, *sets, "stream.dtype=float8_e4m3fn")["stream"]
    assert q["network_bytes"] == tokens * 32 * 4100
    assert q["capture_cores_per"] < 0.55 * s["capture_cores_per"]
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), *[x for v in sets for x in ("--set", v)]]) == 0
    text = capsys.readouterr().out
    assert "stream    no store: ~" in text and "to write" in text and "each epoch" in text


def test_plan_prices_expert_routing_at_k_values_per_layer(tmp_path, capsys):
    """capture.points expert_indices / expert_weights: k = num_experts_per_tok 32-bit values per
    token and layer (4 bytes each: two bfloat16 elements), widths per point in elements; a dense
    model and an fp8 store refuse them by name before anything runs."""
    import json

    from harvest.pipeline.cli.main import main

    model = _model_dir(tmp_path, 2, 512, vocab=49152)
    base = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                      "capture.points=[resid_post.1]")
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--set",
                 "capture.points=[expert_indices.*]"]) == 2
    assert "expert_indices needs a MoE model" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "llama-2x512" / "config.json").read_text())
    (tmp_path / "llama-2x512" / "config.json").write_text(json.dumps(
        {**cfg, "num_local_experts": 8, "num_experts_per_tok": 2, "model_type": "mixtral",
         "architectures": ["MixtralForCausalLM"]}))
    p = _plan_json(tmp_path, capsys, model, "packing.max_tokens=1000000000",
                   "capture.points=[resid_post.1, expert_indices.*, expert_weights.1]")
    assert p["widths"] == {"resid_post.1": 512, "expert_indices.0": 4, "expert_indices.1": 4,
                           "expert_weights.1": 4}
    assert p["bytes_per_token"] == base["bytes_per_token"] + 3 * 2 * 4 == 512 * 2 + 24
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--set",
                 "capture.points=[resid_post.1, expert_weights.0]", "--set",
                 "store.dtype=float8_e4m3fn"]) == 2
    err = capsys.readouterr().err
    assert "expert_weights" in err and "which fp8 would destroy" in err, err
