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
"""

from __future__ import annotations

import warnings

import numpy as np

SAMPLE_RUNS, RUN_SHARDS = 4, 4   # doc_id columns read: 16 shards x 8 B x shard rows


class DocSample:
    """Document row counts of a seeded sample of shards (runs of consecutive ones)."""

    def __init__(self, pieces, filt, read_meta, seed: int):
        P = len(pieces)
        starts = np.random.default_rng([seed, 0xD0C]).permutation(max(1, P - RUN_SHARDS + 1))
        pick = sorted({min(i + j, P - 1) for i in starts[:SAMPLE_RUNS] for j in range(RUN_SHARDS)})
        self.per_shard, docs, kept = [], [], []
        for i in pick:
            a, b = pieces[i]
            doc = read_meta("doc_id", a, b)
            tok = read_meta("token_id", a, b) if filt.needs_tokens else None
            role = read_meta("role", a, b) if filt.needs_roles else None
            gen = read_meta("gen", a, b) if filt.generated else None
            m = filt.mask(a, b, tok, doc, role, gen)
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
            f"{uniform:.0f} for a uniform shuffle, below half; {fix}.")


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
