"""Documents from a `datasets` source: hub name, local files, a `save_to_disk` dir, or streaming.

The driver reads documents in one deterministic order (file names sorted, dataset order kept)
because resume and the exactly-once check both rely on the same config giving the same tokens in
the same rows. Rows without usable text are counted and skipped: one bad row in a billion must not
kill a run, but a wrong column name must fail before anything is written.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

# the section and path helper from the modules that own them (config.py re-exports both): the
# config never imports this runtime module, so the import runs one way (no cycle)
from .default_corpus import pydoc_corpus_path
from ..config.corpus import DataConfig
from ..config.paths import expand_path
from ...store import mask_text, redact_attrs, redact_url

log = logging.getLogger(__name__)

SUFFIX_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".arrow": "arrow",
    ".csv": "csv",
}
BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text",
            "arrow": "arrow", "csv": "csv"}
DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataError(ValueError):
    """The dataset cannot give documents; the message names the field and the fix."""


@dataclass
class DataStats:
    rows_read: int = 0
    rows_skipped: int = 0
    skipped_reasons: dict = field(default_factory=dict)
    source: str = ""

    def skip(self, reason: str) -> None:
        self.rows_skipped += 1
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "rows_read": self.rows_read,
            "rows_skipped": self.rows_skipped,
            "skipped_reasons": dict(self.skipped_reasons),
        }


@dataclass
class ResolvedSource:
    """What `open_dataset` decided to load. `files` are the paths or URLs as read (a presigned
    URL with its signature: never log or record them); `description` is for logs, summaries and
    store attrs, its URLs masked (store/storage/credentials.py)."""

    kind: str  # hub | disk | files
    builder: str | None
    files: list[str]
    description: str


def shown_source(cfg: DataConfig) -> str:
    """data.source as messages and records may show it: URL credentials masked."""
    return redact_url(cfg.source)


def resolve_source(cfg: DataConfig) -> ResolvedSource:
    source = cfg.source
    shown = redact_url(source)
    if source == "pydoc" and cfg.format is None:
        path = str(pydoc_corpus_path())
        return ResolvedSource("files", "json", [path], f"pydoc topics ({Path(path).name})")
    fmt = None if cfg.format == "chat" else cfg.format  # chat: the file format as for null
    if fmt == "hub":
        return ResolvedSource("hub", None, [], f"hub:{shown}")
    expanded = expand_path(source)
    if fmt == "disk":
        if not os.path.isdir(expanded):
            raise DataError(
                f"data.source={shown!r} is not a directory written by save_to_disk: "
                "check the path or set data.format"
            )
        return ResolvedSource("disk", None, [expanded], f"disk:{expanded}")
    if cfg.data_files is not None:
        builder = BUILDERS.get(fmt or "", fmt) if fmt else _builder_for_files(
            _flatten_files(cfg.data_files), "data.data_files"
        )
        return ResolvedSource("files", builder, _flatten_files(cfg.data_files),
                              f"{builder}:{redact_attrs(cfg.data_files)}")
    is_url = "://" in expanded
    if not is_url and os.path.isdir(expanded):
        if any(os.path.exists(os.path.join(expanded, m)) for m in DISK_MARKERS) and fmt is None:
            return ResolvedSource("disk", None, [expanded], f"disk:{expanded}")
        files = sorted(
            p for p in glob.glob(os.path.join(expanded, "**", "*"), recursive=True)
            if os.path.isfile(p) and Path(p).suffix.lower() in SUFFIX_FORMATS
        )
        if not files:
            raise DataError(
                f"data.source={shown!r} is a directory with no json/jsonl/parquet/text/arrow/csv "
                "files and no save_to_disk metadata: point it at the files or set data.format"
            )
        builder = BUILDERS[fmt] if fmt else _builder_for_files(files, "data.source")
        return ResolvedSource("files", builder, files, f"{builder}:{expanded} ({len(files)} files)")
    if not is_url and any(ch in expanded for ch in "*?["):
        files = sorted(glob.glob(expanded, recursive=True))
        if not files:
            raise DataError(
                f"data.source={shown!r} matches no files: check the pattern "
                "(a date-partitioned path must exist before the run)"
            )
        builder = BUILDERS[fmt] if fmt else _builder_for_files(files, "data.source")
        return ResolvedSource("files", builder, files, f"{builder}:{expanded} ({len(files)} files)")
    if not is_url and os.path.isfile(expanded):
        builder = BUILDERS[fmt] if fmt else _builder_for_files([expanded], "data.source")
        return ResolvedSource("files", builder, [expanded], f"{builder}:{expanded}")
    if is_url:
        builder = BUILDERS[fmt] if fmt else _builder_for_files([expanded], "data.source")
        return ResolvedSource("files", builder, [expanded], f"{builder}:{redact_url(expanded)}")
    looks_local = source.startswith((".", "/", "~")) or os.sep in source and source.count("/") > 1
    if looks_local or Path(source).suffix.lower() in SUFFIX_FORMATS:
        raise DataError(
            f"data.source={shown!r} does not exist: give an existing file, directory or glob, "
            "or a hub dataset name such as 'user/dataset' (data.format: hub)"
        )
    return ResolvedSource("hub", None, [], f"hub:{shown}")


def _flatten_files(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [expand_path(data_files)]
    if isinstance(data_files, list):
        return [expand_path(f) for f in data_files]
    out: list[str] = []
    for v in data_files.values():
        out += _flatten_files(v)
    return out


def _suffix(f: str) -> str:
    """A data file's suffix: of the path alone for a URL (a presigned URL ends in its query),
    before a `datasets` `::` chain."""
    f = f.split("::")[0]
    if "://" in f:
        f = f.split("?", 1)[0].split("#", 1)[0]
    return Path(f).suffix.lower()


def _builder_for_files(files: list[str], field_name: str) -> str:
    kinds = {SUFFIX_FORMATS.get(_suffix(f)) for f in files}
    if None in kinds:
        bad = next(f for f in files if _suffix(f) not in SUFFIX_FORMATS)
        raise DataError(
            f"{field_name}: cannot tell the format of {redact_url(bad)!r} from its suffix: set "
            "data.format to one of json, jsonl, parquet, text, arrow, csv"
        )
    if len(kinds) > 1:
        raise DataError(
            f"{field_name} mixes file formats {sorted(kinds)}: give one format per run"
        )
    return kinds.pop()


def open_dataset(cfg: DataConfig):
    """The chosen split as a `datasets.Dataset` or (streaming) `IterableDataset`."""
    import datasets

    src = resolve_source(cfg)
    try:
        if src.kind == "disk":
            ds = datasets.load_from_disk(src.files[0])
            if isinstance(ds, datasets.DatasetDict):
                if cfg.split not in ds:
                    raise DataError(
                        f"data.split={cfg.split!r} is not in {src.files[0]}: splits are "
                        f"{list(ds)}"
                    )
                ds = ds[cfg.split]
            if cfg.streaming:
                ds = ds.to_iterable_dataset()
            return ds, src
        if src.kind == "files":
            local = [f for f in src.files if "://" not in f and os.path.isfile(f)]
            if local and len(local) == len(src.files) and all(os.path.getsize(f) == 0 for f in local):
                raise DataError(
                    f"data.source={shown_source(cfg)!r} is empty ({len(local)} file(s) of 0 bytes): the "
                    "dataset has no rows; point data.source at the data"
                )
            data_files = cfg.data_files if cfg.data_files is not None else src.files
            if isinstance(data_files, dict):
                split = cfg.split
            else:
                data_files = sorted(_flatten_files(data_files))
                split = "train"
            ds = datasets.load_dataset(
                src.builder, data_files=data_files, split=split, streaming=cfg.streaming
            )
            return ds, src
        _refuse_unreachable_hub(cfg)
        ds = datasets.load_dataset(
            cfg.source,
            cfg.name,
            split=cfg.split,
            revision=cfg.revision,
            data_files=cfg.data_files,
            streaming=cfg.streaming,
        )
        return ds, src
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds; name the fields that choose the data
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        # from None: the cause's own text (and traceback) can hold the URL with its signature
        raise DataError(mask_text(
            f"cannot load data.source={shown_source(cfg)!r} (name={cfg.name!r}, split="
            f"{cfg.split!r}, revision={cfg.revision!r}) as {src.description}: "
            f"{type(e).__name__}: {msg}")) from None


def _refuse_unreachable_hub(cfg: DataConfig) -> None:
    """A hub dataset without network: one connect decides, instead of the hub client's retries
    (five, with backoff, per file) ending in an error with no hint."""
    from ...engine.models import hub_unreachable

    why = hub_unreachable()
    if why is not None:
        raise DataError(
            f"data.source={shown_source(cfg)!r} is a hub dataset name and the Hugging Face hub cannot be "
            f"reached from here ({why}): point data.source at local files, or set "
            "HF_HUB_OFFLINE=1 (and HF_DATASETS_OFFLINE=1) to use the local cache only")


def _columns(ds) -> list[str] | None:
    names = getattr(ds, "column_names", None)
    if names is None:
        feats = getattr(ds, "features", None)
        names = list(feats) if feats else None
    return list(names) if names is not None else None


def iter_texts(cfg: DataConfig, stats: DataStats | None = None) -> Iterator[tuple[int, str]]:
    """(row index in the source, text) for every row with usable text, in dataset order."""
    stats = stats if stats is not None else DataStats()
    ds, src = open_dataset(cfg)
    stats.source = src.description
    col = cfg.text_column
    cols = _columns(ds)
    if cols is not None and col not in cols:
        raise DataError(
            f"data.text_column={col!r} is not a column of {src.description}: columns are "
            f"{cols}; set data.text_column to the one holding the text"
        )
    checked = cols is not None
    for i, row in enumerate(ds):
        if not checked:
            if col not in row:
                raise DataError(
                    f"data.text_column={col!r} is not a column of {src.description}: columns "
                    f"are {sorted(row)}; set data.text_column to the one holding the text"
                )
            checked = True
        if cfg.max_docs is not None and i >= cfg.max_docs:
            break
        stats.rows_read += 1
        text = row.get(col)
        if not isinstance(text, str):
            stats.skip("not_text" if text is not None else "null")
            continue
        if not text.strip():
            stats.skip("empty")
            continue
        yield i, text
