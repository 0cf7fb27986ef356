"""The dataset card: `README.md` at the store's root, written at finalize and by `harvest card`.

A store is a folder (or prefix) a person may find without its maker: the card says what it is in
a minute's reading, in the Hugging Face dataset-card conventions (YAML front matter, then
Markdown), so a store copied as a folder carries it and `huggingface_hub`'s `upload_folder`
publishes it as the dataset's page unchanged. Every figure in it is read from the store's own
attributes (the `harvest:` block of the front matter repeats them as data, which tests compare
with the store); the card is derived, never a source: `harvest card URL` rewrites it from the
attributes at any time (after `harvest report`, to show the report's picture).

The front matter is written as JSON values, which YAML reads as they are: this module needs no
YAML library, so the light install (`harvest-store`) can write and refresh cards too.

The attributes are the store maker's text, so hostile input (store/escape.py): every string from
them is escaped for where it lands (ASCII JSON in the front matter, `md_text` / `md_code` in the
body), and a store attribute holding a lone surrogate or a `|` neither fails finalize nor breaks
the card's tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .storage.credentials import mask_text
from .escape import json_value, md_code, md_text, writable
from .read.filters import sink_positions, store_facts, store_special_ids
from .format.jsonattrs import JsonObject

if TYPE_CHECKING:
    from .commit.view import StoreData

CARD = "README.md"
REPORT_PNG = "_report/report.png"  # where `harvest report` writes beside a local store
SIZE_CATEGORIES = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                   (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M"),
                   (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"),
                   (10_000_000_000, "1B<n<10B"), (100_000_000_000, "10B<n<100B"),
                   (1_000_000_000_000, "100B<n<1T")]
STAT_POINTS = 8  # statistics rows shown; the rest are in the store's attributes


def size_category(rows: int) -> str:
    """The Hugging Face `size_categories` bucket of a row count."""
    for bound, name in SIZE_CATEGORIES:
        if rows < bound:
            return name
    return "n>1T"


def _dict(x) -> JsonObject:
    """`x` where it is a dict, else {}: an attribute of another shape is read as absent."""
    return x if isinstance(x, dict) else {}


def _count(x) -> int:
    """A row count from the attributes: an int, else 0 (a count of another type is absent)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def card_facts(store: StoreData) -> JsonObject:
    """The figures the card shows, from the store's attributes only (the `harvest:` block)."""
    a = store.attributes
    run = store.attrs
    rows = _count(a.get("committed_rows"))
    C = store.context_size
    model = _dict(run.get("model"))
    prov = _dict(run.get("provenance"))
    ratio = _dict(a.get("compression_ratio"))
    return {
        "model": _dict(_dict(run.get("config")).get("model")).get("path") or store.tokenizer,
        "model_revision": _dict(prov.get("model")).get("revision") or model.get("revision"),
        "model_weights_sha256": _dict(prov.get("model")).get("weights_sha256"),
        "n_layers": model.get("n_layers"),
        "engine": model.get("backend"),
        "points": list(store.points),
        "width": store.width,
        "widths": dict(store.widths) if store.mixed_widths else None,
        "dtype": store.dtype,
        "rows": rows,
        "tokens": rows,
        "contexts": rows // C if C else None,
        "context_size": C,
        "stored_bytes": ratio.get("stored_bytes"),
        "compression_ratio": ratio.get("overall"),
        "bos_token_id": store.bos_token_id,
        "special_token_ids": store.special_token_ids,
        "stats_skip_positions": store.stats_skip_positions,
        "layout_version": store.layout_version,
        "finalized_at": a.get("finalized_at"),
        # a shuffled copy (store/shuffled_copy.py): rows are not in token order
        "shuffled": run.get("shuffled") if isinstance(run.get("shuffled"), dict) else None,
    }


def _front_matter(facts: dict, run: dict) -> str:
    prov = _dict(run.get("provenance"))
    data = _dict(prov.get("data"))
    info = _dict(data.get("dataset_info"))
    meta: dict = {}
    if info.get("license"):
        meta["license"] = info["license"]
    meta["pretty_name"] = f"{facts['model'] or 'harvest'} activations ({len(facts['points'])} points)"
    meta["size_categories"] = [size_category(facts["rows"])]
    meta["task_categories"] = ["feature-extraction"]
    meta["tags"] = ["activations", "interpretability", "sparse-autoencoder", "harvest", "zarr"]
    sources = [data.get("source")] if data.get("kind") == "hub" else []
    original = _dict(prov.get("token_source")).get("original_dataset")
    original = str(original or "")
    if original.count("/") == 1 and not original.startswith(("/", ".", "~")):
        # a hub dataset name the ids were made from (SAELens's record), not a local path
        sources.append(original)
    if sources:
        meta["source_datasets"] = sources
    meta["harvest"] = facts
    return "---\n" + "".join(f"{k}: {json_value(v)}\n" for k, v in meta.items()) + "---\n"


def _fmt(x) -> str:
    """A figure as Markdown text (a non-number from the attributes escaped as text)."""
    if isinstance(x, float):
        return f"{x:.4g}"
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else md_text(x)


def _stats_table(store: StoreData) -> str:
    a = store.attributes
    kept = _dict(a.get("stats_kept"))
    every = _dict(a.get("stats"))
    if not every:
        return "No statistics (the store is not finalized).\n"
    lines = ["| point | rows kept | mean ‖x‖ | E‖x‖² (kept) | mean variance | non-finite |",
             "|---|---|---|---|---|---|"]
    for p in store.points[:STAT_POINTS]:
        s = _dict(kept.get(p) or every.get(p))
        lines.append(f"| {md_code(p)} | {_fmt(s.get('count'))} | {_fmt(s.get('mean_norm'))} | "
                     f"{_fmt(s.get('mean_sq_norm'))} | {_fmt(s.get('mean_var'))} | "
                     f"{_fmt(s.get('nonfinite_rows'))} |")
    more = len(store.points) - STAT_POINTS
    tail = f"\n{more} more points: `store.stats(points, subset=\"kept\")`.\n" if more > 0 else "\n"
    return "\n".join(lines) + tail


def _row_filter_lines(store: StoreData) -> list[str]:
    """The reader options of the card's example: the store's kept rows where it records its
    special ids (`exclude_special=True` drops the sink positions too), else the sink positions."""
    facts = store_facts(store)
    sinks = sink_positions(facts)
    pad = " " * 23
    if store_special_ids(facts):
        return [f"{pad}exclude_special=True,   # the kept rows: no special token"
                + (f", no attention-sink position 0-{sinks - 1}" if sinks else "")]
    return [f"{pad}seqpos=slice({sinks}, None),   # no attention-sink position 0-{sinks - 1}"] \
        if sinks else []


def _short(x, n: int = 16) -> str:
    """The first n characters of an attribute (a hash), whatever its type."""
    return str(x or "")[:n]


def card_text(store: StoreData) -> str:
    """The card: front matter, then the body (module docstring). Every string from the
    attributes is escaped (md_text as text, md_code as monospace)."""
    run = store.attrs
    f = card_facts(store)
    prov = _dict(run.get("provenance"))
    data, mprov, hv = _dict(prov.get("data")), _dict(prov.get("model")), _dict(prov.get("harvest"))
    cfg = _dict(run.get("config"))
    pts = f["points"]
    name = f["model"] or "an unnamed model"
    shown = ", ".join(md_code(p) for p in pts[:6]) + (
        f" and {len(pts) - 6} more" if len(pts) > 6 else "")
    corpus = data.get("resolved") or _dict(run.get("data")).get("source") or "unknown"
    ident = mprov.get("revision") or _short(mprov.get("weights_sha256")) or "not recorded"
    token_src = _dict(prov.get("token_source"))
    shuffled = f.get("shuffled")
    version = hv.get("version") or _dict(store.harvest_attrs.get("created_by")).get("harvest", "")
    picture = (f"![harvest report]({REPORT_PNG})\n\n" if store.location.exists(REPORT_PNG)
               else "No picture yet: `harvest report URL` then `harvest card URL` adds one.\n\n")
    ratio = f"{md_text(f['compression_ratio'])}×" if f["compression_ratio"] else "not recorded"
    body = [
        f"# Activations of {md_text(name)}\n",
        f"Residual-stream and other activations captured by harvest {md_text(version)}: one row "
        "per token, every point's row i the same token, with `token_id`, `doc_id` and `position` "
        "columns saying which.\n",
        "| | |", "|---|---|",
        f"| model | {md_code(name)} (revision or weights sha256: "
        f"{md_code(ident)}) |",
        f"| points | {len(pts)}: {shown} |",
        f"| width, dtype | {_fmt(f['width'])}, {md_text(f['dtype'])} |",
        *(["| widths | " + ", ".join(f"{md_text(p)} {_fmt(w)}" for p, w in f["widths"].items()) + " |"]
          if f.get("widths") else []),
        f"| rows (tokens) | {_fmt(f['rows'])}" + (f" in {_fmt(f['contexts'])} contexts of "
                                                  f"{_fmt(f['context_size'])}" if f["context_size"]
                                                  else "") + " |",
        f"| stored | {_fmt(f['stored_bytes'])} bytes, compression {ratio} |",
        f"| corpus | {md_text(corpus)}, split {md_code(data.get('split', ''))}, column "
        f"{md_code(data.get('column', ''))}"
        + (f", fingerprint {md_code(data['fingerprint'])}" if data.get("fingerprint")
           else "") + " |",
        "| tokens from | " + (f"pre-tokenised ids ({md_code(token_src.get('column'))}, "
                               f"tokenizer {md_text(token_src.get('tokenizer_name') or 'not recorded')})"
                               if token_src else "text tokenised by the model's tokenizer") + " |",
        f"| filters | BOS id {md_text(f['bos_token_id'])}, special ids "
        f"{md_text(f['special_token_ids'])}; statistics `kept` leave out those and the first "
        f"{md_text(f['stats_skip_positions'])} position(s) of each context |",
        *([f"| row order | shuffled: a copy of {md_code(shuffled.get('source'))} with its "
           f"rows in one random order (seed {md_text(shuffled.get('seed'))}); `source_row` says which "
           "row of it each row is, so contexts are not runs of rows here |"] if shuffled else []),
        "",
        "## Statistics (kept rows)\n",
        _stats_table(store),
        picture,
        "## Read it\n",
        "Full install (`pip install harvest`) or the light one (`pip install "
        "harvest-store[torch]`): the same lines.\n",
        "```python",
        "from harvest.store import open_store",
        "from harvest.store.read.dataset import ActivationDataset",
        # a JSON string is a Python string literal, on one line: the fence cannot end in it
        f"ds = ActivationDataset(open_store(\"<this folder or s3://...>\"), "
        f"points={json_value(pts[0] if pts else '')}, batch_size=4096,",
        *_row_filter_lines(store),
        "                       normalize=\"norm_scale\")  # E||x||^2 = width over the rows yielded",
        "```\n",
        "## How it was made\n",
        f"`harvest run` (config sha256 {md_code(_short(hv.get('config_sha256')))}, content key "
        f"sha256 {md_code(_short(hv.get('content_key_sha256')))}), backend "
        f"{md_code(_dict(cfg.get('model')).get('backend', ''))}, packing "
        f"{md_code(json_value(_dict(cfg.get('packing'))))}. Finalized {md_text(f['finalized_at'])}. "
        "The full configuration is `attrs[\"run\"][\"config\"]` of the root `zarr.json`; model, "
        "tokenizer and data hashes are `attrs[\"run\"][\"provenance\"]`; the layout is harvest's "
        f"FORMAT.md (layout version {md_text(f['layout_version'])}).\n",
    ]
    # masked whole (credentials.mask_text): the card is published as the dataset's page, and a
    # store made before the attributes were masked may hold a presigned corpus URL
    return mask_text(_front_matter(f, run) + "\n" + "\n".join(body))


def write_card(store: StoreData) -> str:
    """Write (or refresh) README.md at the store's root; returns its text."""
    text = writable(card_text(store))   # (every attribute string is escaped already)
    store.location.write_bytes(CARD, text.encode("utf-8"))
    return text
