"""`ActivationDataset.describe()`: how well this reader, on this store with these options, mixes.

Two views, side by side:
- expected: distinct documents per batch from mixing.DocSample (a seeded sample of shards'
  doc_id columns), for a window of the shards a worker actually holds, against a uniform
  shuffle of every kept row (bench_shuffle's "ideal"); `vs_uniform` is their ratio. In global
  mode the batch is a uniform draw by construction (permute.py), so expected = uniform.
- simulated: the first `batches` batches of lane 0 (rank `ds.rank`, DataLoader worker 0 of
  `num_workers`) of the current epoch, built from the row metadata alone by the reader's own
  machinery (WindowFinisher or GlobalReader, then batching.batches over a dummy arena): the
  rows are exactly those the reader yields (tested against a recount), so their documents per
  batch, the rate at which consecutive rows of a batch share a document (`lag1_same_doc`) and
  the lag-1 autocorrelation of their document ids (`lag1_doc_autocorr`, Pearson over
  consecutive pairs within batches; ~0 for a uniform shuffle, towards 1 for reading in order)
  are measured, not modelled. Only doc_id/token_id columns are read (8-12 bytes a row).
  Not simulated: the norm filter (max_norm_ratio drops rows only known once read).

Also the memory the shuffle holds and, for global mode, how many shards an epoch decodes
against the window shuffle's one pass.
"""

from __future__ import annotations

import numpy as np

from .batching import batches as cut_batches
from .mixing import DocSample
from .readahead import WindowFinisher


def _doc_stats(docs: list[np.ndarray], k: int) -> dict:
    full = [d for d in docs if d.shape[0] == k] or docs
    distinct = [np.unique(d[d >= 0]).size for d in full]
    same = [float((d[1:] == d[:-1]).mean()) if d.shape[0] > 1 else 0.0 for d in full]
    x = np.concatenate([d[:-1] for d in full]) if full else np.empty(0)
    y = np.concatenate([d[1:] for d in full]) if full else np.empty(0)
    ok = (x >= 0) & (y >= 0)
    x, y = x[ok].astype(np.float64), y[ok].astype(np.float64)
    corr = float(np.corrcoef(x, y)[0, 1]) if x.size > 2 and x.std() > 0 and y.std() > 0 else float("nan")
    return {"batches": len(full), "distinct_docs": float(np.mean(distinct)) if distinct else 0.0,
            "lag1_same_doc": float(np.mean(same)) if same else 0.0, "lag1_doc_autocorr": corr}


def simulated_docs(ds, num_workers: int = 0, n_batches: int = 16) -> list[np.ndarray]:
    """doc_id of each row of the first `n_batches` batches lane 0 of this rank yields this epoch."""
    nw = max(1, num_workers)
    G = ds.world_size * nw
    g = ds.rank * nw
    epoch, k = ds.epoch, ds.batch_size
    cols = ds.committed_meta()
    if ds.shuffle == "global":
        readies = ds.global_reader(["doc_id"], acts=False).readies(epoch, g, G)
    else:
        counts = ds.kept_counts()
        finish = WindowFinisher(ds.pieces, ds.filter, counts, None, None, ds.slot_rows, bool(ds.shuffle),
                                ds.seed, g, True)
        names = sorted(set(ds.filter.meta_names()) | {"doc_id", "token_id", "position"}
                       | ({"gen"} if ds.filter.generated else set()))

        def windows():
            for spec in ds.window_specs(epoch, 0, nw):
                metas = [{n: cols.read(n, *ds.pieces[t.piece]) for n in names} for t in spec.takes]
                arena = np.zeros((len(spec.takes) * ds.slot_rows, 1, 1), np.uint8)
                yield finish(spec, arena, metas)
        readies = windows()
    out = cut_batches(readies, k, (1, 1), np.dtype(np.uint8), lambda x, rows, meta: meta["doc_id"].copy(),
                      limit=n_batches, drop_last=ds.drop_last, shuffle=bool(ds.shuffle), seed=ds.seed)
    return list(out)


def describe(ds, num_workers: int = 0, batches: int = 16) -> dict:
    """What `ActivationDataset.describe` returns (see the module docstring)."""
    k = ds.batch_size
    G = ds.world_size * max(1, num_workers)
    P = len(ds.pieces)
    mode = "global" if ds.shuffle == "global" else "window" if ds.shuffle else "none"
    row_bytes = len(ds.points) * ds.row_width * ds.raw_dtype.itemsize
    res: dict = {"shuffle": mode, "batch_size": k, "ranks_x_workers": G, "shards": P,
                 "kept_rows": ds.count_rows() if P else 0}
    if not P:
        return res
    window = min(ds.window_shards, -(-P // G))
    if ds.mix_docs is None:
        ds.mix_docs = DocSample(ds.pieces, ds.filter, ds.committed_meta().read, ds.seed)
    uniform = ds.mix_docs.uniform(k)
    if mode == "global":
        block = max(1, ds.shuffle_buffer_rows // k) * k
        q = res["kept_rows"] // G if G > 1 else res["kept_rows"]
        touched = P * (1 - (1 - 1 / P) ** min(block, q)) if q else 0.0   # shards a block reads
        res.update(expected_distinct_docs=uniform, block_rows=block,
                   memory_bytes=block * row_bytes + ds.config.prefetch_shards * ds.slot_rows * row_bytes,
                   shard_reads_vs_window=G * -(-q // block) * touched / P if q else 0.0)
    else:
        res.update(window_shards=window, expected_distinct_docs=ds.mix_docs.window(window, k) if mode == "window"
                   else None, memory_bytes=2 * ds.window_shards * ds.slot_rows * row_bytes, shard_reads_vs_window=1.0)
    res["uniform_distinct_docs"] = uniform
    exp = res["expected_distinct_docs"]
    res["vs_uniform"] = exp / uniform if exp is not None and uniform else None
    sim = _doc_stats(simulated_docs(ds, num_workers, batches), k)
    sim["vs_uniform"] = sim["distinct_docs"] / uniform if uniform else None
    res["simulated"] = sim
    if ds.max_norm_ratio is not None:
        res["note"] = "max_norm_ratio: rows the norm filter drops are not simulated"
    return res
