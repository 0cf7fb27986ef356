"""The normalisation contract: `norm_scale` gives E||x||^2 = width over every row the reader
yields, whatever its filter, on a store whose sinks make any other choice of rows far off.

The store is built as the pipeline builds one (special ids, BOS, `stats_skip_positions: 2` in the
format attributes, kept statistics from the writers): each context starts with a BOS row 1,000x
the median norm, and position 1 holds a sink 60x the median in one context of four (SmolLM2's
layer 20: ~1e4x at position 0, ~20x at position 1 in 1.5-2 % of contexts). The store's kept
statistics (positions >= 2, no specials) scaled a reader that also yields position 1 to
E||x||^2 ~ 9-10 x the width here: the silent mismatch this contract rules out.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from harvest.store import create_store, open_store
from harvest.store.read.dataset import ActivationDataset
from harvest.testing import synthetic
from tests.support.reader_stores import BOS, packed_meta

W, C, N, SHARD = 32, 64, 64 * 64, 512
EOS = 2
POINTS = ["resid_post.3", "resid_post.20"]


@pytest.fixture(scope="module")
def sink_store(tmp_path_factory):
    tok, doc, pos = packed_meta(N, C, mean_doc=40, seed=3)
    tok[np.flatnonzero(doc >= 0)[::97]] = EOS          # a few other special tokens
    x = synthetic.activations((len(POINTS), N, W), seed=4).astype(np.float32)
    ctx_pos = np.arange(N) % C
    x[:, ctx_pos == 0] *= 1000.0                        # BOS: the first sink
    sinks = np.flatnonzero((ctx_pos == 1) & (np.arange(N) // C % 4 == 0))
    x[:, sinks] *= 60.0                                 # position 1: a sink in 1 context of 4
    data = x.astype(ml_dtypes.bfloat16)
    s = create_store(str(tmp_path_factory.mktemp("norm") / "s.zarr"), points=POINTS, width=W,
                     n_rows=N, shard_rows=SHARD, chunk_rows=128, context_size=C,
                     special_token_ids=[BOS, EOS], bos_token_id=BOS, stats_skip_positions=2,
                     attrs={"config": {"packing": {"context_size": C, "bos": "context"}}})
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, data, token_id=tok, doc_id=doc, position=np.where(doc < 0, -2, pos))
    s.finalize({"status": "complete"})
    return open_store(s.url), data.astype(np.float64), tok


def _yielded(ds):
    out = list(ds)
    y = torch.cat([b["acts"] for b in out]).double().numpy()
    return y, np.concatenate([b["row"].numpy() for b in out])


def _msq(y: np.ndarray) -> np.ndarray:
    """E||y||^2 per point over every row given: [rows, points, width] -> [points]."""
    return (y * y).sum(-1).mean(0)


def test_the_documented_usage_gives_the_width_over_every_row_yielded(sink_store):
    """`exclude_special=True, normalize="norm_scale"` (README, docs/store.md, the card) yields
    the store's kept rows and takes the kept statistics for them: exact."""
    store, x, tok = sink_store
    ds = ActivationDataset(store, points=POINTS, batch_size=500, exclude_special=True,
                           normalize="norm_scale", return_meta=True)
    assert ds.norm_constants.source == "store:kept"
    y, rows = _yielded(ds)
    kept = ~np.isin(tok, [BOS, EOS]) & (np.arange(N) % C >= 2)
    assert np.array_equal(np.sort(rows), np.flatnonzero(kept))
    np.testing.assert_allclose(_msq(y), W, rtol=1e-5)
    # what the same constants gave the rows a reader yielded before (position 1 kept): far off
    before = ~np.isin(tok, [BOS, EOS]) & (np.arange(N) % C >= 1)
    scale = ds.norm_constants.scale[:, 0].double().numpy()
    off = (x[:, before] ** 2).sum(-1).mean(1) * scale ** 2
    assert (off > 5 * W).all(), off / W   # 9-10x the width


@pytest.mark.parametrize("seqpos", [slice(1, None), slice(5, 60, 2)], ids=["with-sinks", "later"])
def test_a_seqpos_filter_gives_the_width_over_its_own_rows(sink_store, seqpos):
    """Any other filter: constants from the reader's own filtered rows (a sample that covers this
    store), exact over every row it yields, the position-1 sinks included where it keeps them
    (and then a warning that they set the scale)."""
    store, x, tok = sink_store
    kw = dict(points=POINTS, batch_size=500, exclude_special=True, seqpos=seqpos,
              normalize="norm_scale", return_meta=True)
    if seqpos.start == 1:
        with pytest.warns(UserWarning, match=r"keeps context position\(s\) 1 "):
            ds = ActivationDataset(store, **kw)
    else:
        ds = ActivationDataset(store, **kw)
    assert ds.norm_constants.source == "sample"
    y, rows = _yielded(ds)
    assert ds.norm_constants.rows == len(rows)
    np.testing.assert_allclose(_msq(y), W, rtol=1e-5)
    np.testing.assert_allclose(ds.norm_constants.mean_sq_norm, (x[:, rows] ** 2).sum(-1).mean(1),
                               rtol=1e-9)


def test_the_full_recipe_of_docs_store_md(sink_store):
    """docs/store.md's reader (split, norm filter): the constants are the surviving train rows'."""
    store, _, _ = sink_store
    ds = ActivationDataset(store, points=POINTS, batch_size=500, seed=0, exclude_special=True,
                           seqpos=slice(2, None), max_norm_ratio=10, split="train",
                           normalize="norm_scale", return_meta=True)
    y, _ = _yielded(ds)
    np.testing.assert_allclose(_msq(y), W, rtol=1e-5)


def test_ranks_and_a_rebuilt_reader_share_the_constants(sink_store):
    """Every rank builds the same constants (the store's, or a sample seeded alike over every
    committed row, whatever the rank), and a resumed run's new reader builds them again."""
    store, _, _ = sink_store
    for kw in (dict(exclude_special=True), dict(exclude_special=True, seqpos=slice(3, None))):
        made = [ActivationDataset(store, points=POINTS, batch_size=256, rank=r, world_size=2,
                                  normalize="norm_scale", return_meta=True, **kw) for r in (0, 1, 0)]
        for d in made[1:]:
            assert torch.equal(d.norm_constants.scale, made[0].norm_constants.scale)
        y = np.concatenate([_yielded(d)[0] for d in made[:2]])
        np.testing.assert_allclose(_msq(y), W, rtol=1e-3)   # (the epoch's last N mod 2 rows out)
