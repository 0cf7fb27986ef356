"""The corpus as blocks: deterministic slices of the source, planned from metadata alone.

The driver never reads the corpus. It lists files and sizes (or parquet row groups, or a
`save_to_disk` dataset's row count, or a streaming dataset's shards) and cuts them into blocks of
about `data.block_bytes` of text; tokenising workers read and pack each block on their own. A
block is a list of segments:

- `lines`: a byte range of a local json-lines or text file; its rows are the lines that *start*
  inside the range (the standard split: no line is lost or read twice at a boundary);
- `parquet`: row groups of a local parquet file;
- `disk`: a row range of a `save_to_disk` dataset;
- `dataset`: shard i of n of the `datasets` object for the config (streaming: the
  IterableDataset's own shards, one per data file), or the whole dataset read in order when it
  cannot be split (csv, arrow streams, json arrays, a non-streaming hub dataset, `data.max_docs`).

Every reader yields (block-local row, reader position, text or None, skip reason) and can start
at a position it yielded earlier, which is what a resumed chunk needs. Block-local rows count
every source row, usable or not, so `doc_id` = rows of earlier blocks + local row is the row
index of the document in the source.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Iterator

from ..config.run import DataConfig
from .documents import DataError, ResolvedSource, open_dataset, resolve_source, shown_source

LINE_FORMATS = {"json": "json", "text": "text"}


def _segment_sizes(paths: list[str]) -> list[int]:
    return [os.path.getsize(p) for p in paths]


def plan_blocks(cfg: DataConfig, src: "ResolvedSource | None" = None) -> dict:
    """{"kind", "description", "blocks": [[segment, ...], ...]} from metadata only. `src`: the
    source as the driver resolved it (prepare), else resolved here."""
    src = resolve_source(cfg) if src is None else src
    local = src.kind == "files" and all("://" not in f and os.path.isfile(f) for f in src.files)
    if local and src.files and all(os.path.getsize(f) == 0 for f in src.files):
        raise DataError(
            f"data.source={shown_source(cfg)!r} is empty ({len(src.files)} file(s) of 0 bytes): the "
            "dataset has no rows; point data.source at the data")
    out: dict = {"kind": src.kind, "description": src.description}
    if cfg.max_docs is not None or cfg.streaming or not local and src.kind != "disk" \
            or (local and src.builder not in ("json", "text", "parquet")) \
            or (src.kind == "files" and isinstance(cfg.data_files, dict)):
        if local and src.builder in ("json", "text", "csv"):
            check_utf8(src.files, shown_source(cfg))
        out["blocks"] = _dataset_blocks(cfg, src)
        return out
    if src.kind == "disk":
        out["blocks"] = _disk_blocks(cfg, src.files[0])
        return out
    files = sorted(src.files)
    if src.builder == "parquet":
        out["blocks"] = _parquet_blocks(files, cfg.block_bytes)
    else:
        if src.builder == "json" and not all(_is_json_lines(f) for f in files):
            out["blocks"] = _dataset_blocks(cfg, src)
            return out
        out["blocks"] = _line_blocks(files, LINE_FORMATS[src.builder], cfg.block_bytes)
    return out


def check_utf8(files: list[str], source: str, block: int = 1 << 20) -> None:
    """Refuse, before anything is written, local text files the `datasets` loader would die on
    mid-run with a UnicodeDecodeError traceback (our own line readers skip and count such rows
    instead). One incremental decode pass: about a second per GB."""
    import codecs

    for path in files:
        dec = codecs.getincrementaldecoder("utf-8")()
        off = 0
        with open(path, "rb") as f:
            while True:
                buf = f.read(block)
                try:
                    dec.decode(buf, final=not buf)
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"data.source={source!r}: {path} is not UTF-8 (byte {off + e.start}); "
                        "re-encode it as UTF-8, or read it with data.streaming: false and without "
                        "data.max_docs, which skip and count undecodable rows") from None
                if not buf:
                    break
                off += len(buf)


def _is_json_lines(path: str) -> bool:
    """A .json file may hold one JSON array (not splittable by lines) or JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")


def _group(segments, block_bytes: int) -> list[list[dict]]:
    """Consecutive (segment, text bytes) into blocks of about block_bytes (a small file or row
    group shares a block: one that gives no complete context would lose its text)."""
    blocks: list[list[dict]] = []
    cur: list[dict] = []
    size = 0
    for seg, n in segments:
        cur.append(seg)
        size += n
        if size >= block_bytes:
            blocks.append(cur)
            cur, size = [], 0
    if cur:
        blocks.append(cur)
    return blocks


def _line_blocks(files: list[str], fmt: str, block_bytes: int) -> list[list[dict]]:
    """Byte ranges cut where a block reaches block_bytes."""
    def segments():
        size = 0
        for path, n in zip(files, _segment_sizes(files)):
            a = 0
            while a < n:
                b = min(n, a + block_bytes - size)
                yield {"kind": "lines", "fmt": fmt, "path": path, "start": a, "stop": b, "size": n}, b - a
                size = (size + b - a) % block_bytes
                a = b

    return _group(segments(), block_bytes)


def _parquet_blocks(files: list[str], block_bytes: int) -> list[list[dict]]:
    import pyarrow.parquet as pq

    def segments():
        for path in files:
            md = pq.ParquetFile(path).metadata
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                yield ({"kind": "parquet", "path": path, "start": g, "stop": g + 1,
                        "rows": rg.num_rows, "size": os.path.getsize(path)}, rg.total_byte_size)

    return _group(segments(), block_bytes)


def _disk_blocks(cfg: DataConfig, path: str) -> list[list[dict]]:
    ds = load_disk(cfg, path)
    n = ds.num_rows
    per_row = max(1, ds.data.nbytes // max(1, n))
    step = max(1, cfg.block_bytes // per_row)
    return [[{"kind": "disk", "path": path, "start": a, "stop": min(n, a + step), "rows": n}]
            for a in range(0, n, step)]


def _dataset_blocks(cfg: DataConfig, src) -> list[list[dict]]:
    n = 1
    if cfg.streaming and cfg.max_docs is None:
        ds, _ = open_dataset(cfg)
        n = max(1, int(getattr(ds, "n_shards", 1) or 1))
    return [[{"kind": "dataset", "shard": i, "n_shards": n}] for i in range(n)]


def load_disk(cfg: DataConfig, path: str):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"data.split={cfg.split!r} is not in {path}: splits are {list(ds)}")
        ds = ds[cfg.split]
    return ds


def check_sizes(blocks: list[list[dict]]) -> str | None:
    """The first local file whose size differs from the plan's (the data changed), or None."""
    seen: set = set()
    for blk in blocks:
        for seg in blk:
            path = seg.get("path")
            if not path or path in seen or "size" not in seg:
                continue
            seen.add(path)
            now = os.path.getsize(path) if os.path.isfile(path) else None
            if now != seg["size"]:
                return f"{path} was {seg['size']} bytes when the store was planned, now {now}"
    return None


# ---- readers -----------------------------------------------------------------------------------

class Refused:
    """A row the reader itself cannot use (bad JSON, bad encoding): skipped and counted."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _classify(text) -> "str | None":
    if text is None:
        return "null"
    if not isinstance(text, str):
        return "not_text"
    if not text.strip():
        return "empty"
    return None


def ids_problem(value) -> "str | None":
    """The skip reason of a token-id value (data.tokens_column), or None; token_input.py packs
    the rest."""
    if value is None:
        return "null"
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        return "not_tokens"
    try:
        return "empty" if len(value) == 0 else None
    except TypeError:  # a 0-d array or tensor (a scalar column in numpy/torch format)
        return "not_tokens"


def read_block(block: list[dict], cfg: DataConfig, start: dict | None = None) -> Iterator[tuple]:
    """(row, pos, text, reason) for every source row of the block, from `start` (a cursor:
    {"row", "pos"}) on; `reason` is None for usable text, else why the row is skipped."""
    classify: Callable[[Any], str | None] = _classify
    if cfg.tokens_column is not None:  # pre-tokenised rows (pipeline/data/token_input.py)
        classify = ids_problem
    elif cfg.format == "chat":
        from .chat import conversation_problem

        classify = functools.partial(conversation_problem, max_messages=cfg.max_messages,
                                     max_chars=cfg.max_conversation_chars)
    row = int(start["row"]) if start else 0
    pos = start.get("pos") if start else None
    seg0, inner = (pos[0], pos[1]) if pos else (0, None)
    for si in range(seg0, len(block)):
        seg = block[si]
        reader = _READERS[seg["kind"]]
        for at, value in reader(seg, cfg, inner if si == seg0 else None):
            if isinstance(value, Refused):
                yield row, [si, at], None, value.reason
            else:
                yield row, [si, at], value, classify(value)
            row += 1


def _skip_line(f, chunk: int = 1 << 20) -> None:
    """Move `f` past the end of the line under way (or to the end of the file), reading at
    most `chunk` bytes at a time: a line far longer than memory is skipped in constant memory."""
    while True:
        piece = f.readline(chunk)
        if not piece or piece.endswith(b"\n"):
            return


def bounded_lines(f, limit: int, stop: "int | None" = None) -> Iterator[tuple[int, "bytes | None"]]:
    """(offset, line) for each line of the binary file `f` from its position on, up to the
    line starting at `stop` (exclusive); the line is None where it is longer than `limit` bytes
    (its newline not counted; data.max_line_bytes): such a line is read no further than that
    and skipped in constant memory. Every reader of a local line file goes through here, so no
    line is ever held whole past the limit."""
    off = f.tell()
    while stop is None or off < stop:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
            _skip_line(f)
            yield off, None
            off = f.tell()
            continue
        yield off, line
        off += len(line)


def _read_lines(seg: dict, cfg: DataConfig, at: "list | None") -> Iterator[tuple]:
    """Positions are [byte offset of the line, row within the line] (a text line holding a
    Unicode line separator is several rows, as in the datasets text loader). A line longer than
    data.max_line_bytes is a row refused as `line_too_long` (bounded_lines)."""
    start, stop = seg["start"], seg["stop"]
    first_piece = 0
    with open(seg["path"], "rb") as f:
        if at is not None:
            f.seek(at[0])
            first_piece = at[1]
        elif start > 0:  # the line under way at `start` belongs to the previous range
            f.seek(start - 1)
            _skip_line(f)
        for here, line in bounded_lines(f, cfg.max_line_bytes, stop):
            if line is None:
                yield [here, 0], Refused("line_too_long")
                continue
            body = line.rstrip(b"\n")
            if seg["fmt"] == "json":
                if not body.strip():
                    continue  # blank lines are not rows (as in the datasets json loader)
                try:
                    decoded = body.decode("utf-8")
                except UnicodeDecodeError:  # counted apart: the fix is the file's encoding
                    yield [here, 0], Refused("bad_encoding")
                    continue
                try:
                    obj = json.loads(decoded)
                except ValueError:
                    yield [here, 0], Refused("bad_json")
                    continue
                yield [here, 0], (obj.get(cfg.value_column) if isinstance(obj, dict)
                                  else Refused("not_object"))
                continue
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError:
                yield [here, 0], Refused("bad_encoding")
                continue
            for k, piece in enumerate(text.splitlines() or [""]):
                if here == (at or [None])[0] and k < first_piece:
                    continue
                yield [here, k], piece


def _read_parquet(seg: dict, cfg: DataConfig, at: "int | None") -> Iterator[tuple]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(seg["path"])
    skip = at or 0
    i = 0
    for g in range(seg["start"], seg["stop"]):
        col = f.read_row_group(g, columns=[cfg.value_column]).column(0).to_pylist()
        for v in col:
            if i >= skip:
                yield i, v
            i += 1


def _read_disk(seg: dict, cfg: DataConfig, at: "int | None") -> Iterator[tuple]:
    ds = load_disk(cfg, seg["path"])
    a = seg["start"] + (at or 0)
    for s in range(a, seg["stop"], 1024):
        vals = ds[s:min(seg["stop"], s + 1024)][cfg.value_column]
        for k, v in enumerate(vals):
            yield s + k - seg["start"], v


def _read_dataset(seg: dict, cfg: DataConfig, at: "int | None") -> Iterator[tuple]:
    ds, _ = open_dataset(cfg)
    if seg["n_shards"] > 1:
        ds = ds.shard(num_shards=seg["n_shards"], index=seg["shard"])
    skip = at or 0
    if skip:
        ds = ds.skip(skip) if hasattr(ds, "skip") else ds.select(range(skip, len(ds)))
    for i, r in enumerate(ds, skip):
        if cfg.max_docs is not None and i >= cfg.max_docs:
            break
        yield i, r.get(cfg.value_column)


_READERS: dict[str, Callable[..., Iterator[tuple]]] = {
    "lines": _read_lines, "parquet": _read_parquet, "disk": _read_disk, "dataset": _read_dataset}

