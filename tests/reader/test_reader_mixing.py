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
