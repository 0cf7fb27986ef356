"""The ledger's records (store/commit/records.py): JSON round-trips that give back exactly what
was stored, and refusals that name the object and the field."""

from __future__ import annotations

import json

import pytest

from harvest.store import (DataIntegrityError, LeaseRecord, Marker, ShardRecord, Unit, create_store,
                           open_store)
from harvest.store.commit.records import PublishRecord, StatsRef, TableRef
from harvest.store.format import layout
from harvest.testing import synthetic

ATT = "0123456789abcdef"


def _marker_doc(**kw) -> dict:
    doc = {"layout_version": 3, "unit_id": 2, "row_start": 64, "row_end": 128, "n_rows": 64,
           "n_points": 1, "points_sha256": "0" * 64, "attempt": ATT,
           "table": {"key": layout.table_key(2, ATT), "sha256": "a" * 64, "nbytes": 10, "n_shards": 2},
           "stored_bytes": [100], "row_meta": {"crc32c": {"token_id": 1}},
           "stats": {"key": layout.stats_key(2, ATT), "sha256": "b" * 64, "count": 64, "kept": 60},
           "bytes": 128, "seconds": 0.5, "bytes_per_s": 256.0, "committed_at": "2026-01-01T00:00:00+00:00",
           "host": "h", "pid": 7, "extra": {"actor": 0}, "field_of_a_later_version": [1]}
    doc.update(kw)
    return doc


def test_a_marker_reads_typed_and_writes_back_what_it_read():
    doc = _marker_doc()
    m = Marker.from_json(json.loads(json.dumps(doc)), "where", (2, 64, 128))
    assert (m.unit_id, m.rows, m.n_rows, m.attempt, m.layout_version) == (2, (64, 128), 64, ATT, 3)
    assert m.table == TableRef(layout.table_key(2, ATT), "a" * 64, 10, 2)
    assert m.meta_crc32c == {"token_id": 1} and m.total_stored_bytes() == 100 and m.pid == 7
    assert m.stats == StatsRef(layout.stats_key(2, ATT), "b" * 64, 64, 60)
    assert m.stats.to_json() == doc["stats"]
    assert list(m.shard_ids(32)) == [2, 3] and m.key == layout.commit_key(2, 64, 128)
    assert m.to_json() == doc and m.encode() == json.dumps(doc, separators=(",", ":")).encode()
    assert Marker.from_json(m.to_json(), "again") == m


@pytest.mark.parametrize("field, value, says", [
    ("attempt", "../x", "'attempt'"),
    ("row_end", 10, "'row_end'"),
    ("table", {"key": "elsewhere", "sha256": "a" * 64, "nbytes": 1, "n_shards": 1}, "'table.key'"),
    ("stats", {"key": "_harvest/stats/other.bin"}, "'stats.key'"),
    ("stored_bytes", ["x"], "'stored_bytes'"),
])
def test_a_bad_marker_is_refused_naming_the_object_and_the_field(field, value, says):
    with pytest.raises(DataIntegrityError, match=rf"^_harvest/commits/x\.json: field {says}"):
        Marker.from_json(_marker_doc(**{field: value}), "_harvest/commits/x.json")


def test_a_marker_under_another_name_is_refused():
    with pytest.raises(DataIntegrityError, match="the object's name says"):
        Marker.from_json(_marker_doc(), "k", (3, 64, 128))


def test_plan_units_shard_records_publish_and_lease_records_round_trip():
    u = Unit(4, 0, 256, ((1, 0, 0, 2, 0),))
    assert Unit.from_json(u.to_json(), "seg", 0) == u and u.rows == (0, 256)
    with pytest.raises(DataIntegrityError, match=r"seg: field 'units\[3\].pieces\[0\]'"):
        Unit.from_json([4, 0, 256, [["x"]]], "seg", 3)
    r = {"index": 1, "row_start": 32, "row_end": 64, "crc32c": [5], "nbytes": [9],
         "object_crc32c": [6], "meta": {"token_id": {"crc32c": 1, "nbytes": 2, "chunk": 0}}}
    sh = ShardRecord.from_json(r, "table", "shards[0]", 1)
    assert (sh.index, sh.at(sh.nbytes, 0), sh.meta["token_id"].chunk) == (1, 9, 0) and sh.to_json() == r
    with pytest.raises(DataIntegrityError, match=r"field 'shards\[0\].meta'"):
        ShardRecord.from_json({**r, "meta": {"../etc": {}}}, "table", "shards[0]", 1)
    with pytest.raises(DataIntegrityError, match=r"field 'shards\[0\].crc32c' is not a list of 2"):
        ShardRecord.from_json(r, "table", "shards[0]", 2)   # two points, one size
    p = PublishRecord(4, ATT, 12, "2026-01-01T00:00:00+00:00")
    assert PublishRecord.from_json(json.loads(p.encode()), "pub") == p
    assert p.key == layout.published_key(4, ATT)
    doc = {"owner": "o", "host": "h", "pid": 3, "boot": "b", "start": "9", "name": "run",
           "identity": {"k": 1}, "acquired": 1.0, "lease_seconds": 60.0, "heartbeat": 2.0}
    lease = LeaseRecord.from_json(doc, layout.lease_key(3))
    assert (lease.pid, lease.ttl, lease.released, lease.to_json()) == (3, 60.0, False, doc)
    with pytest.raises(DataIntegrityError, match=r"lease-00000003\.json: field 'pid'"):
        LeaseRecord.from_json({**doc, "pid": "3"}, layout.lease_key(3))


def test_the_ledger_gives_records_and_its_index_keeps_the_markers_bytes(tmp_path):
    """Markers read back (directly, then from the index finalize compacts) are the bytes their
    writer stored; the ledger's plan, markers and tables are typed records."""
    s = create_store(str(tmp_path / "s"), points=["resid_post.0"], width=8, n_rows=128,
                     shard_rows=32, chunk_rows=32)
    s.ledger.write_plan(s.ledger.default_plan(2))
    synthetic.fill(s, synthetic.activations((1, 128, 8)))
    raw = {m.unit_id: s.location.read_bytes(m.key) for m in s.ledger.iter_committed()}
    assert [type(u) for u in s.ledger.plan_units()] == [Unit, Unit]
    s.finalize()
    again = open_store(s.url, read_only=True)
    ms = list(again.ledger.iter_committed())
    assert {m.unit_id: m.encode() for m in ms} == raw
    m, sh = again.ledger.committed_shard(3)
    assert isinstance(m, Marker) and isinstance(sh, ShardRecord) and sh.index == 3
