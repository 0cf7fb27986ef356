"""Human output of `plan`, `status`, `verify` and `inspect`: short tables, sizes in MB/GB.

Only formatting: each function takes the dict the command prints with `--json` (the machine
form, unchanged) and returns text, so the two forms cannot disagree and views/verify stay free to
change what they compute.

`status`, `verify` and `inspect` show a store's own text (its attributes, marker fields, error
messages that quote them), and a store may come from anyone: their strings pass through
store/escape.py's `terminal` first (escape sequences, `\r` and other controls shown as escapes,
never sent to the terminal), and figures print only when they are numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...store import terminal, terminal_data

if TYPE_CHECKING:
    from ...store import VerifyReport


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def size(n: "float | None") -> str:
    if not _is_number(n) or not math.isfinite(n):
        return "?" if n is None or not _is_number(n) else str(n)
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def duration(s: "float | None") -> str:
    if s is None or not math.isfinite(s):
        return "?"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_text(p: dict) -> str:
    """`harvest plan`: what the run will write and roughly how long it takes."""
    lines = [f"store     {p['store']}"
             + ("  (exists: a run resumes it)" if p["store_exists"] else "")]
    lines.append(f"model     {p['model_path']}: {p['points']} points x width {p['width']}, "
                 f"{size(p['bytes_per_token'])} per token")
    ws = p.get("widths") or {}
    if len(set(ws.values())) > 1:   # points of several widths: each at its own (FORMAT.md)
        per = (p.get("layout") or {}).get("per_point") or {}
        lines.append("widths    " + ", ".join(
            f"{k} {w}" + (f" ({size(per[k]['bytes_logical'])})" if per.get(k, {}).get("bytes_logical")
                          else "") for k, w in ws.items()))
    text = f"{size(p['corpus_bytes'])} of text, " if p.get("corpus_bytes") else ""
    lines.append(f"data      {p['data']}: {text}{p['blocks']} block(s) of up to "
                 f"{size(p['block_bytes'])}")
    budget = f"{p['max_tokens']:,} tokens" if p.get("max_tokens") else "the whole corpus"
    lines.append(f"budget    {budget}, contexts of {p['context_size']}")
    lines.append(f"layout    units of {p['unit_rows']:,} rows, shards of {p['shard_rows']:,}, "
                 f"chunks of {p['chunk_rows']:,}")
    est = p.get("estimate") or {}
    if est.get("tokens"):
        lines.append(f"estimate  {est['tokens']:,} tokens ({est['tokens_source']}): "
                     f"{size(est['bytes_logical'])} logical, ~{size(est['bytes_stored'])} stored "
                     f"at {est['compression']}x, ~{duration(est['seconds'])} "
                     f"({est['rate_note']})")
        lines.append(f"rate      {est['rate_source']}")
    if p.get("layout"):
        lines += layout_lines(p["layout"])
    d = p.get("dataplane")
    if d:
        lines.append(f"dataplane ~{d['cores_needed_per']:g} host cores per {d['per']} for the write path at "
                     f"{d['tokens_per_second_per']:,} tok/s per {d['per']} ({d['gb_per_second_per']:g} GB/s "
                     f"of rows x {d['write_core_s_per_gb']:g} core-s/GB); the actors reserve "
                     f"{d['cores_reserved_per']:g} per {d['per']} ({d['source']})")
    st = p.get("stream")
    if st:
        net = f", {size(st['network_bytes'])} over the run" if st.get("network_bytes") else ""
        stored = f", {size(st['bytes_stored'])} stored" if st.get("bytes_stored") else ""
        lines.append(f"stream    no store: ~{st['capture_cores_per']:g} host cores per {st['per']} on the "
                     f"capture side and ~{st['trainer_cores_total']:g} on the trainers' side for "
                     f"{st['network_gb_per_second_per']:g} GB/s per {st['per']} to the trainers{net}; "
                     f"a store: ~{st['store_write_cores_per']:g} per {st['per']} to write{stored}, then "
                     f"~{st['store_read_cores_total_per_epoch']:g} on the trainers' side to read each "
                     f"epoch ({st['source']})")
    if p.get("planned_units") is not None:
        lines.append(f"stored    plan of {p['planned_units']} units, {p['planned_tokens']:,} tokens"
                     + ("" if p.get("plan_complete") else " so far (the plan grows as the corpus "
                        "is tokenised)"))
    for w in (p.get("warnings") or []) + ((p.get("layout") or {}).get("warnings") or []):
        lines.append(f"warning   {w}")
    return "\n".join(lines)


def layout_lines(c: dict) -> list[str]:
    """`plan`'s objects and requests (pipeline/cli/objectcost.py)."""
    k = c.get("objects_by_kind")
    data = (f"data of ~{size(c['data_object_bytes'])} stored "
            f"({size(c['data_object_bytes_logical'])} logical at {c['compression']}x)")
    meta = f"row metadata of ~{size(c['meta_object_bytes'])}"
    marker = f"of ~{size(c['marker_bytes'])}"
    if k:
        what = (f"objects   {c['objects']:,} for {c['tokens']:,} tokens: {k['data']:,} {data}, "
                f"{k['meta']:,} {meta}, {k['markers']:,} markers {marker}, {k['sidecars']:,} stats "
                f"sidecars, {k.get('tables', 0):,} object tables, {k['index']} index")
    else:
        n = c["shards_per_unit"]
        what = (f"objects   per unit: {n * c['points']:,} {data}, {c.get('meta_columns', 3)} {meta}, 1 of "
                f"the {marker}, 1 stats sidecar, 1 object table")
    w = c["writes_per_unit"]
    n = c["shards_per_unit"]
    b = c.get("writes_per_unit_by_request") or {}
    how = (f"{b['create_multipart_upload']:,} multipart uploads started, {b['upload_part']:,} parts, "
           f"1 object table, 1 stats sidecar, the marker (the commit), then "
           f"{b['complete_multipart_upload']:,} CompleteMultipartUpload to publish"
           if b else f"{w['objects']:,} for its objects")
    req = (f"requests  ~{c['requests_per_unit']:,.0f} per unit of {n:,} shard{'s' * (n != 1)} "
           f"({how}, {w['index']:g} for the index; {c['reads_per_unit']:,} GETs)")
    if c.get("writes_per_second") is not None:
        req += (f"; at {c['rate_tokens_per_second']:,.0f} tok/s ~{c['writes_per_second']:,} "
                f"writes/s and ~{c['reads_per_second']:,} reads/s to one prefix (S3: "
                f"~{c['limits']['writes_per_second_per_prefix']:,} writes/s, "
                f"~{c['limits']['reads_per_second_per_prefix']:,} reads/s per prefix)")
    if not c["object_store"]:
        req += "; on object storage (this store is local)"
    return [what, req]


def status_state(s: dict) -> str:
    if s.get("missing_store"):
        return "no store yet"
    if s["finalized"]:
        return "finished, but damaged (run harvest verify)" if s.get("damaged") else "finished"
    if s["plan_complete"] and s["committed_units"] == s["planned_units"] and s["planned_units"]:
        return "all units committed, not finalized (re-run to finalize)"
    if s.get("paused"):
        return "paused by a scheduled tick (healthy; the next `harvest schedule extend` continues)"
    return "running" if s.get("active") else "interrupted (re-run the same config to resume)"


def status_text(s: dict) -> str:
    s = terminal_data(s)
    if s.get("missing_store"):
        d = s.get("driver") or {}
        who = (f"driver pid {d.get('pid')} on {d.get('host')} holds the lease (heartbeat "
               f"{d.get('heartbeat_age_s'):.0f} s ago): the job is starting"
               if d.get("live") else "the job may still be starting")
        return (f"no store at {s['url']} yet: {who} (the store is created once the engines "
                "are up)")
    state = status_state(s)
    lines = [f"{s['url']}: {state}",
             f"  {s['committed_units']}/{s['planned_units']} units, "
             f"{s['committed_rows']:,}/{s['planned_rows']:,} tokens ({100 * s['fraction']:.1f}%)"
             + ("" if s["plan_complete"] else "; the plan is still growing")]
    if s.get("paused") and s.get("budget_rows"):
        lines.append(f"  {s['committed_rows']:,} of the {s['budget_rows']:,}-token budget "
                     f"(packing.max_tokens): {100 * s['committed_rows'] / s['budget_rows']:.1f}%")
    if s.get("finalized") and isinstance(s.get("summary"), dict):
        sm = s["summary"]
        rate = sm.get("tokens_per_second")
        lines.append(f"  {size(sm.get('bytes_stored'))} stored, compression "
                     f"{sm.get('compression_ratio')}x, "
                     + (f"{rate:.0f}" if _is_number(rate) else "?") + " tok/s, "
                     f"finished {sm.get('finished_at')}")
    elif s.get("active") and s.get("recent_tokens_per_second"):
        lines.append(f"  {s['recent_tokens_per_second']:.0f} tok/s from commit times"
                     + (f", ~{duration(s['eta_seconds'])} left" if s.get("eta_seconds") else ""))
    if s.get("last_commit"):
        lines.append(f"  last commit {s['last_commit']}"
                     + (f" ({duration(s['seconds_since_last_commit'])} ago)"
                        if s.get("seconds_since_last_commit") is not None else ""))
    if s["per_actor"]:
        rows = [[k, v["units"], f"{v['tokens']:,}", ",".join(map(str, v["pids"]))]
                for k, v in s["per_actor"].items()]
        lines.append(_indent(table(rows, ["actor", "units", "tokens", "pids"])))
    if s.get("damaged"):
        lines.append(f"  damaged: finalized, but {s.get('n_missing_units')} planned units have lost "
                     "their commit marker: run harvest verify")
    if s.get("n_unpublished_units"):
        n = s["n_unpublished_units"]
        lines.append(f"  {n} committed units unpublished (zarr-only readers see fill there): "
                     + ("their writers are publishing them" if s.get("active") else
                        f"run `harvest finalize {s['url']}`")
                     + f" {s['unpublished_units'][:10]}")
    if s["missing_units"] and (not s["finalized"] or s.get("damaged")):
        more = "" if len(s["missing_units"]) < 50 else " ..."
        lines.append(f"  uncommitted units: {s['missing_units'][:20]}{more}")
    return "\n".join(lines)


def verify_text(v: VerifyReport, complete: bool) -> str:
    """The report in lines; its messages quote the store (unit names, recorded values), so
    each is escaped whole (`terminal`, its own newlines too)."""
    state = "OK" if complete else ("INCOMPLETE" if v.missing_units else "FAILED")
    lines = [f"{state}: {v.committed_units}/{v.planned_units} units, "
             f"{v.committed_rows:,}/{v.planned_rows:,} rows committed"]
    c = v.checked or {}
    if v.deep_checked:
        lines.append(f"  deep: {c.get('shards', c.get('objects', 0)):,} shard objects, "
                     f"{c.get('meta_chunks', 0):,} metadata chunks, {c.get('sidecars', 0):,} stats "
                     f"sidecars read back ({size(c.get('bytes_read', 0))}) for "
                     f"{c.get('markers', 0):,} committed units, checked against their markers' "
                     "digests")
    elif c.get("objects"):
        lines.append(f"  sizes of {c.get('objects', 0):,} objects of {c.get('markers', 0):,} "
                     f"committed units checked ({size(v.stored_bytes)}); --deep reads "
                     "every byte")
    else:
        lines.append(f"  markers and publish records of {c.get('markers', 0):,} committed units "
                     "checked (each unit's objects were found at their recorded sizes when it "
                     "was published); objects not listed now: --objects lists them, --deep reads "
                     "every byte")
    if v.missing_units:
        lines.append(f"  uncommitted units: {terminal(v.missing_units[:20])}")
    lines += [f"  {terminal(e)}" for e in v.errors[:20]]
    return "\n".join(lines)


def inspect_text(i: dict) -> str:
    i = terminal_data(i)
    attrs = i.get("attrs") if isinstance(i.get("attrs"), dict) else {}
    model = attrs.get("model") if isinstance(attrs.get("model"), dict) else {}
    lines = [f"{i['url']}  (layout v{i['layout_version']}, "
             + ("finalized" if i["finalized"] else "not finalized") + ")",
             f"  model      {model.get('model') or attrs.get('model_path') or '?'} "
             f"({model.get('backend', '?')}/{model.get('mode', '?')})",
             f"  rows       {i['committed_rows']:,} committed of {i['n_rows']:,} "
             f"({i['committed_units']}/{i['planned_units']} units), context {i['context_size']}",
             f"  arrays     {len(i['points'])} points x width {i['width']} {i['dtype']}"
             + (" (+ a float32 scale per row)" if i["dtype"] == "float8_e4m3fn" else "")
             + ("; widths " + ", ".join(f"{p} {w}" for p, w in i["widths"].items())
                if len(set((i.get("widths") or {}).values())) > 1 else "")
             + ", shards of "
             f"{i['shard_rows']:,} rows, chunks of {i['chunk_rows']:,}",
             f"  codec      {codec(i.get('compression'))}" + _ratio(i.get("compression_ratio")),
             f"  tokens     BOS {i.get('bos_token_id')}, special {i.get('special_token_ids')}, "
             f"stats skip {i.get('stats_skip_positions')} leading positions"]
    st = i.get("stats_summary")
    if st:
        rows = [[p, f"{d['count']:,}", f"{d['rms_norm']:.3g}", f"{d['mean_norm']:.3g}",
                 f"{d['var_mean']:.3g}", f"{d['var_max']:.3g}", d["nonfinite_rows"]]
                for p, d in st.items()]
        lines.append("  statistics of kept rows (no special tokens, no leading positions):")
        lines.append(_indent(table(rows, ["point", "rows", "rms norm", "|mean|", "mean var",
                                          "max var", "non-finite"])))
    elif not i["finalized"]:
        lines.append("  statistics: written when the run finalizes")
    r = i.get("rows")
    if r:
        first = next(iter(r["norms"]), None)
        hdr = ["row", "token", "text", "doc", "pos"] + ([f"norm {first}"] if first else [])
        body = []
        for k in range(r["stop"] - r["start"]):
            text = (r.get("text") or [""] * (k + 1))[k]
            body.append([r["start"] + k, r["token_id"][k], repr(text)[:20], r["doc_id"][k],
                         r["position"][k]] + ([f"{r['norms'][first][k]:.2f}"] if first else []))
        lines.append(_indent(table(body, hdr)))
    return "\n".join(lines)


def codec(c) -> str:
    if not isinstance(c, dict):
        return str(c)
    if c.get("codec") == "blosc":
        return (f"blosc {c.get('cname')}-{c.get('clevel')}, {c.get('shuffle')}, "
                f"{size(c.get('blocksize'))} blocks")
    return ", ".join(f"{k}={v}" for k, v in c.items())


def _ratio(r) -> str:
    if isinstance(r, dict):
        r = r.get("overall")
    if not r:
        return ""
    return f"; stored at {r}x"


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line for line in text.splitlines())
