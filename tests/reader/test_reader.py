"""The SAE-training reader: exactly once, bit-exact rows, seeded shuffles mixed inside each batch."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from harvest.store import create_store
from harvest.store.read.config import ReaderConfig
from harvest.store.read.dataset import ActivationDataset
from harvest.testing import synthetic
from tests.support.reader_stores import BOS, committed_rows, make_store

P, W, N, SHARD, C = 2, 16, 5000, 512, 100   # 10 shards, the last one partial (392 rows)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("r") / "r.zarr", N, SHARD, W, ["resid_post.0", "resid_post.1"],
                      context=C, seed=11, uncommitted=(3, 7))


@pytest.fixture(scope="module")
def store(built):
    return built[0]


@pytest.fixture(scope="module")
def data(built):
    return built[1]


def _rows(ds, num_workers=0, **kw):
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers, **kw))
    return batches, np.concatenate([b["row"].numpy() for b in batches])


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def test_every_committed_row_once_with_its_own_activations(store, data, built):
    """One process reads every committed row exactly once; uncommitted units never appear."""
    ds = ActivationDataset(store, batch_size=300, seed=5, return_meta=True, shuffle_buffer_rows=4 * SHARD)
    batches, rows = _rows(ds)
    tok, doc, pos = built[2:]
    for b in batches:
        assert b["acts"].shape[1:] == (P, W) and b["acts"].dtype == torch.bfloat16
        r = b["row"].numpy()
        want = np.stack([data[p][r] for p in range(P)], axis=1).view(np.uint16)
        assert np.array_equal(_bits(b["acts"]), want)
        assert np.array_equal(b["token_id"].numpy(), tok[r])
        assert np.array_equal(b["doc_id"].numpy(), doc[r]) and np.array_equal(b["position"].numpy(), pos[r])
    assert [b["acts"].shape[0] for b in batches[:-1]] == [300] * (len(batches) - 1)
    assert np.array_equal(np.sort(rows), committed_rows(store))


def test_seed_reproduces_and_epochs_reshuffle(store):
    def order(seed, epoch=0, **kw):
        ds = ActivationDataset(store, batch_size=256, seed=seed, return_meta=True, shuffle_buffer_rows=8 * SHARD,
                               **kw)
        ds.set_epoch(epoch)
        return _rows(ds)[1]

    a, b = order(1), order(1)
    assert np.array_equal(a, b)
    c, d = order(2), order(1, epoch=1)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)
    for o in (a, c, d):
        assert np.array_equal(np.sort(o), committed_rows(store))
    seq = order(0, shuffle=False)
    assert np.array_equal(seq, committed_rows(store))


def test_each_batch_mixes_its_window_shards_in_random_order(store):
    """A batch is a uniform draw from its whole window, interleaved: consecutive rows come from
    the same shard about as often as in a uniform draw, not in runs per shard (0.19 vs 0.003 on
    a real store before)."""
    ds = ActivationDataset(store, batch_size=512, seed=3, return_meta=True, shuffle_buffer_rows=8 * SHARD)
    first = next(iter(ds))["row"].numpy()
    shards = first // SHARD
    assert len(np.unique(shards)) == 8  # the whole window (all 8 committed shards) in one batch
    counts = np.bincount(shards)
    ideal = float(((counts / counts.sum()) ** 2).sum())  # P(two random rows share a shard)
    lag1 = float((shards[1:] == shards[:-1]).mean())
    assert lag1 < 1.6 * ideal, (lag1, ideal)
    seq = next(iter(ActivationDataset(store, batch_size=512, shuffle=False, return_meta=True)))["row"].numpy()
    assert (seq[1:] // SHARD == seq[:-1] // SHARD).mean() > 0.99  # the same check fails unshuffled


def test_epochs_reuse_arenas_and_stay_exact(store, data):
    """Epoch 2 decodes into epoch 1's arenas (fresh memory is slow), with identical rows."""
    ds = ActivationDataset(store, batch_size=256, seed=3, return_meta=True, shuffle_buffer_rows=3 * SHARD)
    kept = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        rows, acts = [], []
        for b in ds:
            rows.append(b["row"].numpy())
            acts.append(_bits(b["acts"]))
        rows, acts = np.concatenate(rows), np.concatenate(acts)
        assert np.array_equal(np.sort(rows), committed_rows(store))
        assert np.array_equal(acts, data.view(np.uint16)[:, rows].transpose(1, 0, 2))
        kept.append(list(ds._arenas._bufs))  # references, so no id can be reused meanwhile
    assert all(b is not None for b in kept[0]) and [id(b) for b in kept[1]] == [id(b) for b in kept[0]]
    clone = pickle.loads(pickle.dumps(ds))  # spawn-started DataLoader workers get a pickled copy
    assert clone._arenas is None and clone._store is None
    assert np.array_equal(np.sort(_rows(clone)[1]), committed_rows(store))


def test_single_point_batches_and_drop_last(store, data):
    ds = ActivationDataset(store, points="resid_post.1", batch_size=400, seed=3, return_meta=True)
    b = next(iter(ds))
    assert b["acts"].shape == (400, W)
    assert np.array_equal(_bits(b["acts"]), data[1][b["row"].numpy()].view(np.uint16))
    plain = list(ActivationDataset(store, points="resid_post.1", batch_size=400, drop_last=True))
    assert all(isinstance(t, torch.Tensor) and t.shape == (400, W) for t in plain)
    assert len(plain) == len(committed_rows(store)) // 400


def test_small_buffer_warns(store):
    with pytest.warns(UserWarning, match="below half"):
        ActivationDataset(store, batch_size=100, shuffle_buffer_rows=SHARD)


def test_reader_argument_errors(store):
    with pytest.raises(ValueError, match="'resid_post.9' is not in the store"):
        ActivationDataset(store, points=["resid_post.9"])
    with pytest.raises(ValueError, match="normalize='zscore'"):
        ActivationDataset(store, normalize="zscore")
    with pytest.raises(ValueError, match="rank=2 must satisfy"):
        ActivationDataset(store, rank=2, world_size=2)
    with pytest.raises(ValueError, match="shuffle_buffer_rows=10 must be >= batch_size=100"):
        ActivationDataset(store, batch_size=100, shuffle_buffer_rows=10)
    with pytest.raises(ValueError, match="records no special_token_ids"):
        ActivationDataset(store, exclude_special=True)
    with pytest.raises(ValueError, match="split='dev'"):
        ActivationDataset(store, split="dev")
    with pytest.raises(ValueError, match="max_norm_ratio=0.5"):
        ActivationDataset(store, max_norm_ratio=0.5)


def test_reader_config_is_the_keyword_form(store):
    """config=ReaderConfig(...) and the same options as keywords read the same batches, in order;
    both at once, an unknown option or a bad value (checked when the config is made, no store
    needed) are errors naming the field."""
    kw = dict(points="resid_post.1", batch_size=300, seed=5, return_meta=True, shuffle_buffer_rows=4 * SHARD,
              exclude_token_ids=[BOS])
    by_kw = ActivationDataset(store, **kw)
    by_cfg = ActivationDataset(store, config=ReaderConfig(**kw))
    assert by_kw.config == by_cfg.config
    a, b = list(by_kw), list(by_cfg)
    assert len(a) == len(b) > 1
    for x, y in zip(a, b):
        assert np.array_equal(x["row"].numpy(), y["row"].numpy())
        assert np.array_equal(_bits(x["acts"]), _bits(y["acts"]))
    assert BOS not in np.concatenate([x["token_id"].numpy() for x in a])
    with pytest.raises(ValueError, match="not both"):
        ActivationDataset(store, "resid_post.1", config=ReaderConfig())
    with pytest.raises(TypeError, match="unknown ReaderConfig field.*batchsize.*batch_size"):
        ActivationDataset(store, batchsize=64)
    for bad, match in (({"batch_size": 0}, "batch_size=0 must be a positive number of rows"),
                       ({"steps": 2.5}, "steps=2.5 must be a positive number of batches"),
                       ({"roles": "assistant"}, r"roles='assistant': give a list"),
                       ({"split": "dev"}, "split='dev'"),
                       ({"normalize": "zscore"}, "normalize='zscore'"),
                       ({"batch_size": 100, "shuffle_buffer_rows": 10}, "shuffle_buffer_rows=10 must be >=")):
        with pytest.raises(ValueError, match=match):
            ReaderConfig(**bad)


def test_seqpos_needs_a_context_size(tmp_path):
    s = create_store(str(tmp_path / "s.zarr"), points=["resid_post.0"], width=8, n_rows=256, shard_rows=128)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, synthetic.activations((1, 256, 8)), token_id=np.arange(256, dtype=np.int32))
    with pytest.raises(ValueError, match="pass context_size="):
        ActivationDataset(s, seqpos=slice(1, None))
    ds = ActivationDataset(s, seqpos=slice(1, None), context_size=64, batch_size=64, return_meta=True)
    rows = np.concatenate([b["row"].numpy() for b in ds])
    assert np.array_equal(np.sort(rows), np.flatnonzero(np.arange(256) % 64 != 0))


def test_store_package_imports_without_torch_ray_or_vllm():
    code = ("import sys, harvest.store, harvest.store.read.filters, "
            "harvest.store.read.shuffle.sampling; "
            "bad = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reads_from_s3_with_prefetch(seaweedfs, s3_url):
    x = synthetic.activations((1, 3000, 32), seed=12)
    s = create_store(s3_url, points=["resid_post.4"], width=32, n_rows=3000, shard_rows=512, chunk_rows=128,
                     storage_options=seaweedfs.storage_options)
    s.ledger.write_plan(s.ledger.default_plan(2))
    synthetic.fill(s, x, token_id=np.arange(3000, dtype=np.int32) % 7)
    ds = ActivationDataset(s3_url, storage_options=seaweedfs.storage_options, batch_size=256,
                           prefetch_shards=3, return_meta=True, seed=9, exclude_token_ids=[BOS])
    batches, rows = _rows(ds, num_workers=2)
    want = np.flatnonzero(np.arange(3000) % 7 != BOS)
    # 2 workers: equal shares, the odd row out (if any) dropped
    assert len(rows) == len(want) // 2 * 2 and np.isin(rows, want).all() and len(np.unique(rows)) == len(rows)
    for b in batches:
        assert np.array_equal(_bits(b["acts"]), x[0][b["row"].numpy()].view(np.uint16))


def test_format_md_bfloat16_snippet_reads_a_store_with_plain_zarr(tmp_path):
    """The FORMAT.md lines for zarr-python users, run as written (no harvest import) on a store."""
    import re
    from pathlib import Path

    fmt = (Path(__file__).resolve().parents[2] / "store" / "FORMAT.md").read_text()
    [code] = [c for c in re.findall(r"```python\n(.*?)```", fmt, re.S) if "BFloat16" in c]
    assert "import harvest" not in code and "from harvest" not in code
    n, w = 5000, 32
    x = synthetic.activations((1, n, w), seed=4)
    s = create_store(str(tmp_path / "s.zarr"), points=["resid_post.10"], width=w, n_rows=n, shard_rows=2048)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, x, token_id=np.arange(n, dtype=np.int32) + 7)
    np.save(tmp_path / "want.npy", x[0, :4096].view(np.uint16))
    code = code.replace('STORE = "path/to/store"', f"STORE = {str(tmp_path / 's.zarr')!r}")
    code += (f"\nassert np.array_equal(x.view(np.uint16), np.load({str(tmp_path / 'want.npy')!r}))"
             "\nassert np.array_equal(token_id, np.arange(4096) + 7)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path))
