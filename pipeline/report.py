"""`harvest report URL`: one picture of a store, for the person who has to decide whether to train on it.

Written from the store alone (stats, commit markers and a sample of committed rows), so it works on a
finished store, on one still being written, and on a machine without the engine. Everything plotted
is also written as `report.json` beside the PNG: the picture is for people, the JSON for tests and
for tools, and both come from the same numbers, so the picture cannot silently disagree with the store.

What is shown, and why:
- RMS norm per layer (sqrt E||x||^2, from the store's float64 moments): a layer whose scale jumps
  or collapses is the first thing that breaks an SAE's normalisation.
- Per-dimension variance per layer (median and max over dimensions, log scale): a max far above the
  median is a massive-activation dimension (attention sinks), which `normalize="standardize"` or a
  norm filter must handle.
- The tokens with the largest norms per layer, decoded: sinks are usually BOS or the first tokens of
  a context; seeing them named is what tells a user to exclude them.
- Compression per point (logical / stored bytes, from the sizes the writers recorded).
- Throughput over time from commit times: a run that slowed down or stalled shows as a bend.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("harvest.report")

TOP_TOKENS = 5          # largest-norm rows listed per layer
SAMPLE_SHARDS = 4       # shards read to find them: evenly spaced over the committed ones


def _layer_key(point: str) -> tuple[str, int]:
    name, _, layer = point.rpartition(".")
    return (name, int(layer)) if layer.isdigit() else (point, 0)


def _committed_sizes(markers: dict, n_points: int) -> tuple[int, list[int | None]]:
    """(rows, stored bytes per point) from the sizes writers recorded in their markers."""
    rows = 0
    stored: list[int | None] = [0] * n_points
    for m in markers.values():
        rows += m["row_end"] - m["row_start"]
        for sh in m.get("shards", []):
            nb = sh.get("nbytes") or [None] * n_points
            for p in range(n_points):
                stored[p] = None if stored[p] is None or nb[p] is None else stored[p] + nb[p]
    return rows, stored


def _throughput(markers: dict) -> list[tuple[str, int]]:
    """(commit time, cumulative committed rows) in commit order."""
    events = sorted((m["committed_at"], m["row_end"] - m["row_start"])
                    for m in markers.values() if m.get("committed_at"))
    out, total = [], 0
    for t, n in events:
        total += n
        out.append((t, total))
    return out


def _sample_shards(markers: dict, k: int) -> list[int]:
    shards = sorted({sh["index"] for m in markers.values() for sh in m.get("shards", [])})
    if len(shards) <= k:
        return shards
    return [shards[i] for i in np.linspace(0, len(shards) - 1, k).round().astype(int)]


def _top_rows(store, points: list[str], shards: list[int], k: int) -> dict[str, list[dict]]:
    """Rows with the largest norms per point among the sampled shards, with their metadata."""
    from .store.dtypes import BF16

    out: dict[str, list[dict]] = {p: [] for p in points}
    for p in points:
        best: list[tuple[float, int]] = []
        for s in shards:
            a, b = store.shard_range(s)
            x = store.read_shard(p, s)
            x = x.astype(np.float32) if x.dtype == BF16 else np.asarray(x, np.float32)
            norms = np.linalg.norm(x, axis=1)
            idx = np.argsort(norms)[-k:]
            best += [(float(norms[i]), a + int(i)) for i in idx]
        best.sort(reverse=True)
        out[p] = [{"row": r, "norm": n} for n, r in best[:k]]
    rows = sorted({e["row"] for v in out.values() for e in v})
    meta = {}
    for r in rows:
        tok, doc, pos, *_ = store.read_row_meta_checked(r, r + 1)  # an unpublished unit: not fill
        meta[r] = (int(tok[0]), int(doc[0]), int(pos[0]))
    for v in out.values():
        for e in v:
            e["token_id"], e["doc_id"], e["position"] = meta[e["row"]]
    return out


def _decoder(store, tokenizer_path: str | None):
    path = tokenizer_path or (store.attrs or {}).get("model_path")
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return lambda i: tok.decode([int(i)])
    except Exception as e:  # noqa: BLE001 -- a report without decoded text is still a report
        log.info("report: tokens shown as ids (tokenizer %s not loadable: %s)", path, type(e).__name__)
        return None


def collect(store, tokenizer_path: str | None = None, sample_shards: int = SAMPLE_SHARDS,
            top: int = TOP_TOKENS) -> dict:
    """Every number the report shows, as JSON-able data."""
    markers = store.committed_units()
    stats = store.stats()
    points = list(store.points)
    rows, stored = _committed_sizes(markers, len(points))
    logical = rows * store.row_bytes
    per_point = []
    for i, p in enumerate(points):
        s = stats[p]
        var = np.asarray(s["var"], np.float64)
        name, layer = _layer_key(p)
        per_point.append({
            "point": p, "name": name, "layer": layer, "count": int(s["count"]),
            "rms_norm": float(np.sqrt(s["mean_sq_norm"])) if s["count"] else None,
            "mean_sq_norm": float(s["mean_sq_norm"]) if s["count"] else None,
            "var_median": float(np.median(var)) if s["count"] else None,
            "var_max": float(var.max()) if s["count"] else None,
            "var_argmax": int(var.argmax()) if s["count"] else None,
            "compression": round(logical / stored[i], 4) if stored[i] else None,
        })
    decode = _decoder(store, tokenizer_path)
    top_rows = _top_rows(store, points, _sample_shards(markers, sample_shards), top) if markers else {}
    if decode is not None:
        for v in top_rows.values():
            for e in v:
                e["text"] = decode(e["token_id"])
    return {
        "url": store.url, "points": per_point, "width": store.width,
        "committed_rows": rows, "n_rows": store.n_rows, "committed_units": len(markers),
        "top_rows": top_rows, "sampled_shards": _sample_shards(markers, sample_shards),
        "throughput": _throughput(markers),
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters; never pick a GUI backend
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(12, 11))
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.9])
    ax = np.array([[fig.add_subplot(grid[r, c]) for c in range(2)] for r in range(2)])
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    names = sorted({p["name"] for p in data["points"]})
    for name in names:
        pts = sorted((p for p in data["points"] if p["name"] == name and p["count"]),
                     key=lambda p: p["layer"])
        layers = [p["layer"] for p in pts]
        ax[0, 0].plot(layers, [p["rms_norm"] for p in pts], "o-", label=name)
        ax[0, 1].semilogy(layers, [p["var_median"] for p in pts], "o-", label=f"{name} median")
        ax[0, 1].semilogy(layers, [p["var_max"] for p in pts], "x--", label=f"{name} max")
        comp = [(p["layer"], p["compression"]) for p in pts if p["compression"]]
        if comp:
            ax[1, 0].bar([c[0] for c in comp], [c[1] for c in comp], label=name, alpha=0.7)
    ax[0, 0].set(title="RMS norm per layer (sqrt E||x||^2)", xlabel="layer")
    ax[0, 1].set(title="per-dimension variance", xlabel="layer")
    ax[1, 0].set(title="compression (logical / stored)", xlabel="layer")
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.legend(fontsize=7)
    tp = data["throughput"]
    if tp:
        t0 = _dt.datetime.fromisoformat(tp[0][0])
        xs = [(_dt.datetime.fromisoformat(t) - t0).total_seconds() for t, _ in tp]
        ax[1, 1].step(xs, [n for _, n in tp], where="post")
    ax[1, 1].set(title="committed tokens over time (from commit markers)", xlabel="seconds",
                 ylabel="tokens")
    tab = fig.add_subplot(grid[2, :])
    tab.axis("off")
    tab.set_title("largest-norm tokens per point (sampled shards; token, @position in its document, norm)")
    lines = []
    shown = data["points"] if len(data["points"]) <= 16 else data["points"][:: -(-len(data["points"]) // 16)]
    for p in shown:
        tops = data["top_rows"].get(p["point"], [])[:3]
        cells = "   ".join(f"{e.get('text', e['token_id'])!r:.14} @{e['position']} |x|={e['norm']:.3g}"
                           for e in tops)
        lines.append(f"{p['point']:>16}  {cells}")
    tab.text(0.0, 1.0, "\n".join(lines) or "(nothing committed)", family="monospace", fontsize=8,
             va="top", transform=tab.transAxes)
    fig.suptitle(f"{data['url']}: {data['committed_rows']:,} tokens committed, width {data['width']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _html(data: dict, png: Path) -> str:
    img = base64.b64encode(png.read_bytes()).decode()
    rows = []
    for p in data["points"]:
        tops = data["top_rows"].get(p["point"], [])
        cells = ", ".join(
            f"{html.escape(repr(e.get('text', e['token_id'])))} (row {e['row']}, pos {e['position']}, "
            f"|x| {e['norm']:.3g})" for e in tops)
        rows.append(f"<tr><td>{html.escape(p['point'])}</td><td>{p['rms_norm'] or float('nan'):.4g}</td>"
                    f"<td>{p['var_max'] or float('nan'):.3g} (dim {p['var_argmax']})</td>"
                    f"<td>{p['compression'] or ''}</td><td>{cells}</td></tr>")
    return (
        "<!doctype html><meta charset='utf-8'><title>harvest report</title>"
        f"<h1>{html.escape(data['url'])}</h1>"
        f"<p>{data['committed_rows']:,} tokens committed in {data['committed_units']} units; "
        f"generated {data['generated_at']}.</p>"
        f"<img src='data:image/png;base64,{img}' style='max-width:100%'>"
        "<h2>Per point</h2><table border=1 cellpadding=3><tr><th>point</th><th>RMS norm</th>"
        "<th>max dim variance</th><th>compression</th><th>largest-norm tokens (sampled shards "
        f"{data['sampled_shards']})</th></tr>" + "".join(rows) + "</table>"
    )


def write_report(url: str, storage_options: dict | None = None, out_dir: "str | Path | None" = None,
                 tokenizer_path: str | None = None) -> dict:
    """Write report.png, report.html and report.json; returns their paths and the data.

    `out_dir` defaults to `<store>/_report` for a local store (beside the data it describes) and to
    `./harvest-report` for a remote one (a PNG on S3 is no use to a person at a terminal).
    """
    from harvest.pipeline.store import open_store

    store = open_store(url, storage_options=storage_options, read_only=True)
    if out_dir is None:
        out_dir = store.location.report_dir()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = collect(store, tokenizer_path)
    png, page, js = out / "report.png", out / "report.html", out / "report.json"
    _plot(data, png)
    page.write_text(_html(data, png), encoding="utf-8")
    js.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return {"png": str(png), "html": str(page), "json": str(js), "data": data}
