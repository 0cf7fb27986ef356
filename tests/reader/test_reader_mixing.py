"""The shuffle-window warning: expected distinct documents per batch against a uniform shuffle."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from harvest.store.read.dataset import ActivationDataset
from tests.support.reader_stores import make_store

SHARD, K = 256, 256
N = 32 * SHARD


@pytest.fixture(scope="module")
def docs32(tmp_path_factory):
    """32 shards; documents of ~150 rows packed into 64-row contexts (known doc_id per row)."""
    s, _, _, doc, _ = make_store(tmp_path_factory.mktemp("m32") / "s.zarr", N, SHARD, 4, context=64,
                                 seed=2)
    return s, doc


def _distinct(batches) -> float:
    """Mean distinct documents (doc_id >= 0) over full batches."""
    return float(np.mean([len(np.unique(d[d >= 0])) for d in batches if len(d) == K]))


def _figures(msg: str) -> tuple[float, float, int]:
    got, uniform = map(float, re.search(r"hold (\d+) distinct documents against (\d+)", msg).groups())
    return got, uniform, int(re.search(r"shuffle_buffer_rows=(\d+) \(", msg).group(1))


def test_eight_of_32_shards_warns_with_the_figures_and_the_buffer_that_reaches_half(docs32):
    """Before: no warning at 8 shards (the old rule warned below 8 whatever the documents)."""
    s, doc = docs32
    with pytest.warns(UserWarning, match="below half") as rec:
        ds = ActivationDataset(s, batch_size=K, shuffle_buffer_rows=8 * SHARD, return_meta=True, seed=3)
    got, uniform, need = _figures(str(rec[0].message))
    assert "harvest shuffle SRC DST" in str(rec[0].message)   # the way to uniform mixing
    # independent references: the reader's own batches, and uniform permutations of doc_id
    measured = _distinct([b["doc_id"].numpy() for b in ds])
    rng = np.random.default_rng(0)
    ideal = np.mean([_distinct(np.array_split(doc[rng.permutation(N)], N // K)) for _ in range(3)])
    assert measured < ideal / 2
    assert abs(got - measured) <= 0.15 * measured, (got, measured)
    assert abs(uniform - ideal) <= 0.15 * ideal, (uniform, ideal)
    # the buffer it names reaches half: no warning there, and the batches do hold half
    assert 8 * SHARD < need <= N
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ActivationDataset(s, batch_size=K, shuffle_buffer_rows=need, return_meta=True, seed=3)
    assert _distinct([b["doc_id"].numpy() for b in ds]) >= 0.45 * ideal


def test_workers_narrow_each_window_and_the_loader_says_so(docs32):
    s = docs32[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ActivationDataset(s, batch_size=K, shuffle_buffer_rows=32 * SHARD, seed=3, rank=0,
                               world_size=2)   # a rank's window: its 16 shards, enough
    with pytest.warns(UserWarning, match="each of 4 ranks x workers") as rec:
        ds.loader(2)                           # a worker's window: 8 shards, too few
    assert "more than a worker's share of 8" in str(rec[0].message)


# ---- describe(): the same figures, for the user's own store and options -------------------------

def _recount(batches: list[np.ndarray]) -> dict:
    """Independent recount over real batches' doc ids: distinct documents, consecutive same-
    document rate, Pearson lag-1 correlation of doc ids (pairs within a batch, both >= 0)."""
    full = [d for d in batches if len(d) == K]
    xs, ys = [], []
    for d in full:
        for a, b in zip(d[:-1].tolist(), d[1:].tolist()):
            if a >= 0 and b >= 0:
                xs.append(a)
                ys.append(b)
    return {"distinct_docs": _distinct(full),
            "lag1_same_doc": float(np.mean([np.mean(d[1:] == d[:-1]) for d in full])),
            "lag1_doc_autocorr": float(np.corrcoef(xs, ys)[0, 1])}


@pytest.mark.parametrize("shuffle", [True, "global"], ids=["window", "global"])
def test_describe_matches_a_recount_of_the_batches_the_reader_yields(docs32, shuffle):
    s, doc = docs32
    kw = {"batch_size": K, "seed": 3, "shuffle": shuffle, "shuffle_buffer_rows": 4 * SHARD,
          "exclude_token_ids": [1]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = ActivationDataset(s, **kw)
        d = ds.describe(num_workers=2, batches=6)
        real = [b["doc_id"].numpy() for b in ActivationDataset(s, return_meta=True, **kw).loader(2)]
    got = _recount(real[0::2][:6])       # lane 0: the loader's even batches
    sim = d["simulated"]
    assert sim["batches"] == 6
    for key, v in got.items():
        assert sim[key] == pytest.approx(v, rel=1e-9), key
    assert d["uniform_distinct_docs"] > 0 and d["shards"] == 32 and d["ranks_x_workers"] == 2
    if shuffle == "global":
        # uniform by construction; the blocks of 4 shards' rows each read every shard
        assert d["vs_uniform"] == 1.0 and sim["vs_uniform"] > 0.8
        assert d["shard_reads_vs_window"] > 4
        assert abs(sim["lag1_doc_autocorr"]) < 0.2
    else:
        # 4-shard windows: well under uniform, as the warning says
        assert d["window_shards"] == 4 and d["vs_uniform"] < 0.5 and sim["vs_uniform"] < 0.6
