"""The data plane on the test cluster: a corpus cut into many blocks, tokenised by 1 or 3 workers,
gives the same rows (those of packing each block on its own, from documents read by `datasets`)
and the same activations."""

from __future__ import annotations

import numpy as np
import pytest

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import assert_store_matches, make_cfg, reference_block_rows

# a Ray pipeline run (eager): not in `pytest -m 'not slow'`; beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]

OVERRIDES = ("data.block_bytes=4096", "packing.chunk_tokens=256", "ray.num_actors=1")


def test_same_rows_with_one_and_three_tokenising_workers(ray_cluster, tiny_llama, corpus, tmp_path):
    stores, events = {}, {}
    for workers in (1, 3):
        cfg = make_cfg(tiny_llama, str(tmp_path / f"w{workers}"), corpus, *OVERRIDES,
                       f"ray.tokenize_workers={workers}")
        events[workers] = []
        s = run(cfg, on_event=events[workers].append)
        assert s["blocks"] > 50 and s["verified"]["ok"]
        stores[workers] = open_store(cfg.store.resolved_url)
    ref = reference_block_rows(cfg, corpus)
    pids = {w: {e["pid"] for e in ev if e["event"] == "chunk"} for w, ev in events.items()}
    assert len(pids[1]) == 1 and len(pids[3]) == 3  # three workers really shared the blocks
    blocks = {e["block"] for e in events[3] if e["event"] == "chunk" and e["kept"]}
    assert len(blocks) >= 3  # the rows span several blocks (each packed on its own)
    for w, st in stores.items():
        assert st.n_rows == ref.n_rows == 6144
        tok, doc, pos = st.read_row_meta(0, st.n_rows)
        assert np.array_equal(tok, ref.token_ids), w
        assert np.array_equal(doc, ref.doc_ids), w
        assert np.array_equal(pos, ref.positions), w
        assert st.verify(deep=True).ok
    a = {p: np.asarray(stores[1].read(p, 0, 6144)) for p in stores[1].points}
    assert_store_matches(stores[3], a)  # same tokens in the same rows: same activations, bit for bit
