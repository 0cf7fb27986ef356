"""A run with `capture.points: [resid_post.*, expert_indices.*, expert_weights.*]` on a tiny
Mixtral with real routing (2 eager actors): the store holds the routing points as their int32 /
float32 values (layout 5, store/FORMAT.md "Points of 32-bit values"), equal to the model's own
router on each context, read back by `stored_routing`; no statistics of them; the training
reader reads resid_post by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.fixtures.models import tiny_model_path
from tests.support.pipeline import CONTEXT, make_cfg

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]


def test_run_stores_the_routing_as_values(ray_cluster, corpus, tmp_path):
    from harvest.engine import load_model, run_with_cache
    from harvest.store.read.dataset import ActivationDataset
    from harvest.store.read.routing import stored_routing

    path = tiny_model_path("mixtral", routing_neutral=False)
    cfg = make_cfg(path, str(tmp_path / "store"), corpus,
                   capture={"points": ["resid_post.*", "expert_indices.*", "expert_weights.*"]})
    run(cfg)
    store = open_store(cfg.store.resolved_url)
    assert store.layout_version == 5
    assert store.point_values["expert_indices.2"] == "int32"
    assert store.widths["expert_weights.0"] == 2 * 2   # top-2, two bfloat16 elements per value
    n = store.n_rows
    tok = store.read_row_meta(0, n)[0]
    m = load_model(path, backend="eager")
    try:
        got = run_with_cache(m, tok.reshape(-1, CONTEXT).tolist(),
                             [f"{p}.{li}" for li in range(4) for p in ("expert_indices",
                                                                       "expert_weights")])
    finally:
        m.close()
    for li in range(4):
        ids, w = stored_routing(store, li, 0, n)
        want_ids = torch.cat([g[f"expert_indices.{li}"] for g in got]).long()
        want_w = torch.cat([g[f"expert_weights.{li}"] for g in got])
        # the same eager backend, one thread per actor: the same bits
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w), li
        assert bool((w[:, 0] >= w[:, 1]).all()) and np.allclose(w.sum(-1).numpy(), 1, atol=1e-2)
    assert store.stats(["expert_indices.0"])["expert_indices.0"]["count"] == 0
    assert store.stats(["resid_post.0"])["resid_post.0"]["count"] == n
    ds = ActivationDataset(store, None, batch_size=64)
    assert ds.points == [f"resid_post.{i}" for i in range(4)]
