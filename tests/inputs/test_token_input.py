"""Pre-tokenised input (data.tokens_column), provenance and the dataset card, without Ray or an
engine: the packing rules against the rows written, the refusals through `harvest run` (exit 2,
one line, Ray never imported or started), hashes against hashlib, the card against the store's
attributes. The captured run is tests/pipeline/test_pipeline_tokens.py."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest
import yaml

from harvest.pipeline.cli import main as cli
from harvest.pipeline.config.run import load_config
from harvest.pipeline.data.corpus_blocks import plan_blocks
from harvest.pipeline.data.tokenize import pack_block

C = 16
BOS = 0  # the shared tiny tokenizer's <|bos|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint dir with the tiny models' config and tokenizer and a small weights file:
    enough for prepare (config, tokenizer) and for provenance (hashes); no engine loads it."""
    from safetensors.numpy import save_file

    from harvest.engine.models import shared_tokenizer, tiny_config

    d = tmp_path_factory.mktemp("model")
    tok = shared_tokenizer()
    tok.save_pretrained(d)
    tiny_config("llama", len(tok)).save_pretrained(d)
    save_file({"w": np.arange(256, dtype=np.float32)}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def other_tokenizer(model_dir, tmp_path_factory):
    """The same tokenizer with two tokens' ids swapped: another vocabulary."""
    d = tmp_path_factory.mktemp("other-tok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, d / f)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def _jsonl(path, rows, col="input_ids"):
    path.write_text("".join(json.dumps({col: r}) + "\n" for r in rows))
    return path


def _cfg(model_dir, source, store, **data):
    return load_config(data={
        "name": "tok", "progress": False,
        "model": {"path": str(model_dir), "backend": "eager"},
        "data": {"source": str(source), "tokens_column": "input_ids", **data},
        "packing": {"context_size": C, "bos": "context"},
        "capture": {"points": ["resid_post.1"]},
        "store": {"url": str(store), "shard_rows": 4 * C}})


def _pack(cfg, **kw):
    blocks = plan_blocks(cfg.data)["blocks"]
    assert len(blocks) == 1
    return list(pack_block(0, blocks[0], cfg.data, cfg.packing, None, BOS, kw.pop("chunk", 1 << 30),
                           None, vocab_size=512, **kw))


def _cat(chunks, name):
    return np.concatenate([getattr(c, name) for c in chunks])


def test_whole_rows_are_contexts_unchanged(model_dir, tmp_path):
    rng = np.random.default_rng(0)
    rows = [[BOS] + rng.integers(3, 512, C - 1).tolist() for _ in range(5)]
    rows.insert(2, None)            # skipped and counted, row numbers kept
    rows.insert(4, "not ids")
    cfg = _cfg(model_dir, _jsonl(tmp_path / "t.jsonl", rows), tmp_path / "s")
    chunks = _pack(cfg)
    ids = [r for r in rows if isinstance(r, list)]
    np.testing.assert_array_equal(_cat(chunks, "token_id"), np.concatenate(ids))
    np.testing.assert_array_equal(_cat(chunks, "doc_id"),
                                  np.repeat([i for i, r in enumerate(rows) if isinstance(r, list)], C))
    np.testing.assert_array_equal(_cat(chunks, "position"), np.tile(np.arange(C), len(ids)))
    stats = chunks[-1].stats
    assert stats["bos_inserted"] == 0 and stats["rows_skipped"] == 2
    assert stats["skipped_reasons"] == {"null": 1, "not_tokens": 1}


def test_other_lengths_packed_leading_bos_not_doubled_and_resume_exact(model_dir, tmp_path):
    rng = np.random.default_rng(1)
    rows = [[BOS] + rng.integers(3, 512, n).tolist() for n in (5, 30, 11, 40, 3, 22)]
    rows.insert(3, [BOS] + rng.integers(3, 512, C - 1).tolist())  # C long, mid-context: packed
    cfg = _cfg(model_dir, _jsonl(tmp_path / "t.jsonl", rows), tmp_path / "s")
    chunks = _pack(cfg, chunk=1)
    tok, doc = _cat(chunks, "token_id"), _cat(chunks, "doc_id")
    n = len(tok) // C
    assert n >= 5
    ctx = tok.reshape(n, C)
    assert (ctx[:, 0] == BOS).all() and (ctx[:, 1:] != BOS).all()  # one BOS per context, inserted
    body = tok[doc >= 0]
    expect = np.concatenate([r[1:] for r in rows])  # each row without its own BOS, in order
    np.testing.assert_array_equal(body, expect[: len(body)])
    # resumed at any chunk's cursor, packing gives that chunk and every later one again
    for k in (1, 3):
        again = _pack(cfg, chunk=1, start=chunks[k].cursor, first_index=k)
        for a, b in zip(chunks[k:], again):
            np.testing.assert_array_equal(a.token_id, b.token_id)
            np.testing.assert_array_equal(a.doc_id, b.doc_id)
            np.testing.assert_array_equal(a.position, b.position)


def _run_cli(argv, capsys):
    had_ray = "ray" in sys.modules
    # a module run earlier in this process may have left its own Ray connection up
    was_up = had_ray and sys.modules["ray"].is_initialized()
    capsys.readouterr()  # what the test's own setup printed (datasets' progress bars)
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    if not had_ray:
        assert "ray" not in sys.modules  # refused before Ray: never even imported
    elif not was_up:
        import ray

        assert not ray.is_initialized()
    return code, err


def _config_file(tmp_path, cfg_dict):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg_dict))
    return p


def _raw(model_dir, source, store):
    return {"name": "tok", "progress": False,
            "model": {"path": str(model_dir), "backend": "eager"},
            "data": {"source": str(source), "tokens_column": "input_ids"},
            "packing": {"context_size": C}, "capture": {"points": ["resid_post.1"]},
            "store": {"url": str(store), "shard_rows": 4 * C}}


def test_out_of_vocabulary_id_refused_before_ray_in_one_line(model_dir, tmp_path, capsys):
    rows = [[BOS] + [5] * (C - 1) for _ in range(9)]
    rows[7][4] = 100_000
    src = _jsonl(tmp_path / "t.jsonl", rows)
    code, err = _run_cli(["run", "--config", str(_config_file(tmp_path, _raw(model_dir, src, tmp_path / "s")))],
                         capsys)
    assert code == 2 and len(err) == 1, err
    assert "data.tokens_column" in err[0] and "row 7" in err[0] and "100000" in err[0]
    assert not (tmp_path / "s").exists()  # nothing written


def _disk(tmp_path, rows, record: "dict | None"):
    import datasets

    d = tmp_path / "pretok"
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(d))
    if record is not None:
        (d / "sae_lens.json").write_text(json.dumps(record))
    return d


def test_recorded_tokenizer_mismatch_refused_with_both_names(model_dir, other_tokenizer, tmp_path,
                                                            capsys):
    rows = [[BOS] + [7] * (C - 1)] * 4
    # a loadable recorded tokenizer: vocabularies compared
    src = _disk(tmp_path, rows, {"tokenizer_name": str(other_tokenizer), "context_size": C})
    conf = _config_file(tmp_path, _raw(model_dir, src, tmp_path / "s"))
    code, err = _run_cli(["run", "--config", str(conf)], capsys)
    assert code == 2 and len(err) == 1, err
    assert str(other_tokenizer) in err[0] and str(model_dir) in err[0]
    assert "vocabularies compared" in err[0]
    # a name that cannot be loaded here and is not the model's: the sample decides (random ids
    # re-encode differently: refused)
    rng = np.random.default_rng(3)
    src = _disk(tmp_path / "r", [[BOS] + rng.integers(3, 512, C - 1).tolist() for _ in range(8)],
                {"tokenizer_name": "someorg/another-model"})
    conf = _config_file(tmp_path, _raw(model_dir, src, tmp_path / "s"))
    code, err = _run_cli(["run", "--config", str(conf)], capsys)
    assert code == 2 and len(err) == 1, err
    assert "someorg/another-model" in err[0] and str(model_dir) in err[0] and "names differ" in err[0]
    assert not (tmp_path / "s").exists()


def test_recorded_same_tokenizer_passes_and_sample_check_warns(model_dir, tmp_path, caplog):
    from harvest.engine.models import shared_tokenizer
    from harvest.pipeline.driver.prepare import prepare
    from pydoc_data.topics import topics

    tok = shared_tokenizer()
    text = " ".join(topics[k] for k in sorted(topics)[:3])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = [[BOS] + ids[i:i + C - 1] for i in range(0, 8 * (C - 1), C - 1)]
    src = _disk(tmp_path, rows, {"tokenizer_name": str(model_dir), "context_size": C})
    prep = prepare(_cfg(model_dir, src, tmp_path / "s"))
    assert prep.token_source["checked"] == "vocabularies compared"
    assert prep.token_source["ids_checked"] == 8 * C
    # recorded under a name not loadable here: the model's own ids re-encode alike, so it passes
    (src / "sae_lens.json").write_text(json.dumps({"tokenizer_name": "HuggingFaceTB/renamed"}))
    with caplog.at_level(logging.WARNING, logger="harvest.pipeline.data.token_input"):
        prep = prepare(_cfg(model_dir, src, tmp_path / "s"))
    assert prep.token_source["unverified"] and prep.token_source["sample_agreement"] >= 0.9
    assert any("taken as the same tokenizer" in r.getMessage() for r in caplog.records)
    caplog.clear()
    # no record: the model's own ids re-encode alike (no warning), random ids do not
    os.remove(src / "sae_lens.json")
    with caplog.at_level(logging.WARNING, logger="harvest.pipeline.data.token_input"):
        prep = prepare(_cfg(model_dir, src, tmp_path / "s"))
    assert prep.token_source["sample_agreement"] >= 0.9 and not caplog.records
    rng = np.random.default_rng(2)
    src2 = _disk(tmp_path / "r", [[BOS] + rng.integers(3, 512, C - 1).tolist() for _ in range(8)], None)
    with caplog.at_level(logging.WARNING, logger="harvest.pipeline.data.token_input"):
        prep = prepare(_cfg(model_dir, src2, tmp_path / "s"))
    assert prep.token_source["sample_agreement"] < 0.9
    assert any("may come from another tokenizer" in r.getMessage() for r in caplog.records)


# ---- provenance -----------------------------------------------------------------------------------

def test_provenance_local_file_and_model_dir(model_dir, tmp_path, monkeypatch):
    from harvest.pipeline.data import provenance as pv

    src = _jsonl(tmp_path / "t.jsonl", [[BOS] + [5] * (C - 1)] * 3)
    cfg = _cfg(model_dir, src, tmp_path / "s")
    data = pv.data_provenance(cfg.data, plan_blocks(cfg.data))
    assert data["files"] == [{"path": str(src), "bytes": src.stat().st_size,
                              "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}]
    assert data["column"] == "input_ids" and data["split"] == "train"
    m = pv.model_provenance(str(model_dir), "tiny")
    assert m["config_sha256"] == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    assert m["weights_hash"] == "sha256 of every weight file" and m["tokenizer_sha256"]
    assert m["weights_files"] == ["model.safetensors"]
    # a changed weight changes the hash, full or sampled (a fine-tune keeps the headers)
    copy = tmp_path / "m2"
    shutil.copytree(model_dir, copy)
    w = bytearray((copy / "model.safetensors").read_bytes())
    w[-5] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(w))
    assert pv.model_provenance(str(copy), "x")["weights_sha256"] != m["weights_sha256"]
    monkeypatch.setattr(pv, "FULL_HASH_BYTES", 0)
    s1, s2 = (pv.model_provenance(str(d), "x") for d in (model_dir, copy))
    assert "sampled" in s1["weights_hash"] and s1["weights_sha256"] != s2["weights_sha256"]


def test_provenance_hub_style_model_and_dataset(model_dir, tmp_path, monkeypatch):
    """A hub-cache snapshot dir gives the model's revision; a hub dataset name gives the
    `datasets` fingerprint and info of what loaded (the hub itself is not reachable here, so the
    loader is replaced by an in-memory dataset with hub-like info)."""
    import datasets

    from harvest.pipeline.data import documents as data_mod
    from harvest.pipeline.data import provenance as pv
    from harvest.pipeline.config.corpus import DataConfig

    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / sha
    shutil.copytree(model_dir, snap)
    m = pv.model_provenance(str(snap), "org/tiny")
    assert m["revision"] == sha and m["weights_sha256"]
    info = datasets.DatasetInfo(dataset_name="org/pretok", config_name="default",
                                license="mit", download_checksums={"x.parquet": {"num_bytes": 3}})
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2]]}, info=info)
    monkeypatch.setattr(data_mod, "open_dataset", lambda cfg: (ds, None))
    cfg = DataConfig(source="org/pretok", format="hub", revision="v1", tokens_column="input_ids")
    d = pv.data_provenance(cfg, {"kind": "hub", "description": "hub:org/pretok"})
    assert d["hub"] == "org/pretok" and d["revision"] == "v1" and d["split"] == "train"
    assert d["fingerprint"] == ds._fingerprint
    assert d["dataset_info"]["license"] == "mit" and "x.parquet" in d["download_checksums"]


# ---- the dataset card ------------------------------------------------------------------------------

def test_finalized_store_card_matches_attributes_and_cli_refresh(tmp_path, capsys):
    from harvest.store import open_store
    from tests.support.reader_stores import make_store

    url = tmp_path / "store"
    s, *_ = make_store(url, 1024, 256, points=("resid_post.0", "resid_post.2"), context=64,
                       attrs={"config": {"model": {"path": "org/model", "backend": "eager"},
                                         "packing": {"context_size": 64}},
                              "provenance": {
                                  "data": {"kind": "hub", "source": "org/corpus", "split": "train",
                                           "column": "input_ids",
                                           "dataset_info": {"license": "mit"}},
                                  "token_source": {"column": "input_ids",
                                                   "original_dataset": "org/raw-text"}}})
    s.finalize({"status": "complete"})
    text = (url / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    st = open_store(str(url))
    a = st.attributes
    h = front["harvest"]
    assert h["points"] == st.points and h["width"] == st.width and h["dtype"] == st.dtype
    assert h["rows"] == a["committed_rows"] == 1024 and h["tokens"] == 1024
    assert h["stored_bytes"] == a["compression_ratio"]["stored_bytes"]
    assert h["compression_ratio"] == a["compression_ratio"]["overall"]
    assert h["model"] == "org/model" and front["size_categories"] == ["1K<n<10K"]
    assert front["license"] == "mit" and front["source_datasets"] == ["org/corpus", "org/raw-text"]
    assert h["context_size"] == st.context_size
    assert "1,024" in text and "resid_post.2" in text and "![harvest report]" not in text
    kept = a["stats_kept"]["resid_post.0"]
    assert f"{kept['mean_sq_norm']:.4g}" in text
    # the report's picture appears once `harvest card` refreshes the card
    (url / "_report").mkdir()
    (url / "_report" / "report.png").write_bytes(b"\x89PNG")
    assert cli.main(["card", str(url)]) == 0
    assert "![harvest report](_report/report.png)" in (url / "README.md").read_text()
    capsys.readouterr()


def test_card_refuses_unfinalized_store(tmp_path, capsys):
    from tests.support.reader_stores import make_store

    make_store(tmp_path / "store", 512, 256)
    assert cli.main(["card", str(tmp_path / "store")]) == 2
    # (a console handler an earlier in-process `harvest` call left may print the store's
    # commit logs here too: only the command's own line counts)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("harvest card")]
    assert len(err) == 1 and "not finalized" in err[0]


def test_resaved_disk_dataset_is_a_changed_source(tmp_path):
    """A `save_to_disk` dir re-saved in place (same rows, other ids) is refused on resume: its
    recorded fingerprint no longer matches (the plan's sizes could not tell)."""
    import datasets

    from harvest.pipeline.data import provenance as pv
    from harvest.pipeline.config.corpus import DataConfig

    d = tmp_path / "pretok"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 4}).save_to_disk(str(d))
    cfg = DataConfig(source=str(d), tokens_column="input_ids")
    recorded = {"data": pv.data_provenance(cfg, {"kind": "disk"})}
    assert recorded["data"]["fingerprint"] and pv.fingerprint_changed(recorded, cfg) is None
    shutil.rmtree(d)
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 4]] * 4}).save_to_disk(str(d))
    msg = pv.fingerprint_changed(recorded, cfg)
    assert msg and recorded["data"]["fingerprint"] in msg
