"""Late validation made early: each case is a one-line error, exit code 2, and nothing written
(no store directory), found before Ray starts. Once they were found after the store was created
(a dead end: the fixed config was refused as drift), after the actors started, or never (a
duplicated YAML section was silently dropped); one 30 MB document was tokenised whole (6.3 GB).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from harvest.pipeline.cli.main import main
from harvest.pipeline.config.run import PackingConfig
from harvest.pipeline.data.corpus_blocks import plan_blocks, read_block


@pytest.fixture
def docs(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(20)))
    return p


def _config(tmp_path, model, data, store, extra: str = "") -> str:
    cfg = tmp_path / f"run-{uuid.uuid4().hex[:6]}.yaml"
    cfg.write_text(f"model: {{path: {model}, backend: eager}}\n"
                   f"data: {{source: {data}}}\n"
                   f"packing: {{context_size: 32, max_tokens: 512}}\n"
                   f"store: {{url: {store}}}\nprogress: false\n{extra}")
    return str(cfg)


def _refused(capsys, argv: list[str], match: str) -> str:
    t0 = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error line"
    assert err[-1].startswith("harvest run: error: "), err[-3:]
    import re

    assert re.search(match, err[-1]), err[-1]
    assert time.monotonic() - t0 < 60  # before Ray and actors (they take longer than this here)
    return err[-1]


@pytest.mark.parametrize("setting, match", [
    ("packing.bos_token_id=100000", r"packing.bos_token_id=100000 is outside the model's vocabulary"),
    ("store.compression=lzma9000", r"store.compression='lzma9000' is unknown: use one of"),
    ("store.compression={codec: blosc, cname: zstd, clevel: 42}", r"store.compression clevel=42"),
    ("packing.max_doc_tokens=0", r"packing.max_doc_tokens must be >= 1"),
    ("store.timeout_s=0", r"store.timeout_s must be"),
])
def test_bad_setting_is_one_line_exit_2_nothing_written(tiny_llama, docs, tmp_path, capsys,
                                                         setting, match):
    store = tmp_path / "store"
    _refused(capsys, ["run", "--config", _config(tmp_path, tiny_llama, docs, store), "--set",
                      setting], match)
    assert not store.exists()


def test_duplicated_yaml_section_is_refused(tiny_llama, docs, tmp_path, capsys):
    store = tmp_path / "store"
    cfg = _config(tmp_path, tiny_llama, docs, store, "packing: {context_size: 64}\n")
    _refused(capsys, ["run", "--config", cfg], r"'packing' is written twice \(lines 3 and 6\)")
    # a key twice inside one section too
    cfg = _config(tmp_path, tiny_llama, docs, store)
    text = open(cfg).read().replace("store: {url:", "store: {shard_rows: 64, shard_rows: 128, url:")
    open(cfg, "w").write(text)
    _refused(capsys, ["run", "--config", cfg], r"'shard_rows' is written twice")
    assert not store.exists()


def test_non_utf8_config_file_is_refused(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"name: caf\xe9\n")
    _refused(capsys, ["run", "--config", str(cfg)], r"is not UTF-8 text")


def test_non_utf8_data(tiny_llama, tmp_path, capsys):
    """Read by our line readers, an undecodable row is skipped and counted; read through the
    `datasets` loader (streaming), which would die mid-run, the file is refused up front."""
    from harvest.pipeline.config.run import DataConfig

    bad = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(4)]
    bad.write_bytes(good[0] + b'{"text": "caf\xe9"}\n' + b"".join(good[1:]))
    cfg = DataConfig(source=str(bad))
    rows = [(r, reason) for r, _, _, reason in read_block(plan_blocks(cfg)["blocks"][0], cfg)]
    assert rows == [(0, None), (1, "bad_encoding"), (2, None), (3, None), (4, None)]

    store = tmp_path / "store"
    _refused(capsys, ["run", "--config", _config(tmp_path, tiny_llama, bad, store), "--set",
                      "data.streaming=true"], r"bad.jsonl is not UTF-8 \(byte 31\).*re-encode")
    assert not store.exists()


def test_unwritable_store_is_found_before_the_data_is_read(tiny_llama, tmp_path, capsys):
    """The store's first write (the driver's lease) comes before the data is even looked at:
    here the data source does not exist either, and the error is the store's."""
    store = f"/sys/fs/harvest-{uuid.uuid4().hex[:8]}/store"  # read-only even for root
    missing = tmp_path / "no-such-data.jsonl"
    _refused(capsys, ["run", "--config", _config(tmp_path, tiny_llama, missing, store)],
             r"store.url=/sys/fs/harvest-.*/store is not writable .*choose a writable directory")


def test_huge_document_is_tokenised_from_a_bounded_prefix(tiny_llama, tmp_path):
    """One 30 MB document with max_tokens=4096: only a prefix is tokenised, the tokens kept are
    the whole document's first 4096, and the document is counted as capped."""
    from transformers import AutoTokenizer

    from harvest.pipeline.data.tokenize import pack_block

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    seen: list[int] = []

    def counting(texts, **kw):
        seen.append(max(len(t) for t in (texts if isinstance(texts, list) else [texts])))
        return tok(texts, **kw)

    words = " ".join(f"w{i % 997}x{i % 13}" for i in range(200_000))
    huge = (words + "\n") * (30_000_000 // len(words))
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"text": huge}) + "\n" + json.dumps({"text": "a short one"}) + "\n")
    dcfg = __import__("harvest.pipeline.config.run", fromlist=["DataConfig"]).DataConfig(source=str(data))
    pcfg = PackingConfig(context_size=32, max_tokens=4096, bos="none")
    assert pcfg.doc_token_cap() == 4096
    block = plan_blocks(dcfg)["blocks"][0]
    t0 = time.monotonic()
    chunks = list(pack_block(0, block, dcfg, pcfg, counting, None, 1 << 10, 4096 // 32))
    took = time.monotonic() - t0
    ids = [int(t) for c in chunks for t in c.arrays()["token_id"]]
    whole_prefix = tok(huge[:200_000], add_special_tokens=False)["input_ids"]
    assert ids == whole_prefix[:4096]
    assert max(seen) < 200_000  # never more than a bounded prefix of the 30 MB text
    assert sum(c.describe().stats.get("docs_capped", 0) for c in chunks) == 1
    assert took < 20, took


def test_a_run_refuses_a_store_its_actors_cannot_share(tmp_path):
    """memory:// lives in one process; the actors are others: refused before anything is
    written, naming the backend and why (Storage.require)."""
    from harvest.pipeline.driver.sink import StoreSink
    from harvest.store import StoreAccessError
    from tests.support.pipeline import make_cfg

    cfg = make_cfg(str(tmp_path / "model"), f"memory://refuse-{tmp_path.name}/s", tmp_path)
    sink = StoreSink(cfg)
    with pytest.raises(StoreAccessError, match=r"memory storage .* lacks shared .* actors"):
        sink.on_write_start()
    assert sink.lease is None
