"""Paired reading (store/read/paired.py): several row-aligned stores yield the same rows, each as
that store alone yields it; a misaligned pair is refused naming the unit, the column and the row.

The stores share their row metadata (the same packed contexts, as checkpoints of one capture do)
and differ in their activations (another seed: another model). The reference for every paired
batch is the single-store ActivationDataset with the same options and the store's own rows
read by Store.read at the batch's row ids.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from harvest.store import create_store
from harvest.store.commit.alignment import StoresNotAligned, check_aligned
from harvest.store.errors import DataIntegrityError
from harvest.store.read.adapters import crosscoder_data, dictionary_learning_data
from harvest.store.read.dataset import ActivationDataset
from harvest.store.read.paired import PairedDataset
from harvest.testing import synthetic
from tests.support.reader_stores import BOS, make_store, packed_meta

W, SHARD, C, N = 8, 256, 64, 7 * 256 - 64    # 7 shards, the last one partial
POINTS = ["resid_post.0", "resid_post.1"]


def _store(path, n=N, seed=0, tok_edit=None, plan=None, width=W, points=POINTS, attrs=None):
    """A committed store with packed_meta(seed=0) rows (the shared corpus) and activations of
    `seed`; `tok_edit=(row, new id)` changes one token; `plan`: units of that many shards;
    `attrs`: more run attributes."""
    s = create_store(str(path), points=points, width=width, n_rows=n, shard_rows=SHARD, chunk_rows=128,
                     attrs={"config": {"packing": {"context_size": C}}, "special_token_ids": [BOS],
                            "bos_token_id": BOS, **(attrs or {})})
    tok, doc, pos = packed_meta(n, C, seed=0)
    if tok_edit is not None:
        tok = tok.copy()
        tok[tok_edit[0]] = tok_edit[1]
    s.ledger.write_plan(s.ledger.default_plan(plan or 2))
    data = synthetic.activations((len(points), n, width), seed=seed)
    synthetic.fill(s, data, token_id=tok, doc_id=doc, position=pos)
    return s


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("paired")
    return _store(d / "base", seed=1), _store(d / "tuned", seed=2)


def _rows(batches):
    return np.concatenate([b["row"].numpy() for b in batches])


def _values(st, point, rows):
    x = np.asarray(st.read(point, 0, st.n_rows))[rows]
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)


OPTS = dict(batch_size=100, seed=5, shuffle_buffer_rows=3 * SHARD, exclude_special=True,
            seqpos=slice(2, None), split="train", test_fraction=0.2, return_meta=True)


def test_paired_rows_equal_each_store_alone_at_the_same_row_ids(pair):
    a, b = pair
    ds = ActivationDataset([a, b], "resid_post.1", **OPTS)
    assert isinstance(ds, PairedDataset) and ds.form == "stack" and ds.names == ["base", "tuned"]
    assert ds.alignment.by_digest == ds.alignment.units == 4 and ds.alignment.bytes_read == 0
    got = list(ds)
    rows = _rows(got)
    acts = torch.cat([g["acts"] for g in got])
    assert acts.shape == (len(rows), 2, W) and acts.dtype == torch.bfloat16
    for i, st in enumerate((a, b)):
        alone = list(ActivationDataset(st, "resid_post.1", **OPTS))
        assert np.array_equal(_rows(alone), rows)          # same rows, same order as alone
        assert torch.equal(torch.cat([x["acts"] for x in alone]), acts[:, i])
        assert torch.equal(_values(st, "resid_post.1", rows), acts[:, i])   # and what the store holds
    tok = torch.cat([g["token_id"] for g in got]).numpy()
    assert (tok != BOS).all() and len(np.unique(rows)) == len(rows) == ds.count_rows()
    assert not torch.equal(acts[:, 0], acts[:, 1])          # two models, not one read twice


def test_points_per_store_give_a_dict_and_normalisation_is_per_store(pair):
    a, b = pair
    ds = ActivationDataset([a, b], store_points=["resid_post.0", ["resid_post.0", "resid_post.1"]],
                           normalize="standardize", **OPTS)
    assert ds.form == "dict"
    got = list(ds)
    c0, c1 = ds.norm_constants
    alone = ActivationDataset(b, ["resid_post.0", "resid_post.1"], normalize="standardize", **OPTS)
    assert torch.equal(c1.shift, alone.norm_constants.shift) and not torch.equal(c0.shift, c1.shift[:1])
    x = torch.cat([g["acts"]["tuned"] for g in got])
    assert x.shape[1:] == (2, W)
    assert torch.equal(x, torch.cat([q["acts"] for q in alone]))
    # a held-out split takes the train split's constants, one per store
    test = ActivationDataset([a, b], store_points=["resid_post.0", ["resid_post.0", "resid_post.1"]],
                             normalize="standardize", norm_constants=ds.norm_constants,
                             **{**OPTS, "split": "test"})
    assert [c.source for c in test.norm_constants] == [c0.source, c1.source]
    assert not np.isin(_rows(list(test)), _rows(got)).any()


@pytest.mark.parametrize("workers", [0, 2])
def test_ddp_split_workers_and_resume_work_as_for_one_store(pair, workers):
    """Two ranks: each rank's paired rows are that rank's rows alone, disjoint; a rank stopped
    after 3 batches and resumed from its state yields exactly the rest."""
    a, b = pair
    opts = {**OPTS, "world_size": 2}
    seen = []
    for rank in (0, 1):
        ds = ActivationDataset([a, b], "resid_post.0", rank=rank, **opts)
        full = list(ds.loader(workers))
        alone = list(ActivationDataset(a, "resid_post.0", rank=rank, **opts).loader(workers))
        assert np.array_equal(np.sort(_rows(full)), np.sort(_rows(alone)))
        seen.append(_rows(full))
        # resume: 3 batches, state, a fresh dataset picks up there
        ld = ds.loader(workers)
        it = iter(ld)
        head = [next(it) for _ in range(3)]
        state = ld.state_dict()
        del it
        again = ActivationDataset([a, b], "resid_post.0", rank=rank, **opts)
        ld2 = again.loader(workers)
        ld2.load_state_dict(state)
        rest = list(ld2)
        assert np.array_equal(np.sort(np.concatenate([_rows(head), _rows(rest)])), np.sort(_rows(full)))
        if workers == 0:
            assert np.array_equal(np.concatenate([_rows(head), _rows(rest)]), _rows(full))
            assert torch.equal(torch.cat([g["acts"] for g in head + rest]),
                               torch.cat([g["acts"] for g in full]))
    assert not np.intersect1d(*seen).size


def test_a_different_token_in_one_unit_is_refused_naming_unit_and_row(tmp_path, pair):
    a, _ = pair
    bad = _store(tmp_path / "other", seed=2, tok_edit=(700, 4321))   # unit 1: rows [512, 1024)
    with pytest.raises(StoresNotAligned, match=r"unit 1 \(rows \[512, 1024\)\) holds different "
                       r"`token_id` \(first at row 700: \d+ vs 4321; 1 rows differ\)"):
        ActivationDataset([a, bad], "resid_post.0", batch_size=100)


def test_a_different_plan_or_row_count_is_refused_naming_the_field(tmp_path, pair):
    a, _ = pair
    with pytest.raises(StoresNotAligned, match=r"unit plans differ at unit 0: rows \[0, 512\) in "
                       r"the first, rows \[0, 256\) in the second"):
        ActivationDataset([a, _store(tmp_path / "p1", seed=2, plan=1)], "resid_post.0", batch_size=100)
    with pytest.raises(StoresNotAligned, match="n_rows is 1728 in the first and 1600"):
        ActivationDataset([a, _store(tmp_path / "short", n=N - 128, seed=2)], "resid_post.0", batch_size=100)
    with pytest.raises(ValueError, match="max_norm_ratio: paired reading"):
        ActivationDataset([a, a], "resid_post.0", batch_size=100, max_norm_ratio=10.0)


def test_stores_whose_sink_positions_differ_keep_one_filter_or_are_refused(tmp_path, pair):
    """exclude_special=True drops each store's recorded sink positions: stores that record
    different ones would keep different rows under one config, which is refused by name;
    seqpos= given is one filter for both."""
    a, _ = pair
    b = _store(tmp_path / "skip4", seed=2, attrs={"stats_skip_positions": 4})
    with pytest.raises(StoresNotAligned, match="record different stats_skip_positions"):
        ActivationDataset([a, b], "resid_post.0", batch_size=100, exclude_special=True)
    ds = ActivationDataset([a, b], "resid_post.0", batch_size=100, exclude_special=True,
                           seqpos=slice(4, None), return_meta=True)
    assert (_rows(list(ds)) % C >= 4).all()


def test_a_unit_committed_in_one_store_only_is_refused(tmp_path):
    full = make_store(tmp_path / "full", N, SHARD, W, POINTS, context=C)[0]
    part = make_store(tmp_path / "part", N, SHARD, W, POINTS, context=C, uncommitted=(3,))[0]
    with pytest.raises(StoresNotAligned, match=r"unit 3 \(rows \[768, 1024\)\) is committed in "
                       r"'full' but not in 'part'"):
        ActivationDataset([full, part], "resid_post.0", batch_size=100)


def test_markers_without_digests_fall_back_to_reading_the_column(tmp_path, pair):
    """A marker without `row_meta.crc32c` (none written today; the fallback): the unit's
    columns are read from both stores and compared, and a difference still names its row."""
    a, b = pair
    bad = _store(tmp_path / "other", seed=2, tok_edit=(1300, 4321))
    for other, ok in ((b, True), (bad, False)):
        markers = [s.ledger.committed_units() for s in (a, other)]
        markers[1] = {u: dataclasses.replace(m, meta_crc32c=None) for u, m in markers[1].items()}
        if ok:
            rep = check_aligned([a, other], markers=markers)
            assert rep.read_units == rep.units == 4 and rep.by_digest == 0
            assert rep.bytes_read == 2 * N * (4 + 8 + 4)      # token_id, doc_id, position, both stores
        else:
            with pytest.raises(StoresNotAligned, match=r"unit 2 .*\(first at row 1300"):
                check_aligned([a, other], markers=markers)


def test_a_pair_that_drifts_apart_while_reading_is_an_error(pair):
    """The per-batch check: the members' row ids are compared, not trusted (here one member is
    made to read another order)."""
    a, b = pair
    ds = ActivationDataset([a, b], "resid_post.0", **OPTS)
    ds.datasets[1] = ActivationDataset(b, "resid_post.0", **{**OPTS, "seed": 6})
    with pytest.raises(DataIntegrityError, match="store 'tuned' yielded row"):
        list(ds)


def test_a_crosscoder_trains_from_paired_batches(tmp_path):
    """A small acausal crosscoder (one encoder over both models, a decoder per model, L1 weighted
    by the summed decoder norms) on two stores whose rows are the same sparse codes seen through
    two different dictionaries: its loss falls to a fraction of the start in 150 steps, and
    `crosscoder_data` hands it [batch, n_models, width] float32."""
    n, d, atoms, k = 4096, 16, 32, 2
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(atoms, k, replace=False) for _ in range(n)])
    coef = rng.uniform(0.5, 2.0, (n, k, 1))
    stores = []
    for m in range(2):
        dic = rng.normal(size=(atoms, d))
        dic /= np.linalg.norm(dic, axis=1, keepdims=True)
        x = (coef * dic[idx]).sum(1)[None].astype(np.float32)
        stores.append(make_store(tmp_path / f"m{m}", n, 512, d, ["resid_post.0"], context=64,
                                 data=x.astype(ml_dtypes.bfloat16))[0])
    ds = ActivationDataset(stores, "resid_post.0", batch_size=256, steps=150, seed=0)
    torch.manual_seed(0)
    F = 64
    enc = torch.nn.Parameter(torch.randn(2, d, F) * 0.1)
    dec = torch.nn.Parameter(torch.randn(F, 2, d) * 0.1)
    b_enc = torch.nn.Parameter(torch.zeros(F))
    opt = torch.optim.Adam([enc, dec, b_enc], lr=1e-2)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matmuls: 0.7 s for the loop, 16 s with 2 threads on a busy box
    try:
        _train(ds, enc, dec, b_enc, opt, losses, d)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 150
    with pytest.raises(ValueError, match="paired dataset yields .* crosscoder_data"):
        dictionary_learning_data(ds)
    with pytest.raises(ValueError, match="give a paired dataset"):
        next(crosscoder_data(ActivationDataset(stores[0], "resid_post.0", batch_size=256)))
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:10]), (losses[:10], losses[-10:])


def _train(ds, enc, dec, b_enc, opt, losses, d):
    for x in crosscoder_data(ds, steps=150):
        assert x.shape == (256, 2, d) and x.dtype == torch.float32
        f = torch.relu(torch.einsum("bmd,mdf->bf", x, enc) + b_enc)
        rec = torch.einsum("bf,fmd->bmd", f, dec)
        mse = ((rec - x) ** 2).sum((1, 2)).mean()
        loss = mse + 3e-3 * (f * dec.norm(dim=2).sum(1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(mse.detach()))
