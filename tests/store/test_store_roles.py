"""The `role` row-metadata column (issue 26 A): the reader's roles= filter, normalisation that
follows it, a role-masked store (capture.roles) and stores made before the column existed.
Local stores, no engine (fast); every expectation is recounted from the arrays written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.store import create_store, open_store
from harvest.store.format import layout
from harvest.store.commit.finalize import finalize
from harvest.store.read.dataset import ActivationDataset
from harvest.store.format.roles import CODES
from harvest.store.commit.verify import verify
from harvest.testing import synthetic

N, SHARD, C, W = 1024, 256, 64, 16


def _meta(seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(20, 5000, N).astype(np.int32)
    doc = np.repeat(np.arange(N // C), C).astype(np.int64)
    pos = np.tile(np.arange(C), N // C).astype(np.int32)
    role = rng.choice([CODES[r] for r in ("system", "user", "assistant", "scaffold", "pad")],
                      N).astype(np.int8)
    return tok, doc, pos, role


def _store(path, chat: "dict | None", with_roles=True, seed=0):
    attrs = {"config": {"packing": {"context_size": C}}}
    if chat is not None:
        attrs["chat"] = chat
    s = create_store(str(path), points=["resid_post.0"], width=W, n_rows=N, shard_rows=SHARD,
                     chunk_rows=128, context_size=C, attrs=attrs, roles=with_roles)
    data = synthetic.activations((1, N, W), seed=seed)
    tok, doc, pos, role = _meta(seed)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, data, token_id=tok, doc_id=doc, position=pos,
                   role=role if with_roles else None)
    return open_store(str(path)), data, role


def _rows(ds) -> tuple[np.ndarray, np.ndarray]:
    rows, acts = [], []
    for b in ds:
        rows.append(b["row"].numpy())
        acts.append(b["acts"].float().numpy())
    order = np.argsort(np.concatenate(rows))
    return np.concatenate(rows)[order], np.concatenate(acts)[order]


def _f32(x):
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).float().numpy()


def test_reader_roles_yields_exactly_those_rows(tmp_path):
    st, data, role = _store(tmp_path / "s", {"captured": None})
    assert st.meta_columns["role"] == "int8"
    np.testing.assert_array_equal(np.asarray(st.meta_array("role")[:]), role)
    ds = ActivationDataset(st, batch_size=100, shuffle=False, return_meta=True,
                           roles=["assistant", "system"])
    rows, acts = _rows(ds)
    want = np.flatnonzero(np.isin(role, [CODES["assistant"], CODES["system"]]))
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(acts, _f32(data[0][want]))
    assert ds.count_rows() == len(want)


def test_normalisation_statistics_follow_the_role_filter(tmp_path):
    st, data, role = _store(tmp_path / "s", {"captured": None})
    with pytest.warns(UserWarning, match="attention"):   # positions 0 and 1 are yielded too
        ds = ActivationDataset(st, batch_size=100, shuffle=False, roles=["assistant"],
                               normalize="standardize", norm_sample_rows=N)
    nc = ds.norm_constants
    # exactly the yielded rows: every assistant row, whatever its context position
    x = _f32(data[0][role == CODES["assistant"]]).astype(np.float64)
    assert nc.source == "sample" and nc.rows == len(x)
    np.testing.assert_allclose(nc.shift[0].numpy(), x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nc.scale[0].numpy(), 1 / np.sqrt(x.var(0) + 1e-6), rtol=1e-4)
    # against the other roles' statistics: a filter that did nothing would match these
    y = _f32(data[0]).astype(np.float64)
    assert not np.allclose(nc.shift[0].numpy(), y.mean(0), rtol=1e-3, atol=1e-4)


def test_role_masked_store_keeps_only_the_captured_rows(tmp_path):
    st, data, role = _store(tmp_path / "s", {"captured": ["assistant"]})
    keep = role == CODES["assistant"]
    stored = st.read("resid_post.0", 0, N)
    np.testing.assert_array_equal(stored[keep].view(np.int16), data[0][keep].view(np.int16))
    assert not stored[~keep].view(np.int16).any()  # other roles ran as context, are not stored
    # by default the reader yields the captured rows only; other roles are refused
    rows, _ = _rows(ActivationDataset(st, batch_size=128, shuffle=False, return_meta=True))
    np.testing.assert_array_equal(rows, np.flatnonzero(keep))
    with pytest.raises(ValueError, match=r"kept only \['assistant'\].*\['user'\]"):
        ActivationDataset(st, roles=["user"])
    # the writer's kept statistics are over the captured rows, and the reader uses them
    finalize(st)
    st = open_store(str(tmp_path / "s"))
    kept = st.stats(["resid_post.0"], subset="kept")["resid_post.0"]
    x = _f32(data[0][keep]).astype(np.float64)
    assert kept["count"] == keep.sum()
    np.testing.assert_allclose(kept["mean"], x.mean(0), rtol=1e-6, atol=1e-7)
    assert verify(st, deep=True).ok


def test_text_store_refuses_roles(tmp_path):
    st, _, _ = _store(tmp_path / "s", None, with_roles=False)
    assert "role" not in st.meta_columns  # text stores keep their three columns (objects/shard)
    with pytest.raises(ValueError, match="no role column"):
        ActivationDataset(st, roles=["assistant"])
    # a store with the column but no chat record (written by hand): nothing says what roles mean
    st, _, _ = _store(tmp_path / "t", None, with_roles=True)
    with pytest.raises(ValueError, match="holds plain text"):
        ActivationDataset(st, roles=["assistant"])


def test_store_without_the_role_column_reads_as_before(tmp_path, monkeypatch):
    """A store made before `role` existed: its row_meta has three columns and no role array."""
    old = {k: layout.ROW_META[k] for k in layout.BASE_META}
    monkeypatch.setattr(layout, "ROW_META", old)
    st, data, _ = _store(tmp_path / "s", None, with_roles=False)
    monkeypatch.undo()
    assert "role" in layout.ROW_META
    st = open_store(str(tmp_path / "s"))
    assert "role" not in st.meta_columns
    assert not (tmp_path / "s" / "role").exists()
    rows, acts = _rows(ActivationDataset(st, batch_size=256, shuffle=False, return_meta=True))
    np.testing.assert_array_equal(rows, np.arange(N))
    np.testing.assert_array_equal(acts, _f32(data[0]))
    with pytest.raises(ValueError, match="no role column"):
        ActivationDataset(st, roles=["assistant"])
    assert verify(st, deep=True, objects=True).ok
    finalize(st)
    assert open_store(str(tmp_path / "s")).n_rows == N
