"""Store.info(): what a user inspecting a store wants, in one dict."""

from __future__ import annotations
from .format.jsonattrs import JsonObject


def store_info(st) -> JsonObject:
    """Shape, progress against the plan, stats and attrs of `st` (see Store.info)."""
    names = st.ledger.marker_names()
    plan = st.ledger.plan_units()
    rows = sum(n[2] - n[1] for n in names)
    planned = sum(u.n_rows for u in plan)
    return {
        "url": st.url, "layout_version": st.layout_version, "points": st.points,
        "width": st.width, "widths": dict(st.widths), "n_rows": st.n_rows, "dtype": st.dtype, "row_width": st.row_width,
        "shard_rows": st.shard_rows, "chunk_rows": st.chunk_rows,
        "context_size": st.context_size, "special_token_ids": st.special_token_ids,
        "bos_token_id": st.bos_token_id, "tokenizer": st.tokenizer,
        "stats_skip_positions": st.stats_skip_positions,
        "compression": st.compression, "committed_units": len(names),
        "committed_rows": rows, "committed_fraction": rows / planned if planned else 0.0,
        "planned_units": len(plan), "finalized": st.summary is not None,
        "stats": st.attributes.get("stats"),
        "compression_ratio": st.attributes.get("compression_ratio"),
        "attrs": st.attrs,
    }
