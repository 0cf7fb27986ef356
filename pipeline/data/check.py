"""Checks of the corpus before Ray starts: from a few rows, or a small source read whole.

Each one turns a failure that would come after Ray, the tokenising workers and the engines have
started (minutes, and a message about symptoms) into one line about the input: the text column
is missing, the file is not UTF-8, the column holds chat messages (or, for chat input, holds
none), or the corpus cannot fill a
single context. They read what is cheap to read: the first rows of the first block for the
column checks; for the context check, the whole source when it is small and local, else its
first block (a corpus whose first block gives no context is broken or sorted oddly; either way the
run would have stopped there).
"""

from __future__ import annotations

import json

from ..config.corpus import DataConfig, PackingConfig
from .documents import DataError, resolve_source, shown_source
from .packing import PackingError
from .corpus_blocks import bounded_lines, load_disk, open_dataset, read_block

# A local source up to this size is read whole by the context check; larger ones by first block.
SMALL_SOURCE_BYTES = 64 << 20


def _field(cfg) -> str:
    """The config field naming the column read: data.messages_column for chat input,
    data.tokens_column for token ids."""
    if cfg.tokens_column is not None:
        return "data.tokens_column"
    return "data.messages_column" if cfg.format == "chat" else "data.text_column"


def _no_column(col: str, where: str, names, field: str = "data.text_column") -> DataError:
    what = {"data.messages_column": "the conversations",
            "data.tokens_column": "the token ids"}.get(field, "the text")
    return DataError(
        f"{field}={col!r} is not a column of {where}: columns are {list(names)}; set "
        f"{field} to the one holding {what}")


def _jsonl_probe(path: str, cfg, rows: int) -> None:
    """The first `rows` lines of a json-lines file: is `col` a key of any of them? A file that is
    not UTF-8 would read as an object without keys ("columns are []"): name the byte instead.
    Lines over data.max_line_bytes are passed over unread (the run skips them as
    `line_too_long`)."""
    col = cfg.value_column
    keys: set = set()
    seen = undecodable = not_json = 0
    first_bad = None  # (line number, file offset, byte)
    with open(path, "rb") as f:
        for lineno, (here, line) in enumerate(bounded_lines(f, cfg.max_line_bytes), 1):
            if seen >= rows:
                break
            if line is None or not line.strip():
                continue
            seen += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                undecodable += 1
                first_bad = first_bad or (lineno, here + e.start, line[e.start])
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                not_json += 1
                continue
            if isinstance(obj, dict):
                if col in obj:
                    return
                keys |= set(obj)
    if not seen:
        return
    if not keys and undecodable:
        lineno, at, byte = first_bad
        raise DataError(
            f"data.source={shown_source(cfg)!r}: {path} is not UTF-8 (byte 0x{byte:02x} at line "
            f"{lineno}, offset {at}; {undecodable} of the first {seen} lines cannot be decoded): "
            "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    if not keys:
        raise DataError(
            f"data.source={shown_source(cfg)!r}: none of the first {seen} lines of {path} is a JSON "
            f"object ({not_json} are not JSON): give JSON lines, one object per line with a "
            f"{col!r} field, or set data.format: text for plain text")
    raise _no_column(col, path, sorted(keys), _field(cfg))


def probe_text_column(cfg, blocks: list[list[dict]], rows: int = 100, src=None) -> None:
    """Fail before anything is written if no early row of the first block has the text column,
    or if the column holds no text (chat messages, numbers) in its first rows. `src`: the
    resolved source (prepare's), else resolved here."""
    if not blocks:
        return
    src = resolve_source(cfg) if src is None else src
    seg = blocks[0][0]
    col = cfg.value_column
    if seg["kind"] == "lines" and seg["fmt"] == "json":
        _jsonl_probe(seg["path"], cfg, rows)
    else:
        if seg["kind"] == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(seg["path"]).schema_arrow.names
        elif seg["kind"] == "lines":
            names = ["text"]  # the datasets text loader's one column
        else:
            ds = load_disk(cfg, seg["path"]) if seg["kind"] == "disk" else open_dataset(cfg)[0]
            names = getattr(ds, "column_names", None)
            if names is None:
                first = next(iter(ds), None)
                names = sorted(first) if isinstance(first, dict) else None
        if names is not None and col not in names:
            raise _no_column(col, src.description, names, _field(cfg))
    _probe_values(cfg, blocks[0], rows, src.description)


def _is_chat(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _probe_values(cfg, block: list[dict], rows: int, where: str) -> None:
    """Refuse a text column whose first rows hold no string at all: every row would be skipped
    as `not_text`, and the run would stop only once the engines were up."""
    if cfg.tokens_column is not None:
        return  # token ids: token_input.check_token_source reads and checks them
    values = []
    for _, _, value, _ in read_block(block, cfg):
        values.append(value)
        if len(values) >= rows:
            break
    if cfg.format == "chat":
        if any(_is_chat(v) for v in values) or not values:
            return
        col = cfg.messages_column
        raise DataError(
            f"data.messages_column={col!r} of {where} holds no conversations in its first "
            f"{len(values)} rows (each row must be a list of {{role, content}} messages): set "
            "data.messages_column to the column holding them, or drop data.format: chat for "
            "plain text")
    if any(isinstance(v, str) for v in values):
        return
    col = cfg.text_column
    if any(_is_chat(v) for v in values):
        raise DataError(
            f"data.text_column={col!r} of {where} holds chat messages (lists of {{role, "
            "content}): set data.format: chat and data.messages_column: "
            f"{col} to render them with the model's chat template (packing.bos: none)")
    other = [v for v in values if v is not None]
    if other:
        raise DataError(
            f"data.text_column={col!r} of {where} holds {type(other[0]).__name__} values, not "
            f"text (none of its first {len(values)} rows is a string): set data.text_column to "
            "the column holding plain text")


def _known_bytes(blocks: list[list[dict]]) -> "int | None":
    """Bytes of a local line or parquet source, from the plan; None when sizes are unknown."""
    total, files = 0, {}
    for block in blocks:
        for seg in block:
            if seg["kind"] == "lines":
                total += int(seg["stop"]) - int(seg["start"])
            elif seg["kind"] == "parquet":
                files[seg["path"]] = int(seg["size"])
            else:
                return None
    return total + sum(files.values())


def check_fills_context(data: DataConfig, packing: PackingConfig, blocks: list[list[dict]],
                        tokenizer, bos: "int | None", prompt_tokens: "int | None" = None) -> None:
    """Refuse a corpus that cannot fill one context (all rows empty, or fewer tokens than a
    context), before Ray starts: 100 empty documents once started Ray, tokenisers and actors
    (over 300 s) to say so. Packs with the workers' own code and stops at the first context, so
    a usable corpus costs one tokenizer call here. `prompt_tokens`: pack_block's (chat input
    completed by capture.generate: chat_prompt_tokens)."""
    from .tokenize import pack_block

    size = _known_bytes(blocks)
    scan = blocks if size is not None and size <= SMALL_SOURCE_BYTES else blocks[:1]
    rows = skipped = tokens = 0
    reasons: dict = {}
    for b, block in enumerate(scan):
        for chunk in pack_block(b, block, data, packing, tokenizer, bos,
                                chunk_contexts=1, max_contexts=1, prompt_tokens=prompt_tokens):
            if chunk.n_contexts:
                return
            s = chunk.stats
            rows += s.get("rows_read", 0)
            skipped += s.get("rows_skipped", 0)
            tokens += s.get("tokens_seen", 0)
            for k, v in (s.get("skipped_reasons") or {}).items():
                reasons[k] = reasons.get(k, 0) + v
    read = "all of them read" if len(scan) == len(blocks) else \
        f"the first of {len(blocks)} blocks read"
    raise PackingError(
        f"no complete context: data.source={shown_source(data)!r} had {rows} rows ({read}), "
        f"{skipped} without usable text ({reasons or 'none'}), {tokens} tokens; one context needs "
        f"packing.context_size={packing.context_size} tokens (from one block): add text, "
        "check data.source/data.text_column, or lower packing.context_size")
