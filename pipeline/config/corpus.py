"""The run configuration's corpus sections: `data` (where documents come from) and `packing`
(how they become fixed contexts, the rows of the store).

Split from pipeline/config/sections.py, which holds the other sections (model, capture, store, ray):
these two decide which tokens a run reads and how they are cut, the others how and where they are
captured and written. The same rules hold: one dataclass per section, each validating its own
fields, every error naming the field as written in YAML and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from .fields import ConfigError, check_bool, check_choice, check_int, check_str, redacted_repr

# `chat`: the rows are conversations (see DataConfig); the file format is then found as for null.
# formats whose rows cannot hold a list of token ids (data.tokens_column refuses them)
TEXT_ONLY_FORMATS = ("text", "csv", "chat")
DATA_FORMATS = ("json", "jsonl", "parquet", "text", "arrow", "csv", "disk", "hub", "chat")
# Defaults of the per-row limits (DataConfig): far above any ordinary row, low enough that one
# row cannot exhaust a worker. 64 MiB lines; 4,096 messages (rendering is linear in them:
# pipeline/data/chat.py); 16 Mi characters of conversation (a conversation's tokens past
# packing.max_doc_tokens are cut anyway, but its render and character labels are built whole).
MAX_LINE_BYTES_DEFAULT = 1 << 26
MAX_MESSAGES_DEFAULT = 1 << 12
MAX_CONVERSATION_CHARS_DEFAULT = 1 << 24
LIMIT_DEFAULTS = {"max_line_bytes": MAX_LINE_BYTES_DEFAULT, "max_messages": MAX_MESSAGES_DEFAULT,
                  "max_conversation_chars": MAX_CONVERSATION_CHARS_DEFAULT}


@dataclass(frozen=True)
class DataConfig:
    """Where documents come from. `source: pydoc` is the offline default corpus.

    `source` may be a hub dataset name, a local file, directory or glob (a date-partitioned path
    such as `/data/crawl/date=2025-06-01/*.parquet` is just a glob), or a `save_to_disk` dir.
    `format` is inferred from the file suffix unless given. `format: chat` reads conversations
    from `messages_column` (lists of {role, content}) instead of text, renders them with the
    model's chat template and labels every row with its role (pipeline/data/chat.py; the file format
    is then inferred as for null).

    `tokens_column`: the rows are token-id sequences already (a pre-tokenised corpus, e.g.
    SAELens's `input_ids`/`tokens` datasets) read from that column instead of text
    (pipeline/data/token_input.py): a row of exactly packing.context_size ids that starts a context
    is taken as one context unchanged, other lengths are packed by the packing rules.

    `block_bytes`: the corpus is cut into blocks of about this much text, each tokenised and
    packed on its own by a worker (contexts never straddle blocks). It decides the rows, so it is
    part of the run's identity. `streaming: true` reads through `datasets`' streaming loader,
    one block per data file (shard); local json-lines, text and parquet files are otherwise split
    by byte range or row group.

    Limits on one source row, so that a hostile or broken corpus cannot take a tokenising
    worker's memory or time (each row over a limit is skipped and counted under its reason, as a
    row without text is):
    - `max_line_bytes`: one line of a local json-lines or text file (harvest's own line reader;
      a line is read at most this far, the rest skipped unread): `line_too_long`.
    - `max_messages`: messages of one conversation (data.format: chat): `too_many_messages`.
    - `max_conversation_chars`: characters of one conversation's message contents together
      (data.format: chat; the rendered text adds the template's scaffolding): `too_many_chars`.
    Text rows need no character limit: only a bounded prefix of a long document is tokenised
    (packing.max_doc_tokens). The defaults are far above any ordinary row.
    """

    source: str = "pydoc"
    format: str | None = None
    name: str | None = None
    split: str = "train"
    revision: str | None = None
    data_files: Any = None
    text_column: str = "text"
    messages_column: str = "messages"
    tokens_column: str | None = None
    streaming: bool = False
    max_docs: int | None = None
    block_bytes: int = 8 << 20
    max_line_bytes: int = MAX_LINE_BYTES_DEFAULT
    max_messages: int = MAX_MESSAGES_DEFAULT
    max_conversation_chars: int = MAX_CONVERSATION_CHARS_DEFAULT

    def __repr__(self) -> str:
        return redacted_repr(self)   # a presigned data.source prints masked

    @property
    def value_column(self) -> str:
        """The column the readers take each row's value from (text, chat messages or ids)."""
        if self.tokens_column is not None:
            return self.tokens_column
        return self.messages_column if self.format == "chat" else self.text_column

    def validate(self) -> None:
        check_str("data.source", self.source)
        check_int("data.block_bytes", self.block_bytes, 1024)
        if self.format is not None:
            check_choice("data.format", self.format, DATA_FORMATS)
        if self.name is not None:
            check_str("data.name", self.name)
        check_str("data.split", self.split)
        if self.revision is not None:
            if not isinstance(self.revision, str) or not self.revision:
                raise ConfigError(
                    "data.revision must be a git revision string (branch, tag or commit sha); "
                    "quote dates in YAML, e.g. revision: '2025-06-01'"
                )
        if self.data_files is not None and not isinstance(self.data_files, (str, list, dict)):
            raise ConfigError("data.data_files must be a path, a list of paths or {split: paths}")
        check_str("data.text_column", self.text_column)
        check_str("data.messages_column", self.messages_column)
        if self.tokens_column is not None:
            check_str("data.tokens_column", self.tokens_column)
            if self.format in TEXT_ONLY_FORMATS:
                raise ConfigError(
                    f"data.tokens_column={self.tokens_column!r} with data.format: {self.format}: "
                    "a token-id column needs a source that holds lists (hub, disk, parquet, "
                    "arrow, json/jsonl); drop data.format or data.tokens_column")
        check_bool("data.streaming", self.streaming)
        check_int("data.max_docs", self.max_docs, 1, optional=True)
        check_int("data.max_line_bytes", self.max_line_bytes, 1024)
        check_int("data.max_messages", self.max_messages, 1)
        check_int("data.max_conversation_chars", self.max_conversation_chars, 1)

    def content_key(self) -> dict:
        """This section's part of the run's content key (HarvestConfig.content_key): every field,
        with these exceptions.

        - `source` and `data_files` by their secret-free identity (credentials.url_identity):
          userinfo and the credential and signing parameters of a presigned or SAS URL dropped.
          The key is recorded in the store and compared by every resume; a URL signed again for
          the next run (new signature, date, expiry) names the same data and must resume.
        - `messages_column` only with chat input, `tokens_column` only when set, and the row
          limits only when they differ from their defaults: stores made before those fields
          existed keep their key (their rows were read without the limits, which no ordinary
          row reaches)."""
        out = {k: v for k, v in asdict(self).items()
               if (k != "messages_column" or self.format == "chat")
               and (k != "tokens_column" or v is not None)
               and (k not in LIMIT_DEFAULTS or v != LIMIT_DEFAULTS[k])}
        if _has_query_or_userinfo(out["source"], out["data_files"]):
            # here, not at import: the store package loads zarr (config loads must not)
            from ...store import url_identity

            out["source"] = url_identity(out["source"])
            out["data_files"] = _map_strings(out["data_files"], url_identity)
        return out


def _has_query_or_userinfo(*values: Any) -> bool:
    """Whether any string in `values` (nested lists and dicts included) has a query or a `@`:
    only those can carry credentials that url_identity drops."""
    found: list[bool] = []
    for v in values:
        _map_strings(v, lambda s: found.append("?" in s or "@" in s))
    return any(found)


def _map_strings(value: Any, fn) -> Any:
    """`value` with `fn` applied to every string in it (data_files: a path, a list, {split: ...})."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    return value


BosMode = Literal["context", "document", "none"]
BOS_MODES: tuple[str, ...] = get_args(BosMode)
# Default cap on one document's tokens when nothing bounds it (about 1 MB of text): a longer
# document is cut there, counted in the run's packing figures.
DOC_TOKENS_DEFAULT = 1 << 18
OverflowMode = Literal["split", "truncate"]
OVERFLOW_MODES: tuple[str, ...] = get_args(OverflowMode)


@dataclass(frozen=True)
class PackingConfig:
    """How documents become fixed contexts (rows of the store are their tokens, in order).

    `bos: context` starts every context with BOS (SAELens' default, which keeps every context a
    well-formed prompt); `document` puts BOS before every document instead. `overflow: split`
    carries the rest of a long document into the next context; `truncate` drops it.
    """

    context_size: int = 128
    bos: BosMode = "context"
    bos_token_id: int | None = None
    overflow: OverflowMode = "split"
    max_tokens: int | None = None
    tokenize_batch: int = 256
    # Tokens per chunk of tokenised output: the granularity at which workers hand tokens over and
    # a resumed run re-creates them. It does not change the rows; a store keeps the value it was
    # planned with.
    chunk_tokens: int = 1 << 16
    # Tokens kept of one document, at most: only a bounded prefix of its text is tokenised, so a
    # single 30 MB document cannot take the tokenising worker's memory (whole, it took 6.3 GB).
    # None: derived (doc_token_cap): context_size with overflow=truncate, max_tokens when set,
    # else DOC_TOKENS_DEFAULT. Documents cut here are counted (docs_capped).
    max_doc_tokens: int | None = None

    def validate(self) -> None:
        check_int("packing.context_size", self.context_size, 2)
        check_int("packing.max_doc_tokens", self.max_doc_tokens, 1, optional=True)
        check_choice("packing.bos", self.bos, BOS_MODES)
        check_int("packing.bos_token_id", self.bos_token_id, 0, optional=True)
        check_choice("packing.overflow", self.overflow, OVERFLOW_MODES)
        check_int("packing.max_tokens", self.max_tokens, 1, optional=True)
        if self.max_tokens is not None and self.max_tokens < self.context_size:
            raise ConfigError(
                f"packing.max_tokens={self.max_tokens} is smaller than one context "
                f"(packing.context_size={self.context_size}): raise max_tokens or lower "
                "context_size"
            )
        check_int("packing.tokenize_batch", self.tokenize_batch, 1)
        check_int("packing.chunk_tokens", self.chunk_tokens, 1)

    def doc_token_cap(self) -> int:
        """Tokens kept of one document (see max_doc_tokens): more could never reach a row."""
        if self.max_doc_tokens is not None:
            return self.max_doc_tokens
        if self.overflow == "truncate":
            return self.context_size
        if self.max_tokens is not None:
            return self.max_tokens
        return DOC_TOKENS_DEFAULT
