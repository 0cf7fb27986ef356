"""`inspect` of a store: layout, run attributes, kept-row statistics and some rows.

In the store package (not the pipeline's views) so the light install (`harvest-store`, no engine,
Ray or torch) can inspect a store with the same code as `harvest inspect`.
"""

from __future__ import annotations

import numpy as np
from .format.jsonattrs import JsonObject


def inspect(url: str, storage_options: dict | None = None, rows: "tuple[int, int] | None" = None,
            tokenizer_path: str | None = None) -> JsonObject:
    """Layout, run attributes and (optionally) some rows with their metadata and norms."""
    from .store import open_store

    store = open_store(url, storage_options=storage_options, read_only=True)
    out = {k: v for k, v in store.info().items() if k != "stats"}
    out["stats_summary"] = stats_summary(store) if out.get("finalized") else None
    if rows is not None:
        a, b = rows
        tok, doc, pos = store.read_row_meta_checked(a, b)  # as the rows: unpublished units too
        norms = {}
        for p in store.points[:4]:
            x = store.read_values(p, a, b)
            norms[p] = np.round(np.linalg.norm(x, axis=1), 3).tolist()
        out["rows"] = {"start": a, "stop": b, "token_id": tok.tolist(), "doc_id": doc.tolist(),
                       "position": pos.tolist(), "norms": norms}
        path = tokenizer_path or (store.attrs or {}).get("model_path")
        if path:
            try:
                from transformers import AutoTokenizer

                t = AutoTokenizer.from_pretrained(path)
                out["rows"]["text"] = [t.decode([int(i)]) for i in tok.tolist()]
            except Exception:
                pass
    return out


def stats_summary(store) -> JsonObject:
    """Per point, the kept rows' statistics in a few numbers (README: inspect shows stats)."""
    out = {}
    try:
        st = store.stats(None, subset="kept")
    except Exception:  # noqa: BLE001 -- a store finalized before kept stats existed
        st = store.stats(None, subset="all")
    for p, d in st.items():
        mean, var = np.asarray(d["mean"], np.float64), np.asarray(d["var"], np.float64)
        out[p] = {"count": int(d["count"]), "rms_norm": float(np.sqrt(d["mean_sq_norm"])),
                  "mean_norm": float(np.linalg.norm(mean)), "var_mean": float(var.mean()),
                  "var_max": float(var.max()), "nonfinite_rows": int(d["nonfinite_rows"])}
    return out
