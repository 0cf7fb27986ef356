"""The report's figures that need more than the store's moments (pipeline/cli/report.py draws them).

Kept rows first. A store's "all rows" statistics include the BOS token the packer inserts at every
context start, and in most models that row is an attention sink: on Qwen-style models |x| ~ 2.5e4
against a median of a few hundred, so "RMS norm per layer" read ~2,200 from layer 11 and the
largest-norm token of every layer was `<|im_start|>` -- a report of one token, not of the data an
SAE trains on. The `kept` subset (FORMAT.md: not a special token, context position >=
stats_skip_positions) is the data; this module applies the same rule to the rows it samples (top
tokens, norm histograms) and names the largest excluded row separately, so the sink stays visible.

- dead dimensions: kept variance <= DEAD_REL x the median dimension's (or exactly 0);
- outlier dimensions: kept variance >= OUTLIER_REL x the median (massive activations);
- run figures: skipped source rows by reason (from the plan's chunk records, so a scheduled
  store's are counted once across its ticks), per-actor rates and step fill per run (the ticks'
  records, else the store's summary).
"""

from __future__ import annotations

import numpy as np

from ...store import read_meta_checked

DEAD_REL = 1e-6
OUTLIER_REL = 100.0
HIST_BINS = 40
LIST_DIMS = 8           # dimensions named per point in each list


def _kept_mask(store, tok: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The `kept` rule of the store's statistics, on sampled rows (store.stats_filter)."""
    f = store.stats_filter()
    if f is None:
        return np.ones(len(tok), bool)
    special, skip, C = f
    return ~np.isin(tok, special) & ((rows % C) >= skip)


def sample_rows(store, points: list[str], shards: list[int], k: int) -> dict:
    """Largest-norm kept rows per point, the largest excluded row, and kept-norm histograms,
    from the sampled shards (each shard's metadata read once, checked)."""

    meta = {}
    for s in shards:
        a, b = store.shard_range(s)
        tok, doc, pos = store.read_row_meta_checked(a, b)  # an unpublished unit: not fill
        rows = (read_meta_checked(store, "source_row", a, b) if "source_row" in store.meta_columns
                else np.arange(a, b))   # a shuffled copy: its rows' source rows (store/shuffled_copy.py)
        meta[s] = (tok, doc, pos, _kept_mask(store, tok, rows))
    top: dict[str, list] = {}
    sink: dict[str, dict | None] = {}
    hist: dict[str, dict] = {}
    for p in points:
        best, worst_out, kept_norms = [], None, []
        for s in shards:
            a, _ = store.shard_range(s)
            x = store.read_shard(p, s)
            x = store.values(x)   # float32: bf16 widened, fp8 dequantised
            norms = np.linalg.norm(x, axis=1)
            tok, doc, pos, keep = meta[s]
            n = min(len(norms), len(tok))
            norms, keep = norms[:n], keep[:n]
            kn = np.where(keep, norms, -np.inf)
            for i in np.argsort(kn)[-k:]:
                if np.isfinite(kn[i]):
                    best.append((float(norms[i]), a + int(i), s, int(i)))
            if (~keep).any():
                i = int(np.argmax(np.where(keep, -np.inf, norms)))
                if worst_out is None or norms[i] > worst_out[0]:
                    worst_out = (float(norms[i]), a + i, s, i)
            kept_norms.append(norms[keep])
        best.sort(reverse=True)
        top[p] = [_row(meta, e) for e in best[:k]]
        sink[p] = None if worst_out is None else _row(meta, worst_out)
        hist[p] = _histogram(np.concatenate(kept_norms) if kept_norms else np.zeros(0))
    return {"top_rows": top, "excluded_top": sink, "norm_hist": hist}


def _row(meta: dict, e: tuple) -> dict:
    norm, row, s, i = e
    tok, doc, pos, _ = meta[s]
    return {"row": row, "norm": norm, "token_id": int(tok[i]), "doc_id": int(doc[i]),
            "position": int(pos[i])}


def _histogram(norms: np.ndarray) -> dict:
    norms = norms[np.isfinite(norms) & (norms > 0)]
    if not norms.size:
        return {"edges": [], "counts": []}
    lo, hi = np.log10(norms.min()), np.log10(norms.max())
    counts, edges = np.histogram(np.log10(norms), bins=HIST_BINS, range=(lo, max(hi, lo + 1e-6)))
    return {"edges": (10.0 ** edges).tolist(), "counts": counts.tolist()}


def dimensions(var: np.ndarray) -> dict:
    """Dead and outlier dimensions of one point's kept per-dimension variance."""
    med = float(np.median(var)) if var.size else 0.0
    dead = np.flatnonzero((var == 0) | (var <= DEAD_REL * med))
    out = np.flatnonzero(var >= OUTLIER_REL * med) if med > 0 else np.zeros(0, int)
    order = out[np.argsort(var[out])[::-1]]
    return {"dead_dims": len(dead), "dead_first": dead[:LIST_DIMS].tolist(),
            "outlier_dims": len(out),
            "outliers": [{"dim": int(d), "x_median": round(float(var[d] / med), 1)}
                         for d in order[:LIST_DIMS]]}


def _number(x) -> "int | float | None":
    """A figure from a run record: the number, or None for anything else (the records are the
    store maker's JSON: a string there must not reach a format spec or a plot as a number)."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def run_figures(store) -> dict:
    """Skipped rows by reason over the whole store, and each run's rates (ticks, or the one run);
    numbers only where the records hold numbers, `status` and `finished_at` as text."""
    from ..data.row_frontier import sum_stats
    from ..driver.schedule_log import read_ticks

    skipped: dict = {}
    rows_read = 0
    try:
        chunks: dict = {}
        for pl in store.ledger.plans.read(payloads=True).payloads:
            chunks.update(pl.get("chunks") or {})
        st = sum_stats(chunks.values())
        skipped, rows_read = st.get("skipped_reasons") or {}, st.get("rows_read", 0)
    except Exception:  # noqa: BLE001 -- a store written without the driver has no plan payloads
        pass
    runs = [_dict(_dict(t).get("summary")) for t in read_ticks(store.location)]
    if not runs and store.summary:
        runs = [_dict(store.summary)]
    actors = [[_dict(a) for a in (r.get("per_actor") if isinstance(r.get("per_actor"), list) else [])]
              for r in runs]
    return {"rows_read": _number(rows_read) or 0,
            "skipped_reasons": {str(k): _number(v) or 0 for k, v in _dict(skipped).items()},
            "runs": [
                {"tokens": _number(r.get("tokens_this_run")),
                 "tokens_per_second": _number(r.get("tokens_per_second")),
                 "status": None if r.get("status") is None else str(r.get("status")),
                 "finished_at": None if r.get("finished_at") is None else str(r.get("finished_at")),
                 "per_actor": [{"index": a["index"] if type(a.get("index")) is int else 0,
                                **{k: _number(a.get(k)) for k in ("tokens", "tokens_per_second",
                                                                  "step_fill")}}
                               for a in acts]} for r, acts in zip(runs, actors)]}
