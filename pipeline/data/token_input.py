"""Pre-tokenised corpora: rows that are token-id sequences (`data.tokens_column`).

The SAE world keeps training text pre-tokenised (SAELens's pretokenize runner writes a
`save_to_disk` dataset with an `input_ids` column of fixed-length contexts, and a `sae_lens.json`
of its settings beside it; published SAEs name such datasets on the Hub). Reading those ids as
they are is how two runs see the same tokens. Any source the text path reads (hub, disk,
parquet, arrow, json-lines) can hold them; the readers (corpus_blocks.py: read_block) hand over the column's value
per row and this module packs it:

- a row of exactly `packing.context_size` ids that arrives at a context boundary (always, when
  every row has that length, as SAELens writes them) is one context, unchanged: no re-packing and
  no inserted BOS whatever `packing.bos` says (an inserted BOS would push out a token the dataset
  chose); `doc_id` is the row, `position` the index in it;
- a row of another length is a document, packed by the packing rules (packing.py). A BOS already
  at its start is dropped when the packer places BOS itself (`packing.bos: context` or
  `document`), so the context never holds two; with `packing.bos: none` the ids are packed as
  given. Positions then count from the first kept id.

Checks, before Ray starts (prepare.py calls `check_token_source`), each refusal one line:
- every id of the scanned rows (the whole source up to SCAN_TOKENS ids, else its first rows) is in
  the model's vocabulary; the first bad row is named. The tokenising workers check every row
  again (`vocab_size`), so a bad id past the scan stops the run there instead of reaching the
  engine's embedding lookup;
- when the dataset records the tokenizer it was made with (SAELens's `sae_lens.json`,
  `tokenizer_name`, beside a local dataset or in a hub dataset repo), a different tokenizer is
  refused with both names: both are loaded and their vocabularies compared; a recorded name that
  cannot be loaded here passes when its last path component is the model's, else the sample
  below decides (refused when it disagrees, a warning when it agrees);
- otherwise a few rows are decoded and re-encoded with the model's tokenizer: a sample that
  disagrees (the ids were made by another tokenizer) is a warning, not a refusal, because
  decoding is not always invertible.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config.corpus import DataConfig, PackingConfig
from .documents import DataError, ResolvedSource, resolve_source
from .packing import BlockPacker, emit_until
from ..config.paths import expand_path
from .corpus_blocks import read_block

log = logging.getLogger(__name__)

RECORD_FILES = ("sae_lens.json",)  # SAELens's PretokenizedDatasetMetadata, beside the data
SCAN_TOKENS = 1 << 22               # ids checked against the vocabulary before Ray starts
SAMPLE_ROWS = 4                      # rows decoded and re-encoded when nothing records a tokenizer
SAMPLE_AGREEMENT = 0.9               # below this (difflib ratio of ids), the sample warns


class TokenInputError(DataError):
    """A token-id row the model cannot take (an id outside its vocabulary, another tokenizer)."""


def as_ids(value) -> "np.ndarray | None":
    """A row's ids as int64 (lists, numpy arrays and torch tensors alike); None when the value
    is not a flat sequence of integers."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, RuntimeError):
        return None
    if a.ndim != 1 or a.dtype.kind not in "iu":
        return None
    return a.astype(np.int64, copy=False)


def _bad_id(col: str, row: int, ids: np.ndarray, vocab_size: int, where: str,
            model: str) -> TokenInputError:
    k = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
    return TokenInputError(
        f"data.tokens_column={col!r}: row {row} of {where} holds token id {int(ids[k])} at index "
        f"{k}, outside the vocabulary of {model} (0..{vocab_size - 1}): the ids were made for "
        "another model; re-tokenise the text with this model's tokenizer, or set model.path to "
        "the model they were made for")


def pack_token_block(block_id: int, block: list[dict], data: DataConfig, packing: PackingConfig,
                     bos: "int | None", chunk_contexts: int, max_contexts: "int | None",
                     start: "dict | None" = None, first_index: int = 0,
                     last_index: "int | None" = None,
                     vocab_size: "int | None" = None) -> Iterator:
    """tokenize.pack_block for token-id rows (the module docstring's rules). `vocab_size`:
    refuse an id outside it (TokenInputError naming the block and its row)."""
    p = BlockPacker(packing, bos, block_id, chunk_contexts, max_contexts, start, first_index)
    C = packing.context_size
    cap = packing.doc_token_cap()
    strip = bos is not None and packing.bos != "none"
    for row, pos, value, reason in read_block(block, data, start):
        if p.done:
            break
        ids = as_ids(value) if reason is None else None
        if reason is None and ids is None:
            reason = "not_tokens"
        if reason is not None:
            chunks = p.skip(row, reason)
        else:
            if vocab_size is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise _bad_id(data.tokens_column, row, ids, vocab_size,
                              f"block {block_id}", "the model")
            # a resumed document (offset > 0) was not whole the first time either
            whole = len(ids) == C and p.fill == 0 and not p.resume_offset
            if not whole:
                if strip and ids[0] == bos:
                    ids = ids[1:]
                p.stats.docs_capped += int(len(ids) > cap)
                ids = ids[:cap]
            chunks = p.add(row, pos, ids, whole=whole)
        if (yield from emit_until(chunks, last_index)):
            return
    yield from emit_until(p.finish(), last_index)


# ---- checks before Ray ---------------------------------------------------------------------------

def find_record(cfg: DataConfig, src: "ResolvedSource | None" = None) -> "tuple[dict, str] | None":
    """(settings, where) of the tokenizer record the dataset carries, or None: SAELens's
    `sae_lens.json` in a `save_to_disk` dir or beside local files, or in a hub dataset repo
    (read from the hub, or its local cache when the hub cannot be reached). `src`: the resolved
    source, else resolved here."""
    src = resolve_source(cfg) if src is None else src
    dirs: list[str] = []
    if src.kind == "disk":
        dirs.append(src.files[0])
    elif src.kind == "files":
        source = expand_path(cfg.source)
        if os.path.isdir(source):
            dirs.append(source)
        dirs += [str(Path(f).parent) for f in src.files if "://" not in f]
    for d in dict.fromkeys(dirs):
        for name in RECORD_FILES:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return _load_record(path), path
    if src.kind == "hub":
        return _hub_record(cfg)
    return None


def _load_record(path: str) -> dict:
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"data.tokens_column: {path} is not readable JSON ({e}): fix or remove "
                        "it") from None
    return rec if isinstance(rec, dict) else {}


def _hub_record(cfg: DataConfig) -> "tuple[dict, str] | None":
    from ...engine.models import hub_unreachable

    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(cfg.source, RECORD_FILES[0], repo_type="dataset",
                               revision=cfg.revision, local_files_only=hub_unreachable() is not None)
    except Exception:  # noqa: BLE001 -- no record (or none reachable): the sample check decides
        return None
    return _load_record(path), f"hub:{cfg.source}/{RECORD_FILES[0]}"


def vocab_sha256(tokenizer) -> str:
    """A tokenizer's identity for comparison: its vocabulary (token -> id, added tokens included)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _short(name: str) -> str:
    return Path(str(name).rstrip("/")).name.lower()


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from ...engine.models import hub_unreachable

    local = os.path.isdir(expand_path(name))
    try:
        return AutoTokenizer.from_pretrained(
            expand_path(name) if local else name,
            **({} if local or hub_unreachable() is None else {"local_files_only": True}))
    except Exception:  # noqa: BLE001 -- unloadable here: compared by name instead
        return None


def _mismatch(name, where: str, model_name: str, how: str) -> TokenInputError:
    return TokenInputError(
        f"data.tokens_column: the dataset was tokenised with {name!r} ({where}), the model's "
        f"tokenizer is {model_name!r} ({how}): set model.path to the model the ids were made "
        "for, or re-tokenise the text with this model's tokenizer")


def check_record(record: dict, where: str, tokenizer, model_name: str) -> dict:
    """Refuse a dataset whose recorded tokenizer is not the model's; returns what was compared.
    A recorded name that cannot be loaded here and differs from the model's name is left to the
    sample (`unverified`): the same tokenizer often has several names (a base model and its
    instruct variant, a hub name and a local copy)."""
    name = record.get("tokenizer_name")
    if not name:
        return {"record": where, "tokenizer_name": None, "checked": "no tokenizer_name"}
    mine = vocab_sha256(tokenizer)
    theirs = _load_tokenizer(str(name))
    if theirs is not None:
        same, how = vocab_sha256(theirs) == mine, "vocabularies compared"
    else:
        names = {_short(model_name), _short(getattr(tokenizer, "name_or_path", "") or "")}
        same, how = _short(str(name)) in names, "names compared (recorded tokenizer not loadable)"
        if not same:
            return {"record": where, "tokenizer_name": name, "unverified": True,
                    "checked": "names differ, recorded tokenizer not loadable here: sample decides"}
    if not same:
        raise _mismatch(name, where, model_name, f"{how}: they differ")
    return {"record": where, "tokenizer_name": name, "checked": how,
            **{k: record.get(k) for k in ("context_size", "original_dataset", "original_split",
                                          "sae_lens_version") if record.get(k) is not None}}


def sample_agreement(rows: list[np.ndarray], tokenizer) -> "float | None":
    """Mean difflib ratio between each row's ids and the model tokenizer's re-encoding of its
    decoded text (special ids left out of both): near 1 when the ids came from this tokenizer."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    ratios = []
    for ids in rows[:SAMPLE_ROWS]:
        a = [int(t) for t in ids if int(t) not in special]
        if not a:
            continue
        text = tokenizer.decode(a)
        b = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]
             if int(t) not in special]
        ratios.append(difflib.SequenceMatcher(None, a, b, autojunk=False).ratio())
    return round(float(np.mean(ratios)), 4) if ratios else None


def check_token_source(data: DataConfig, blocks: list[list[dict]], tokenizer, vocab_size: int,
                       model_name: str, src: "ResolvedSource | None" = None) -> dict:
    """Before Ray: the column holds ids, every scanned id is in the vocabulary, the recorded
    tokenizer (if any) is the model's, else a decode/re-encode sample agrees (or warns).
    Returns the token source's description for the store (`provenance.token_source`).
    `model_name`: model.path, as errors name the model; `src`: the resolved source (prepare's)."""
    col = data.tokens_column
    src = resolve_source(data) if src is None else src
    if src.kind == "files" and src.builder in ("text", "csv"):
        raise DataError(
            f"data.tokens_column={col!r}: {src.description} is read as {src.builder}, whose rows "
            "cannot hold token-id lists: give a disk, parquet, arrow or json-lines source")
    out: dict = {"column": col, "source": src.description}
    rec = find_record(data, src)
    if rec is not None:
        out.update(check_record(rec[0], rec[1], tokenizer, model_name))
    sample: list[np.ndarray] = []
    scanned = rows = 0
    first_other = None
    for block in blocks:
        block_rows = 0
        for row, _, value, reason in read_block(block, data):
            block_rows = row + 1
            if reason is not None:
                continue
            ids = as_ids(value)
            if ids is None:
                first_other = first_other or (rows + row, type(value).__name__)
                continue
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise _bad_id(col, rows + row, ids, vocab_size, src.description,
                              repr(model_name))
            if len(sample) < SAMPLE_ROWS:
                sample.append(ids)
            scanned += len(ids)
            if scanned >= SCAN_TOKENS:
                break
        rows += block_rows
        if scanned >= SCAN_TOKENS:
            break
    if not sample and first_other is not None:
        raise DataError(
            f"data.tokens_column={col!r} of {src.description} holds {first_other[1]} values, not "
            f"token-id lists (row {first_other[0]} and every row scanned): set "
            "data.tokens_column to the column of ids, or use data.text_column for text")
    out["ids_checked"] = scanned
    if rec is None or out.get("unverified"):
        agree = sample_agreement(sample, tokenizer)
        out["sample_agreement"] = agree
        low = agree is not None and agree < SAMPLE_AGREEMENT
        if out.get("unverified"):
            if low:
                raise _mismatch(out["tokenizer_name"], out["record"], model_name,
                                f"names differ and {len(sample)} sample rows decoded and "
                                f"re-encoded agree at {agree:.2f}")
            log.warning("data.tokens_column: the dataset records tokenizer %r, which cannot be "
                        "loaded here; the model is %s and a sample of rows re-encodes alike "
                        "(%.2f): taken as the same tokenizer", out["tokenizer_name"],
                        model_name, agree if agree is not None else float("nan"))
        elif low:
            log.warning(
                "data.tokens_column=%r: %d sample rows decoded and re-encoded with %s's tokenizer "
                "agree at %.2f (1.0 = same ids): the ids may come from another tokenizer, and "
                "nothing in the dataset records which", col, len(sample), model_name, agree)
    return out
