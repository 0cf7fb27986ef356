"""`harvest report URL`: one picture of a store, for the person who has to decide whether to train on it.

Written from the store alone (stats, commit markers and a sample of committed rows), so it works on a
finished store, on one still being written, and on a machine without the engine. Everything plotted
is also written as `report.json` beside the PNG: the picture is for people, the JSON for tests and
for tools, and both come from the same numbers, so the picture cannot silently disagree with the store.

What is shown, and why -- of the **kept** rows by default (not special tokens such as the BOS the
packer inserts, not the first stats_skip_positions positions; see report_figures.py for why: the
BOS sink alone made every figure a figure of one token). Where all rows are shown too, they are
labelled "all rows":
- RMS norm per layer (sqrt E||x||^2, from the store's float64 moments): a layer whose scale jumps
  or collapses is the first thing that breaks an SAE's normalisation.
- Per-dimension variance per layer (median and max over dimensions, log scale): a max far above the
  median is a massive-activation dimension (attention sinks), which `normalize="standardize"` or a
  norm filter must handle.
- The kept tokens with the largest norms per layer, decoded, and the largest excluded row (the sink)
  apart; histograms of kept-row norms per layer (sampled shards).
- Dead and outlier dimensions; skipped source rows by reason; per-run (per-tick) and per-actor
  rates with step fill.
- Compression per point (logical / stored bytes, from the sizes the writers recorded).
- Throughput over time from commit times: a run that slowed down or stalled shows as a bend.

The store is someone else's text (store/escape.py): every string from it is escaped in the HTML
(`html_text`) and in the picture (`plot_text`: matplotlib reads `$...$` as math), numbers from its
records are taken only where they are numbers (report_figures.run_figures), and the three files
are written through a temporary file and an atomic rename inside a directory opened without
following links: a `_report` (or `report.html`) shipped in a store as a symbolic link is
refused, never written through.
"""

from __future__ import annotations

import base64
import datetime as _dt
import io
import json
import logging
import os
import secrets
import stat
from pathlib import Path

import numpy as np

from ..errors import HarvestError
from ...store import html_text, plot_text, shard_ids, terminal

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
        rows += m.n_rows
        # a layout-3 marker sums them per point; a layout-2 one lists them per shard
        per = [m.stored_bytes] if m.stored_bytes is not None else \
            [sh.nbytes for sh in m.shards or ()]
        for nb in per:
            nb = nb or [None] * n_points
            for p in range(n_points):
                stored[p] = None if stored[p] is None or nb[p] is None else stored[p] + nb[p]
    return rows, stored


def _throughput(markers: dict) -> list[tuple[str, int]]:
    """(commit time, cumulative committed rows) in commit order."""
    events = sorted((m.committed_at, m.n_rows) for m in markers.values() if m.committed_at)
    out, total = [], 0
    for t, n in events:
        total += n
        out.append((t, total))
    return out


def _sample_shards(markers: dict, k: int, shard_rows: int) -> list[int]:
    """k committed shards evenly spaced, from the markers' row ranges (no object table read, and
    no set of every shard: 2 M of them at 1 B tokens of an 8B model)."""
    units = sorted((shard_ids(shard_rows, m) for m in markers.values()), key=lambda r: r.start)
    ends = np.cumsum([len(r) for r in units])
    n = int(ends[-1]) if len(units) else 0
    picks = range(n) if n <= k else np.linspace(0, n - 1, k).round().astype(int)
    out = []
    for i in picks:
        u = int(np.searchsorted(ends, i, side="right"))
        out.append(units[u].start + int(i) - (int(ends[u - 1]) if u else 0))
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
        log.info("report: tokens shown as ids (tokenizer %s not loadable: %s)", terminal(path),
                 type(e).__name__)
        return None


def _moments(s: dict) -> dict:
    if not s["count"]:
        return {"count": 0, "rms_norm": None, "var_median": None, "var_max": None,
                "var_argmax": None}
    var = np.asarray(s["var"], np.float64)
    return {"count": int(s["count"]), "rms_norm": float(np.sqrt(s["mean_sq_norm"])),
            "var_median": float(np.median(var)), "var_max": float(var.max()),
            "var_argmax": int(var.argmax())}


def _kept_stats(store) -> "tuple[dict, str]":
    try:
        return store.stats(subset="kept"), "kept"
    except Exception:  # noqa: BLE001 -- a store finalized before kept statistics existed
        return store.stats(subset="all"), "all"


def collect(store, tokenizer_path: str | None = None, sample_shards: int = SAMPLE_SHARDS,
            top: int = TOP_TOKENS) -> dict:
    """Every number the report shows, as JSON-able data: kept rows under the plain names
    (rms_norm, var_max, ...), all rows under `*_all`."""
    from .report_figures import dimensions, run_figures, sample_rows

    markers = store.ledger.committed_units()
    kept, subset = _kept_stats(store)
    every = store.stats(subset="all")
    points = list(store.points)
    rows, stored = _committed_sizes(markers, len(points))
    itemsize = store.np_dtype.itemsize   # logical bytes: each point at its own width
    per_point = []
    for i, p in enumerate(points):
        name, layer = _layer_key(p)
        k, a = _moments(kept[p]), _moments(every[p])
        dims = dimensions(np.asarray(kept[p]["var"], np.float64)) if kept[p]["count"] else {}
        per_point.append({
            "point": p, "name": name, "layer": layer, **k,
            "count_all": a["count"], "rms_norm_all": a["rms_norm"], "var_max_all": a["var_max"],
            **dims,
            "width": store.widths[p],
            "compression": (round(rows * store.point_row_width(p) * itemsize / stored[i], 4)
                            if stored[i] else None),
        })
    decode = _decoder(store, tokenizer_path)
    shards = _sample_shards(markers, sample_shards, store.shard_rows)
    sampled = sample_rows(store, points, shards, top) if markers else {
        "top_rows": {}, "excluded_top": {}, "norm_hist": {}}
    if decode is not None:
        for v in list(sampled["top_rows"].values()) + [[e] for e in
                                                       sampled["excluded_top"].values() if e]:
            for e in v:
                e["text"] = decode(e["token_id"])
    return {
        "url": store.url, "points": per_point, "width": store.width, "subset": subset,
        # fp8 stores: statistics and norms are of the dequantised rows, compression of the
        # stored bytes (fp8 values and their scales)
        "dtype": store.dtype,
        "committed_rows": rows, "n_rows": store.n_rows, "committed_units": len(markers),
        **sampled, "sampled_shards": shards, "run": run_figures(store),
        "throughput": _throughput(markers),
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(e: dict) -> str:
    return f"{e.get('text', e['token_id'])!r:.14} @{e['position']} |x|={e['norm']:.3g}"


def _plot(data: dict) -> bytes:
    """The report's PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters; never pick a GUI backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    kept = "kept rows" if data["subset"] == "kept" else "all rows (no kept statistics)"
    fig = plt.figure(figsize=(12, 15))
    grid = fig.add_gridspec(4, 2, height_ratios=[1, 1, 1, 0.9])
    ax = np.array([[fig.add_subplot(grid[r, c]) for c in range(2)] for r in range(3)])
    for a in (ax[0, 0], ax[0, 1], ax[1, 1]):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    for name in sorted({p["name"] for p in data["points"]}):
        pts = sorted((p for p in data["points"] if p["name"] == name and p["count"]),
                     key=lambda p: p["layer"])
        layers = [p["layer"] for p in pts]
        label = plot_text(name)
        ax[0, 0].plot(layers, [p["rms_norm"] for p in pts], "o-", label=f"{label}, {kept}")
        ax[0, 0].plot(layers, [p["rms_norm_all"] for p in pts], "x:", color="grey",
                      label=f"{label}, all rows (with BOS/special)")
        ax[0, 1].semilogy(layers, [p["var_median"] for p in pts], "o-", label=f"{label} median")
        ax[0, 1].semilogy(layers, [p["var_max"] for p in pts], "x--", label=f"{label} max")
        comp = [(p["layer"], p["compression"]) for p in pts if p["compression"]]
        if comp:
            ax[1, 1].bar([c[0] for c in comp], [c[1] for c in comp], label=label, alpha=0.7)
    ax[0, 0].set(title="RMS norm per layer (sqrt E||x||^2)", xlabel="layer")
    ax[0, 1].set(title=f"per-dimension variance ({kept})", xlabel="layer")
    ax[1, 1].set(title="compression (logical / stored)", xlabel="layer")
    hists = [(p, data["norm_hist"].get(p["point"]) or {}) for p in data["points"]]
    hists = [(p, h) for p, h in hists if h.get("counts")]
    for p, h in hists[:: max(1, -(-len(hists) // 6))]:  # at most ~6 layers, spread over depth
        e = np.asarray(h["edges"])
        ax[1, 0].step(np.sqrt(e[:-1] * e[1:]), h["counts"], where="mid",
                      label=plot_text(p["point"]))
    ax[1, 0].set(title=f"norm histogram ({kept}, sampled shards)", xlabel="|x|", xscale="log")
    for a in (ax[0, 0], ax[0, 1], ax[1, 0], ax[1, 1]):
        a.legend(fontsize=7)
    tp = data["throughput"]
    if tp:
        t0 = _dt.datetime.fromisoformat(tp[0][0])
        xs = [(_dt.datetime.fromisoformat(t) - t0).total_seconds() for t, _ in tp]
        ax[2, 0].step(xs, [n for _, n in tp], where="post")
    ax[2, 0].set(title="committed tokens over time (from commit markers)", xlabel="seconds",
                 ylabel="tokens")
    _runs_panel(ax[2, 1], data["run"])
    tab = fig.add_subplot(grid[3, :])
    tab.axis("off")
    tab.set_title(f"largest-norm tokens per point ({kept}, special tokens filtered; token, "
                  "@position, norm) | largest excluded row")
    lines = []
    shown = data["points"] if len(data["points"]) <= 16 else data["points"][:: -(-len(data["points"]) // 16)]
    for p in shown:
        cells = "   ".join(_fmt(e) for e in data["top_rows"].get(p["point"], [])[:3])
        sink = data["excluded_top"].get(p["point"])
        lines.append(f"{p['point']:>16}  {cells}" + (f"  | {_fmt(sink)}" if sink else ""))
    tab.text(0.0, 1.0, "\n".join(plot_text(ln) for ln in lines) or "(nothing committed)",
             family="monospace", fontsize=7, va="top", transform=tab.transAxes)
    fig.suptitle(plot_text(f"{data['url']}: {data['committed_rows']:,} tokens committed, width "
                           f"{data['width']} {data.get('dtype', '')}"))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()


def _runs_panel(a, run: dict) -> None:
    """Per run (a scheduled store's ticks): each actor's capture rate, step fill in the label."""
    runs = run.get("runs") or []
    for i, r in enumerate(runs):
        for act in r["per_actor"]:
            a.scatter([i], [act["tokens_per_second"] or 0], s=12, color=f"C{act['index'] % 10}")
        a.scatter([i], [r["tokens_per_second"] or 0], marker="_", s=200, color="k")
    a.set(title="tok/s per run (black: run, dots: actors)", xlabel="run / tick", ylabel="tok/s")
    fills = [act["step_fill"] for r in runs for act in r["per_actor"] if act.get("step_fill")]
    reasons = ", ".join(f"{plot_text(k)} {v:,}"
                        for k, v in sorted(run.get("skipped_reasons", {}).items()))
    a.text(0.01, 0.98, (f"step fill {min(fills):.2f}-{max(fills):.2f}\n" if fills else "")
           + f"source rows {run.get('rows_read', 0):,}; skipped: {reasons or 'none'}",
           transform=a.transAxes, va="top", fontsize=7)


def _run_row(i: int, r: dict) -> str:
    """One run's row of the HTML table; every value escaped (tick records are the store's)."""
    h = html_text
    actors = ", ".join(f"#{h(a['index'])}: {h(a['tokens_per_second'])} tok/s" for a in r["per_actor"])
    fill = ", ".join(h(a["step_fill"]) for a in r["per_actor"])
    return (f"<tr><td>{i}</td><td>{h(r['status'])}</td><td>{h(r['tokens'])}</td>"
            f"<td>{h(r['tokens_per_second'])}</td><td>{actors}</td><td>{fill}</td></tr>")


def _html(data: dict, png: bytes) -> str:
    """The HTML page: the picture inline, the tables; every string escaped (html_text)."""
    h = html_text
    img = base64.b64encode(png).decode()
    nan = float("nan")
    rows = []
    for p in data["points"]:
        cells = ", ".join(
            f"{h(repr(e.get('text', e['token_id'])))} (row {e['row']}, pos {e['position']}, "
            f"|x| {e['norm']:.3g})" for e in data["top_rows"].get(p["point"], []))
        sink = data["excluded_top"].get(p["point"])
        outl = ", ".join(f"{o['dim']} ({o['x_median']}x)" for o in p.get("outliers", []))
        rows.append(
            f"<tr><td>{h(p['point'])}</td><td>{p['rms_norm'] or nan:.4g}</td>"
            f"<td>{p['rms_norm_all'] or nan:.4g}</td>"
            f"<td>{p['var_max'] or nan:.3g} (dim {p['var_argmax']})</td>"
            f"<td>{p.get('dead_dims', '')}</td><td>{p.get('outlier_dims', '')}: {outl}</td>"
            f"<td>{p['compression'] or ''}</td><td>{cells}</td>"
            f"<td>{h(_fmt(sink)) if sink else ''}</td></tr>")
    run = data["run"]
    runs = "".join(_run_row(i, r) for i, r in enumerate(run["runs"]))
    reasons = ", ".join(f"{h(k)}: {v:,}" for k, v in run["skipped_reasons"].items())
    return (
        "<!doctype html><meta charset='utf-8'><title>harvest report</title>"
        f"<h1>{h(data['url'])}</h1>"
        f"<p>{data['committed_rows']:,} tokens committed in {data['committed_units']} units; "
        f"statistics of {h(data['subset'])} rows (special tokens and skipped positions left out; "
        f"'all rows' columns include them); generated {h(data['generated_at'])}.</p>"
        f"<img src='data:image/png;base64,{img}' style='max-width:100%'>"
        "<h2>Per point</h2><table border=1 cellpadding=3><tr><th>point</th><th>RMS norm</th>"
        "<th>RMS norm, all rows</th><th>max dim variance</th><th>dead dims</th>"
        "<th>outlier dims (x median variance)</th><th>compression</th><th>largest-norm tokens "
        f"(sampled shards {h(data['sampled_shards'])})</th><th>largest excluded row</th></tr>"
        + "".join(rows) + "</table>"
        f"<h2>Source rows</h2><p>{run['rows_read']:,} read; skipped: {reasons or 'none'}</p>"
        "<h2>Runs (ticks)</h2><table border=1 cellpadding=3><tr><th>#</th><th>status</th>"
        "<th>tokens</th><th>tok/s</th><th>per actor</th><th>step fill</th></tr>" + runs
        + "</table>"
    )


REPORT_FILES = ("report.png", "report.html", "report.json")


def _open_report_dir(out: Path) -> int:
    """A descriptor of the report directory `out` (made when missing), never through a link:
    `lstat` first, then an O_NOFOLLOW open, so a link swapped in between fails too."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        out.mkdir(parents=True, exist_ok=True)
        st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode):
        raise HarvestError(
            f"harvest report: {terminal(out)} is a symbolic link (to {terminal(os.readlink(out))}); "
            "a report is never written through a link, which a store made elsewhere can ship "
            "pointing anywhere: remove the link, or write the report elsewhere with --out DIR")
    if not stat.S_ISDIR(st.st_mode):
        raise HarvestError(f"harvest report: {terminal(out)} is not a directory; remove it, or "
                           "write the report elsewhere with --out DIR")
    return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _refuse_links(dfd: int, out: Path) -> None:
    """Refuse, before anything is written, a report file in `out` that is a link or not a
    regular file (a rename would replace a link rather than write through it, but a link there
    says the directory is not what it seems)."""
    for name in REPORT_FILES:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise HarvestError(f"harvest report: {terminal(out / name)} is {what}; a report is "
                               "never written through one: remove it, or write the report "
                               "elsewhere with --out DIR")


def _write_replacing(dfd: int, name: str, data: bytes) -> None:
    """`name` in the directory `dfd` holds `data`: a new temporary file (O_EXCL, O_NOFOLLOW)
    renamed over it, so a reader sees the old file or the new one, and no link is followed."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        raise


def write_report(url: str, storage_options: dict | None = None, out_dir: "str | Path | None" = None,
                 tokenizer_path: str | None = None) -> dict:
    """Write report.png, report.html and report.json; returns their paths and the data.

    `out_dir` defaults to `<store>/_report` for a local store (beside the data it describes) and to
    `./harvest-report` for a remote one (a PNG on S3 is no use to a person at a terminal). A link
    at `out_dir` or at one of the three files is refused (HarvestError naming it) before anything
    is written.
    """
    from ...store import open_store

    store = open_store(url, storage_options=storage_options, read_only=True)
    if out_dir is None:
        out_dir = store.location.report_dir()
    out = Path(out_dir)
    dfd = _open_report_dir(out)
    try:
        _refuse_links(dfd, out)
        data = collect(store, tokenizer_path)
        png = _plot(data)
        files = {"report.png": png, "report.html": _html(data, png).encode("utf-8"),
                 # ASCII JSON: the store's strings as escapes, lone surrogates included
                 "report.json": json.dumps(data, indent=1).encode("ascii")}
        _refuse_links(dfd, out)
        for name, body in files.items():
            _write_replacing(dfd, name, body)
    finally:
        os.close(dfd)
    return {"png": str(out / "report.png"), "html": str(out / "report.html"),
            "json": str(out / "report.json"), "data": data}
