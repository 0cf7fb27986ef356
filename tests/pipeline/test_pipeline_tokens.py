"""A SAELens pre-tokenised dataset through the whole pipeline (Ray, the eager engine, a local
store): stored `token_id` equals the dataset's `input_ids` row for row, the finalized store's
README.md parses and its figures equal the store's attributes, and the provenance is recorded.

The dataset is made by SAELens's own PretokenizeRunner in `.venv-trainers` when that venv is
there, else written by hand in the same format (a `save_to_disk` dir with an `input_ids` column
and a `sae_lens.json` naming the tokenizer). One short run."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import yaml

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import make_cfg
from tests.support.trainers import TRAINERS

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]  # eager Ray runs, no vLLM engine

C = 32
CONTEXTS = 24

SAELENS_SCRIPT = """
import sys
from sae_lens.config import PretokenizeRunnerConfig
from sae_lens.pretokenize_runner import PretokenizeRunner
tok, src, out, C = sys.argv[1:5]
PretokenizeRunner(PretokenizeRunnerConfig(
    tokenizer_name=tok, dataset_path="json", data_files=[src], split="train",
    context_size=int(C), column_name="text", shuffle=False, num_proc=1, save_path=out)).run()
"""


def _make_dataset(tokenizer_dir: str, tmp_path) -> tuple[str, str]:
    """(dataset dir, how it was made)."""
    from pydoc_data.topics import topics

    src = tmp_path / "text.jsonl"
    src.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:30]))
    out = tmp_path / "pretok"
    if TRAINERS.exists():
        subprocess.run([str(TRAINERS), "-c", SAELENS_SCRIPT, tokenizer_dir, str(src), str(out),
                        str(C)], check=True, timeout=300, capture_output=True)
        return str(out), "sae_lens"
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for line in src.read_text().splitlines():  # SAELens's default: BOS-separated, BOS-started rows
        ids += [tok.bos_token_id] + tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
    rows = [[tok.bos_token_id] + ids[i:i + C - 1] for i in range(0, len(ids) - C, C - 1)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(out))
    (out / "sae_lens.json").write_text(json.dumps({"tokenizer_name": tokenizer_dir,
                                                   "context_size": C}))
    return str(out), "by hand"


def test_pretokenised_dataset_captured_row_for_row(ray_cluster, tiny_llama, tmp_path):
    import datasets

    path, how = _make_dataset(tiny_llama, tmp_path)
    want = np.concatenate(datasets.load_from_disk(path).with_format("numpy")["input_ids"][:CONTEXTS])
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), path,
                   data={"tokens_column": "input_ids"},
                   packing={"context_size": C, "max_tokens": CONTEXTS * C},
                   store={"shard_rows": 8 * C}, ray={"num_actors": 1})
    summary = run(cfg)
    store = open_store(cfg.store.resolved_url)
    n = CONTEXTS * C
    assert summary["tokens"] == n == store.n_rows
    np.testing.assert_array_equal(_meta(store, "token_id", n), want, err_msg=how)
    doc = _meta(store, "doc_id", n)
    np.testing.assert_array_equal(doc, np.repeat(np.arange(CONTEXTS), C))  # one row, one context
    np.testing.assert_array_equal(_meta(store, "position", n), np.tile(np.arange(C), CONTEXTS))
    assert summary["packing"]["bos_inserted"] == 0

    prov = store.attrs["provenance"]
    assert prov["token_source"]["checked"] == "vocabularies compared"
    assert prov["token_source"]["tokenizer_name"] == tiny_llama
    assert prov["data"]["fingerprint"] and prov["data"]["files"][0]["sha256"]
    assert prov["model"]["weights_sha256"] and prov["model"]["tokenizer_sha256"]
    assert prov["harvest"]["content_key_sha256"]

    text = (tmp_path / "store" / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])["harvest"]
    a = store.attributes
    assert front["rows"] == a["committed_rows"] == n and front["points"] == store.points
    assert front["width"] == store.width and front["dtype"] == store.dtype
    assert front["context_size"] == C and front["contexts"] == CONTEXTS
    assert front["model_weights_sha256"] == prov["model"]["weights_sha256"]
    assert "pre-tokenised ids (<code>input_ids</code>" in text


def _meta(store, name: str, n: int) -> np.ndarray:
    import zarr

    return zarr.open_array(store=store.zarr_store, path=name, mode="r")[:n]
