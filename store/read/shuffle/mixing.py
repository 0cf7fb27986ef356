"""How well a shuffle window mixes documents: expected distinct documents per batch, and a warning.

A batch is a uniform draw of k rows from one window's kept rows. For a window of N kept rows in
which document d has n_d rows, the expected number of distinct documents in a batch is

    E = sum_d [1 - C(N - n_d, k) / C(N, k)]  ~=  sum_d [1 - (1 - n_d / N) ** k]

(a document is missing only if all k draws miss it; the right side draws with replacement, a
slight overestimate when k is near N). Documents are runs of rows (packed contexts), so a window
of w random shards holds the documents of those shards: E(w) ~= w x mean over shards s of
sum_{d in s} [1 - (1 - n_ds / (w R)) ** k], R the mean kept rows of a shard, estimated from a
seeded sample of shards (their doc_id columns, 8 bytes a row). Cut documents stay cut there: a
window rarely holds two neighbouring shards. "Uniform" is a draw from every kept row (N = P R):
sum_d [1 - (1 - n_d / N) ** k] over whole documents, estimated from the sampled rows scaled by
P R / sampled rows; the sample is runs of consecutive shards with documents joined by doc_id
across them, because counting each shard's part of a document as one (documents about as long
as a shard) put uniform at 50 against 34 measured. Rows with doc_id < 0 (inserted BOS) are drawn
but are no document. A fixed rule (warn below 8 shards) misses 8 of 32 shards: 173 documents a
batch against 581 uniform.

`describe(ds)` (ActivationDataset.describe) reports the same for the user's own store and
options, beside a simulation: see its docstring.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..feed.batching import batches as cut_batches
from ..feed.readahead import WindowFinisher
from ...format.jsonattrs import JsonObject

SAMPLE_RUNS, RUN_SHARDS = 4, 4   # doc_id columns read: 16 shards x 8 B x shard rows


def expected_distinct(doc_rows: np.ndarray, k: int, n: "float | None" = None) -> float:
    """Expected distinct documents in a uniform k-row draw from N rows of which document d holds
    doc_rows[d] (the module's formula); `n`: N when the rows given are a sample of a larger set
    (the count is then scaled by N / rows given)."""
    c = np.asarray(doc_rows, np.float64)
    got = float(c.sum())
    if not got:
        return 0.0
    n = got if n is None else float(n)
    return (n / got) * float(np.sum(1 - (1 - c / n) ** min(k, n)))


class DocSample:
    """Document row counts of a seeded sample of shards (runs of consecutive ones)."""

    def __init__(self, pieces, filt, read_meta, seed: int):
        P = len(pieces)
        starts = np.random.default_rng([seed, 0xD0C]).permutation(max(1, P - RUN_SHARDS + 1))
        pick = sorted({min(i + j, P - 1) for i in starts[:SAMPLE_RUNS] for j in range(RUN_SHARDS)})
        self.per_shard, docs, kept = [], [], []
        for i in pick:
            a, b = pieces[i]
            cols = {n: read_meta(n, a, b) for n in {"doc_id", *filt.meta_names()}}
            doc = cols["doc_id"]
            m = filt.mask_of(a, b, cols)
            d = doc if m is None else doc[m]
            d = d[d >= 0]
            kept.append(m.sum() if m is not None else b - a)
            docs.append(d)
            self.per_shard.append(np.unique(d, return_counts=True)[1].astype(np.float64))
        self.whole = np.unique(np.concatenate(docs), return_counts=True)[1].astype(np.float64)
        self.mean_rows, self.n_pieces = float(np.mean(kept)), P

    def _cut(self, w: int, k: int) -> float:
        """E for a window of w shards none of which neighbour each other (documents cut)."""
        n = w * self.mean_rows
        return w * float(np.mean([np.sum(1 - (1 - c / n) ** min(k, n)) for c in self.per_shard]))

    def _whole(self, w: int, k: int) -> float:
        """E for a window of w shards, documents whole (as if neighbours were all in it)."""
        n = w * self.mean_rows
        scale = n / (len(self.per_shard) * self.mean_rows)
        return scale * float(np.sum(1 - (1 - self.whole / n) ** min(k, n)))

    def window(self, w: int, k: int) -> float:
        """Expected distinct documents in a k-row batch from a window of w random shards: a
        shard's neighbour is in the window with chance (w - 1) / (P - 1), and then the
        document they share counts once."""
        P = self.n_pieces
        joined = (w - 1) / (P - 1) if P > 1 else 1.0
        return (1 - joined) * self._cut(w, k) + joined * self._whole(w, k)

    def uniform(self, k: int) -> float:
        """The same for a draw from every kept row of the store."""
        return self._whole(self.n_pieces, k)


def mixing_warning(sample: DocSample, k: int, window: int, shard_rows: int, buffer_rows: int,
                   workers: int = 1) -> str | None:
    """A warning when a window of `window` shards gives fewer than half the uniform documents
    per batch, saying both figures and the buffer that would reach half; else None.
    `workers`: ranks x DataLoader workers, each reading only its own part of the pieces."""
    n_pieces = sample.n_pieces
    if window >= n_pieces:
        return None
    uniform, got = sample.uniform(k), sample.window(window, k)
    if not uniform or got >= uniform / 2:
        return None
    lo, hi = window, n_pieces          # smallest w with E(w) >= uniform / 2 (E grows with w)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sample.window(mid, k) < uniform / 2 else (lo, mid)
    who = f" (each of {workers} ranks x workers reads windows of its own part)" if workers > 1 else ""
    share = -(-n_pieces // workers)
    fix = (f"shuffle_buffer_rows={lo * shard_rows} ({lo} shards) per worker would reach half"
           if lo <= share else f"half needs {lo} shards a window, more than a worker's share of "
           f"{share}: use fewer ranks x workers")   # a window never spans two parts
    return (f"shuffle_buffer_rows={buffer_rows} gives windows of {window} of {n_pieces} shards"
            f"{who}: a {k}-row batch is expected to hold {got:.0f} distinct documents against "
            f"{uniform:.0f} for a uniform shuffle, below half; {fix}, or read a shuffled copy "
            "(`harvest shuffle SRC DST`: uniform mixing at one read an epoch).")


def check(ds, workers: int = 1, stacklevel: int = 3) -> str | None:
    """Warn (and return the text) when dataset `ds` read by `workers` per rank mixes poorly."""
    if not ds.shuffle or ds.shuffle == "global" or not ds.pieces:   # global: uniform by construction
        return None
    G = ds.world_size * max(1, workers)
    window = min(ds.window_shards, -(-len(ds.pieces) // G))   # a worker's window is within its part
    if window >= len(ds.pieces):
        return None
    if ds.mix_docs is None:
        ds.mix_docs = DocSample(ds.pieces, ds.filter, ds.committed_meta().read, ds.seed)
    msg = mixing_warning(ds.mix_docs, ds.batch_size, window, ds.shard_rows, ds.shuffle_buffer_rows, G)
    if msg:
        warnings.warn(msg, stacklevel=stacklevel)
    return msg


# ---- describe(): the figures above, and a simulation, for the user's own store -----------

def doc_stats(docs: list[np.ndarray], k: int) -> dict[str, float]:
    """Measured mixing of batches given as their rows' doc_ids: distinct documents per batch,
    lag-1 same-document rate and lag-1 doc-id autocorrelation (full batches only, when any)."""
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


def describe(ds, num_workers: int = 0, batches: int = 16) -> JsonObject:
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
    sim = doc_stats(simulated_docs(ds, num_workers, batches), k)
    sim["vs_uniform"] = sim["distinct_docs"] / uniform if uniform else None
    res["simulated"] = sim
    if ds.max_norm_ratio is not None:
        res["note"] = "max_norm_ratio: rows the norm filter drops are not simulated"
    return res
