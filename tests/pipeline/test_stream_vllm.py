"""A streamed run on vLLM freeze actors with a tee (issue 49): the engine writes each row in
place into the store's shard buffer and the stream hands the trainers those very bits
(HarvestActor._deliver's in-place path, outbox.Outbox.context_rows' `view`); every streamed row
equals the row the tee's store holds, and the store verifies."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from harvest.store import open_store
from tests.support.pipeline import EAGER_VLLM, make_cfg
from tests.support.stream_rank import read_rank

pytestmark = pytest.mark.slow  # Ray + vLLM engines: the engine worker runs it

OPTS = {"points": "resid_post.1", "batch_size": 64, "return_meta": True, "exclude_special": True,
        "seqpos": [2, None], "shuffle_buffer_rows": 256}


def test_a_tee_on_vllm_streams_the_rows_it_writes_in_place(ray_cluster, tiny_llama, corpus,
                                                           tmp_path):
    url = str(tmp_path / "store")
    cfg = make_cfg(tiny_llama, url, corpus, EAGER_VLLM, "model.backend=vllm",
                   "capture.check_model=false", "stream.tee=true", "stream.linger_s=10",
                   f"stream.name=v{uuid.uuid4().hex[:10]}")
    out: dict = {}
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, read_rank(cfg, r, 2, OPTS)))
          for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert set(out) == {0, 1}
    assert out[0]["summary"]["per_actor"][0]["rows_in_place"] is not None
    store = open_store(url)
    assert store.verify(objects=True).ok
    full = np.asarray(store.read("resid_post.1", 0, store.n_rows)).view(np.int16)
    rows = np.concatenate([out[r]["rows"] for r in (0, 1)])
    acts = np.concatenate([out[r]["acts"] for r in (0, 1)])
    assert len(out[0]["rows"]) == len(out[1]["rows"]) and len(np.unique(rows)) == len(rows)
    assert (acts == full[rows]).all()
    assert sum(a["rows_in_place"] for a in out[0]["summary"]["per_actor"]) == store.n_rows
