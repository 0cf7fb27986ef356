"""Small stores for the reader tests: packed contexts with a BOS per context, like a real run."""

from __future__ import annotations

import numpy as np

from harvest.store import create_store
from harvest.store.commit.tables import unit_shards
from harvest.testing import synthetic

BOS = 1


def packed_meta(n_rows: int, context: int, mean_doc: int = 150, seed: int = 0):
    """token_id, doc_id, position of documents packed into contexts that start with BOS.

    Documents (lognormal lengths around `mean_doc`) run on across context boundaries, as with
    `overflow: split`; the inserted BOS rows have doc_id = position = -2 (layout v2).
    """
    rng = np.random.default_rng(seed)
    tok = rng.integers(2, 5000, n_rows).astype(np.int32)
    doc = np.empty(n_rows, np.int64)
    pos = np.empty(n_rows, np.int32)
    d, left, p = 0, 0, 0
    for r in range(n_rows):
        if r % context == 0:
            tok[r], doc[r], pos[r] = BOS, -2, -2
            continue
        if left == 0:
            d += 1
            left, p = max(1, int(rng.lognormal(np.log(mean_doc), 0.8))), 0
        doc[r], pos[r] = d, p
        left, p = left - 1, p + 1
    return tok, doc, pos


def make_store(path, n_rows: int, shard_rows: int, width: int = 16, points=("resid_post.0",),
               context: int = 64, seed: int = 0, attrs: dict | None = None, uncommitted=(),
               data: np.ndarray | None = None, chunk_rows: int | None = None, mean_doc: int = 150):
    """A committed store; returns (store, data [P, n, W], token_id, doc_id, position)."""
    points = list(points)
    s = create_store(str(path), points=points, width=width, n_rows=n_rows, shard_rows=shard_rows,
                     chunk_rows=chunk_rows or min(shard_rows, 128),
                     attrs={"config": {"packing": {"context_size": context}}, **(attrs or {})})
    if data is None:
        data = synthetic.activations((len(points), n_rows, width), seed=seed)
    tok, doc, pos = packed_meta(n_rows, context, mean_doc, seed)
    s.ledger.write_plan(s.ledger.default_plan(1))
    units = [u for u in s.ledger.plan() if u["unit_id"] not in set(uncommitted)]
    synthetic.fill(s, data, units=units, token_id=tok, doc_id=doc, position=pos)
    return s, data, tok, doc, pos


def committed_rows(store) -> np.ndarray:
    return np.concatenate([np.arange(m.row_start, m.row_end) for m in store.ledger.committed_units().values()])


def unpublish(store, unit_ids) -> int:
    """Put committed units' objects back under their attempt names: the state a writer killed
    between its commit marker and publish leaves until finalize (objects.publish, reversed).
    Returns how many objects moved."""
    from harvest.store.commit.objects import meta_keys, point_keys

    moved = 0
    for uid in unit_ids:
        m = store.ledger.commit_manifest(uid)
        for sh in unit_shards(store, m):
            pairs = [point_keys(p, sh.index, m.attempt) for p in store.points]
            pairs += [meta_keys(n, sh.index, m.attempt) for n in sh.meta or {}]
            moved += sum(store.location.move(pub, att) for pub, att in pairs)
    return moved
