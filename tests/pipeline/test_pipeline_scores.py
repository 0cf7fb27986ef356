"""A run with `capture.points: [resid_post.*, logprob, entropy]` (2 actors, the eager backend):
the points' arrays are the ones a run without the scores writes, and the store has float32
`logprob` / `entropy` row columns equal to the model's own scores of each context's rows (NaN at
each context's last position), read back by the training reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import CONTEXT, EAGER_VLLM, check_store, make_cfg

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]


@pytest.mark.parametrize("backend", ["eager", "vllm"])
def test_run_stores_scores_beside_the_points(ray_cluster, tiny_llama, corpus, reference, tmp_path,
                                             backend):
    """Eager actors: the columns equal the eager model's own scores. vLLM freeze actors (Model
    Runner V1, compilation off): within bf16-across-backends of them, and the model check of
    actor 0 covered the scores too."""
    from harvest.engine import load_model, run_with_cache

    vllm = backend == "vllm"
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, f"model.backend={backend}",
                   *((EAGER_VLLM, "model.max_num_batched_tokens=256",
                      "model.gpu_memory_utilization=0.1") if vllm else ()),
                   capture={"points": ["resid_post.*", "logprob", "entropy"]})
    run(cfg)
    store = open_store(cfg.store.resolved_url)
    check_store(store, reference, rel_tol=0.03 if vllm else None)   # the points as without scores
    assert "logprob.0" not in store.points
    assert store.meta_columns["logprob"] == store.meta_columns["entropy"] == "float32"
    lp = np.asarray(store.meta_array("logprob")[:])
    ent = np.asarray(store.meta_array("entropy")[:])
    last = np.arange(store.n_rows) % CONTEXT == CONTEXT - 1
    assert np.isnan(lp[last]).all() and not np.isnan(lp[~last]).any() and np.isfinite(ent).all()
    tok = store.read_row_meta(0, store.n_rows)[0]
    m = load_model(tiny_llama, backend="eager")
    try:
        got = run_with_cache(m, tok.reshape(-1, CONTEXT).tolist(), ["logprob.0", "entropy.0"])
    finally:
        m.close()
    want_lp = torch.cat([g["logprob.0"] for g in got]).numpy()
    want_ent = torch.cat([g["entropy.0"] for g in got]).numpy()
    tol = 0.1 if vllm else 2e-3   # nats: bf16 logits across backends
    np.testing.assert_allclose(lp, want_lp, atol=tol, rtol=0)
    np.testing.assert_allclose(ent, want_ent, atol=tol, rtol=0)
    if vllm:
        check = store.attrs["model_check"]
        assert check["ok"] and {"logprob.0", "entropy.0"} <= set(check["points"]), check
    from harvest.store.read.dataset import ActivationDataset

    b = next(iter(ActivationDataset(store, "resid_post.0", batch_size=64, return_meta=True)))
    assert b["logprob"].dtype == torch.float32
    rows = b["row"].numpy()
    assert np.array_equal(b["entropy"].numpy(), ent[rows])
