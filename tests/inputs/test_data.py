"""Documents from every kind of source the pipeline accepts, in a deterministic order."""

from __future__ import annotations

import json

import pytest

from harvest.pipeline.config.run import ConfigError, DataConfig, load_config
from harvest.pipeline.data.default_corpus import pydoc_corpus_path
from harvest.pipeline.data.documents import DataError, DataStats, iter_texts, resolve_source

DOCS = [
    {"text": "alpha beta", "id": 0},
    {"text": "", "id": 1},
    {"text": None, "id": 2},
    {"text": "   \n", "id": 3},
    {"text": "gamma delta epsilon", "id": 4},
]
USABLE = [(0, "alpha beta"), (4, "gamma delta epsilon")]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _texts(**kw):
    stats = DataStats()
    out = list(iter_texts(DataConfig(**kw), stats))
    return out, stats


def test_jsonl_skips_and_counts_rows_without_text(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    out, stats = _texts(source=str(p))
    assert out == USABLE
    assert stats.rows_read == 5
    assert stats.rows_skipped == 3
    assert stats.skipped_reasons == {"empty": 2, "null": 1}


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "csv"])
def test_columnar_files(tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list([{"body": d["text"] or "", "n": d["id"]} for d in DOCS])
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink:
            with pa.ipc.new_stream(sink, ds.data.table.schema) as w:
                w.write_table(ds.data.table)
    out, stats = _texts(source=str(path), text_column="body")
    assert out == USABLE
    assert stats.rows_read == 5


def test_text_files_one_document_per_line(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text("first line\n\nsecond line\n")
    out, stats = _texts(source=str(p))
    assert out == [(0, "first line"), (2, "second line")]
    assert stats.rows_skipped == 1


def test_save_to_disk_dir_with_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(DOCS),
            "validation": datasets.Dataset.from_list([{"text": "held out", "id": 9}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert resolve_source(DataConfig(source=str(tmp_path / "dd"))).kind == "disk"
    assert _texts(source=str(tmp_path / "dd"))[0] == USABLE
    assert _texts(source=str(tmp_path / "dd"), split="validation")[0] == [(0, "held out")]
    with pytest.raises(DataError, match=r"data.split='test'.*validation"):
        _texts(source=str(tmp_path / "dd"), split="test")


def test_streaming_gives_the_same_documents(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    assert _texts(source=str(p), streaming=True)[0] == _texts(source=str(p))[0]


def test_date_partitioned_glob_reads_files_in_sorted_order(tmp_path):
    for day, word in [("2025-06-02", "second"), ("2025-06-01", "first"), ("2025-06-03", "third")]:
        d = tmp_path / f"date={day}"
        d.mkdir()
        _write_jsonl(d / "part-0.jsonl", [{"text": word}])
    out, _ = _texts(source=str(tmp_path / "date=2025-06-0[12]" / "*.jsonl"))
    assert [t for _, t in out] == ["first", "second"]
    # a directory: every data file under it, sorted
    out, _ = _texts(source=str(tmp_path))
    assert [t for _, t in out] == ["first", "second", "third"]


def test_max_docs_limits_rows_read(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    out, stats = _texts(source=str(p), max_docs=1)
    assert out == [(0, "alpha beta")] and stats.rows_read == 1


def test_missing_text_column_names_the_field_and_the_columns(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [{"content": "x"}])
    with pytest.raises(DataError, match=r"data.text_column='text'.*\['content'\]"):
        _texts(source=str(p))
    with pytest.raises(DataError, match=r"data.text_column='text'.*content"):
        _texts(source=str(p), streaming=True)


def test_missing_path_and_unknown_suffix_are_clear(tmp_path):
    with pytest.raises(DataError, match="data.source=.*does not exist"):
        _texts(source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="matches no files"):
        _texts(source=str(tmp_path / "x" / "*.parquet"))
    weird = tmp_path / "d.dat"
    weird.write_text("x")
    with pytest.raises(DataError, match="set data.format"):
        _texts(source=str(weird))


def test_hub_name_unreachable_is_a_data_error(monkeypatch):
    # No network here: with the hub offline, datasets fails fast and the error names the source.
    # (The env vars are read at import time, so the module constants are what count.)
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    src = resolve_source(DataConfig(source="someone/not-cached-corpus"))
    assert src.kind == "hub"
    with pytest.raises(DataError, match=r"data.source='someone/not-cached-corpus'.*revision='v1'"):
        _texts(source="someone/not-cached-corpus", revision="v1")


def test_pydoc_default_corpus_is_written_once_and_stable(tmp_path, monkeypatch):
    monkeypatch.setenv("HARVEST_CACHE", str(tmp_path))
    path = pydoc_corpus_path()
    assert path.parent == tmp_path / "corpus"
    mtime = path.stat().st_mtime_ns
    assert pydoc_corpus_path().stat().st_mtime_ns == mtime
    out, stats = _texts(source="pydoc")
    from pydoc_data.topics import topics

    assert [t for _, t in out] == [topics[k] for k in sorted(topics)]
    assert stats.rows_skipped == 0


def test_config_rejects_bad_data_fields():
    with pytest.raises(ConfigError, match="data.format='xml'"):
        load_config(data={"data": {"format": "xml"}})
    with pytest.raises(ConfigError, match="data.revision.*quote dates"):
        load_config(data={"data": {"revision": 20250601}})
    with pytest.raises(ConfigError, match="unknown field data.text_colum: did you mean data.text_column"):
        load_config(data={"data": {"text_colum": "body"}})


@pytest.mark.parametrize("block_bytes", [1024, 4096, 1 << 20])
def test_blocks_read_every_row_once_in_order_whatever_their_size(tmp_path, block_bytes):
    """Byte-range blocks of json lines and text give the rows `datasets` gives, with the same
    row indices, and a block read from any position it yielded goes on from that row."""
    from harvest.pipeline.data.corpus_blocks import plan_blocks, read_block

    rows = [{"text": f"document {i} " + "word " * (i % 37)} for i in range(300)]
    rows[17] = {"text": None}
    rows[40] = {"other": "no text here"}
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    t = tmp_path / "d.txt"
    t.write_text("".join(f"line {i}\n" if i % 13 else "\n" for i in range(500)))
    for path in (p, t):
        cfg = DataConfig(source=str(path), block_bytes=block_bytes)
        blocks = plan_blocks(cfg)["blocks"]
        assert len(blocks) == -(-path.stat().st_size // block_bytes)
        got, base = [], 0
        for blk in blocks:
            items = list(read_block(blk, cfg))
            got += [(base + r, text) for r, _, text, why in items if why is None]
            base += len(items)
            for r, pos, _, _ in items[1::7]:  # resuming at a yielded position
                assert [x[0] for x in read_block(blk, cfg, {"row": r, "pos": pos})] == \
                    [x[0] for x in items if x[0] >= r]
        assert got == _texts(source=str(path))[0]


@pytest.mark.parametrize("block_bytes", [1024, 1 << 20])
def test_a_line_over_max_line_bytes_is_skipped_unread_and_counted(tmp_path, block_bytes):
    """data.max_line_bytes: a longer line (json lines or text) is one row refused as
    `line_too_long`, read no further than the limit; the rows around it are read as ever, from
    any position a block yielded, and a line of exactly the limit is kept."""
    from harvest.pipeline.data.corpus_blocks import plan_blocks, read_block
    from harvest.pipeline.data.check import probe_text_column

    limit = 2048
    exact = "x" * (limit - len('{"text": ""}'))
    rows = [{"text": f"doc {i}"} for i in range(40)]
    rows[3] = {"text": "y" * (5 * limit)}
    rows[20] = {"text": exact}                      # exactly the limit: kept
    rows[39] = {"text": "z" * (3 * limit)}          # the last line, long
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    t = tmp_path / "d.txt"
    t.write_text("short\n" + "w" * (4 * limit) + "\nafter\n" + "v" * (2 * limit))  # no last \n
    for path, want in ((p, {3: "line_too_long", 39: "line_too_long"}),
                       (t, {1: "line_too_long", 3: "line_too_long"})):
        cfg = DataConfig(source=str(path), block_bytes=block_bytes, max_line_bytes=limit)
        got, base = {}, 0
        for blk in plan_blocks(cfg)["blocks"]:
            items = list(read_block(blk, cfg))
            got.update({base + r: why for r, _, _, why in items})
            base += len(items)
            for r, pos, _, _ in items:  # resuming at any yielded position
                assert [x[0] for x in read_block(blk, cfg, {"row": r, "pos": pos})] == \
                    [x[0] for x in items if x[0] >= r]
        assert {r: why for r, why in got.items() if why} == want, path
    assert got[2] is None and len(got) == 4
    probe_text_column(DataConfig(source=str(p), max_line_bytes=limit),
                      plan_blocks(DataConfig(source=str(p)))["blocks"])
    with pytest.raises(ConfigError, match=r"^data.max_line_bytes must be >= 1024, got 10"):
        load_config(data={"data": {"max_line_bytes": 10}})
    for key in ("data.max_messages", "data.max_conversation_chars"):
        with pytest.raises(ConfigError, match=rf"^{key} must be >= 1, got 0"):
            load_config(overrides=[f"{key}=0"])
