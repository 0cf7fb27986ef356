"""Provenance: what a store was made from, recorded at creation (the store's `provenance`
attribute, FORMAT.md "Provenance"), so someone who did not make it can say which model, tokenizer,
data and settings gave its rows.

What is hashed, and why (costs measured here: sha256 runs at about 390 MB/s on one core of this
2-core machine; a server core with SHA extensions does 1.5-2 GB/s):

- model: its hub revision when the checkpoint sits in the hub cache (`.../snapshots/<sha>/`), and
  always the sha256 of `config.json`. Weights: a full streamed sha256 of every weight file when
  they total at most FULL_HASH_BYTES (1 GiB, under 3 s here); above that, a sha256 over each
  file's name, size, safetensors header (dtype, shape and offsets of every tensor) and
  SAMPLE_BLOCKS blocks of SAMPLE_BYTES spread evenly through the file. The samples are what tell
  a fine-tune from its base (same headers, different values); a full hash of an 8B bf16
  checkpoint (16 GB) would cost about 40 s here (8-11 s on a server core) at every run start,
  the sampled hash reads 4 shards x (header + 16 MiB), well under a second. `weights_hash` says
  which one was taken.
- tokenizer: sha256 over its files (tokenizer.json, tokenizer_config.json, vocab/merges,
  sentencepiece model, special tokens map), in name order.
- data: the source as configured (name, config, split, revision, data files; URL credentials
  masked, store/storage/credentials.py: a presigned URL keeps its host, path and expiry), what it
  resolved to, the `datasets` fingerprint of a `save_to_disk` dir, and a hash per data file (full up to
  FULL_HASH_BYTES of data in all, sampled as for weights past that: a 600 MB corpus must not
  cost a minute at every start). A hub dataset's fingerprint and download checksums come from
  the `datasets` object when it is loaded here (non-streaming); the resolved hub revision when
  the hub answers.
- harvest: its version and the sha256 of the run's content key (the settings that decide the
  rows) and of the whole redacted config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

FULL_HASH_BYTES = 1 << 30
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


def file_sha256(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def sampled_sha256(path: str) -> str:
    """sha256 of (size, safetensors header when there is one, SAMPLE_BLOCKS evenly spread blocks)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if path.endswith(".safetensors") and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, size - 8)))
        step = max(SAMPLE_BYTES, size // SAMPLE_BLOCKS)
        for off in range(0, size, step):
            f.seek(off)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def files_hashes(paths: list[str], budget: int = FULL_HASH_BYTES) -> list[dict]:
    """[{path, bytes, sha256 | sha256_sampled}] in the given order: full hashes while the running
    total stays within `budget`, sampled ones after."""
    out, spent = [], 0
    for p in paths:
        size = os.path.getsize(p)
        if spent + size <= budget:
            out.append({"path": p, "bytes": size, "sha256": file_sha256(p)})
            spent += size
        else:
            out.append({"path": p, "bytes": size, "sha256_sampled": sampled_sha256(p)})
    return out


def _combined(entries: list[dict], root: str) -> str:
    h = hashlib.sha256()
    for e in entries:
        h.update(os.path.relpath(e["path"], root).encode())
        h.update((e.get("sha256") or e["sha256_sampled"]).encode())
    return h.hexdigest()


def model_provenance(path: str, configured: str, revision: "str | None" = None) -> dict:
    """The model's revision and hashes (module docstring). `path`: the resolved checkpoint dir or
    hub name; `configured`: model.path as written."""
    out: dict = {"path": configured, "resolved": path, "revision": revision}
    d = Path(path)
    if not d.is_dir():
        try:  # a hub name: its cached snapshot, if any
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(path, "config.json", revision=revision)
            d = Path(hit).parent if isinstance(hit, str) else d
        except Exception:  # noqa: BLE001 -- nothing cached: the name and revision are all we have
            pass
    if not d.is_dir():
        return out
    m = _SNAPSHOT.search(str(d.resolve()) + "/")
    if m:
        out["revision"] = out["revision"] or m.group(1)
    if (d / "config.json").is_file():
        out["config_sha256"] = file_sha256(str(d / "config.json"))
    tok = [str(d / n) for n in TOKENIZER_FILES if (d / n).is_file()]
    if tok:
        out["tokenizer_sha256"] = _combined(files_hashes(tok), str(d))
        out["tokenizer_files"] = [Path(p).name for p in tok]
    weights = sorted(str(p) for p in d.iterdir()
                     if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if weights:
        total = sum(os.path.getsize(p) for p in weights)
        full = total <= FULL_HASH_BYTES
        entries = files_hashes(weights, FULL_HASH_BYTES if full else 0)
        out["weights_sha256"] = _combined(entries, str(d))
        out["weights_hash"] = ("sha256 of every weight file" if full else
                               f"sha256 of each file's size, safetensors header and {SAMPLE_BLOCKS} "
                               f"sampled blocks of {SAMPLE_BYTES} bytes (weights over "
                               f"{FULL_HASH_BYTES} bytes)")
        out["weights_bytes"] = total
        out["weights_files"] = [Path(p).name for p in weights]
    return out


def data_provenance(cfg, sources: dict, src=None) -> dict:
    """The data as configured and as resolved (module docstring). `cfg`: the DataConfig; `src`:
    its resolved source (prepare's), else resolved here."""
    from ...store import redact_attrs, redact_url

    from .documents import resolve_source

    out: dict = {"source": redact_url(cfg.source), "format": cfg.format, "config_name": cfg.name,
                 "split": cfg.split, "revision": cfg.revision,
                 "data_files": redact_attrs(cfg.data_files),
                 "column": cfg.tokens_column or cfg.value_column,
                 "resolved": sources.get("description"), "kind": sources.get("kind")}
    src = resolve_source(cfg) if src is None else src
    if src.kind == "disk":
        out.update(_disk_facts(src.files[0], cfg.split))
    elif src.kind == "files":
        local = [f for f in src.files if "://" not in f and os.path.isfile(f)]
        out["files"] = files_hashes(sorted(local))
        if len(local) < len(src.files):
            out["remote_files"] = [redact_url(f) for f in src.files if f not in local]
    else:
        out.update(_hub_facts(cfg))
    return out


def _disk_facts(path: str, split: str) -> dict:
    """A save_to_disk dir: its fingerprint, dataset info and arrow files (of the split, for a
    DatasetDict)."""
    d = Path(path)
    if (d / "dataset_dict.json").is_file() and (d / split).is_dir():
        d = d / split
    out: dict = {}
    try:
        state = json.loads((d / "state.json").read_text())
        out["fingerprint"] = state.get("_fingerprint")
        files = [str(d / f["filename"]) for f in state.get("_data_files") or []]
    except (OSError, ValueError):
        files = sorted(str(p) for p in d.glob("*.arrow"))
    try:
        info = json.loads((d / "dataset_info.json").read_text())
        out["dataset_info"] = {k: info.get(k) for k in
                               ("dataset_name", "config_name", "version", "builder_name", "license",
                                "citation", "homepage") if info.get(k)}
    except (OSError, ValueError):
        pass
    out["files"] = files_hashes([f for f in files if os.path.isfile(f)])
    return out


def _hub_facts(cfg) -> dict:
    """A hub dataset: the resolved revision (when the hub answers) and, when it loads here without
    streaming, the `datasets` fingerprint, info and download checksums."""
    from ...engine.models import hub_unreachable

    from .documents import open_dataset

    out: dict = {"hub": cfg.source}
    if hub_unreachable() is None:
        try:
            from huggingface_hub import HfApi

            out["resolved_revision"] = HfApi().dataset_info(cfg.source, revision=cfg.revision).sha
        except Exception as e:  # noqa: BLE001 -- recorded as unknown, not fatal
            log.info("provenance: no hub revision for %s: %s", cfg.source, e)
    if cfg.streaming:
        return out
    try:
        ds, _ = open_dataset(cfg)
    except Exception as e:  # noqa: BLE001 -- the run itself reports a source that cannot load
        log.info("provenance: %s not loaded: %s", cfg.source, e)
        return out
    out["fingerprint"] = getattr(ds, "_fingerprint", None)
    info = getattr(ds, "info", None)
    if info is not None:
        out["dataset_info"] = {k: str(getattr(info, k)) for k in
                               ("dataset_name", "config_name", "version", "license", "homepage")
                               if getattr(info, k, None)}
        checks = getattr(info, "download_checksums", None) or {}
        out["download_checksums"] = {str(k): v for k, v in checks.items()}
    return out


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def run_provenance(cfg, prep, engine: "dict | None" = None) -> dict:
    """The store's `provenance` attribute (sink.create writes it; FORMAT.md "Provenance");
    `engine`: the creating actor's engine description (`CaptureEngine.describe()`)."""
    from ... import __version__

    out = {
        "harvest": {"version": __version__, "content_key_sha256": _sha(cfg.content_key()),
                    "config_sha256": _sha(cfg.to_dict(redact=True))},
        "model": model_provenance(prep.model_path, cfg.model.path),  # the model section pins no revision
        "data": data_provenance(cfg.data, prep.sources, prep.source),
    }
    if engine:
        out["engine"] = engine_provenance(engine)
    if prep.token_source is not None:
        out["token_source"] = prep.token_source
    return out


def engine_provenance(describe: dict) -> dict:
    """What computed the rows: backend and mode, vLLM's model runner (V1 or V2), the versions."""
    keys = ("backend", "mode", "model_runner", "platform", "dtype", "tensor_parallel_size")
    out = {k: describe[k] for k in keys if describe.get(k) is not None}
    out.update({f"{k}_version": v for k, v in (describe.get("versions") or {}).items()})
    return out


def fingerprint_changed(recorded: "dict | None", cfg, src=None) -> "str | None":
    """A `save_to_disk` source whose `datasets` fingerprint differs from the one recorded at
    creation (re-saved in place with the same row count, which the plan's sizes cannot see),
    as a sentence for the resume refusal; None when it is the same or nothing was recorded.
    Conservative: `datasets` gives data built in memory a fresh fingerprint at every save, so a
    re-save of the same rows is refused too (restore the saved dir, or a new store.url)."""
    data = (recorded or {}).get("data") or {}
    was = data.get("fingerprint")
    if not was or data.get("kind") != "disk":
        return None
    from .documents import resolve_source

    src = resolve_source(cfg) if src is None else src
    if src.kind != "disk":
        return None
    now = _disk_facts_fingerprint(src.files[0], cfg.split)
    if now is not None and now != was:
        return f"{src.files[0]} had datasets fingerprint {was} when the store was made, now {now}"
    return None


def _disk_facts_fingerprint(path: str, split: str) -> "str | None":
    d = Path(path)
    if (d / "dataset_dict.json").is_file() and (d / split).is_dir():
        d = d / split
    try:
        return json.loads((d / "state.json").read_text()).get("_fingerprint")
    except (OSError, ValueError):
        return None
