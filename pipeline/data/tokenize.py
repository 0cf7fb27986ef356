"""Tokenising workers: Ray actors that read, tokenise and pack blocks of the corpus.

Each worker holds one tokenizer (loaded once: a fast tokenizer takes about a second to load, a
block a few seconds to tokenise) and packs one block at a time as a streaming generator that
yields, per chunk, the chunk's arrays and then its descriptor. The arrays stay in Ray's object
store (owned by the driver, which only ever holds the reference) until the actor that captures
them fetches them; the driver reads the descriptors (counts, digests, cursors). Ray's generator
backpressure pauses a worker that runs too far ahead of the driver.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

from ..config.run import DataConfig, PackingConfig
from ..messages import ChunkDescriptor
from .packing import BlockPacker, emit_until
from .corpus_blocks import read_block
from .prefix import capped_ids, long_chars

BATCH_CHARS = 1 << 18  # characters per tokenizer call, at most (about 70k tokens)


def pack_block(block_id: int, block: list[dict], data: DataConfig, packing: PackingConfig,
               tokenizer, bos: int | None, chunk_contexts: int, max_contexts: int | None,
               start: dict | None = None, first_index: int = 0, last_index: int | None = None,
               prompt_tokens: int | None = None, vocab_size: int | None = None) -> Iterator:
    """Chunks of one block, from `start` (a chunk's cursor) on, until `last_index` if given.
    `prompt_tokens`: chat input completed by capture.generate (chat_prompt_tokens).
    `vocab_size`: pre-tokenised input refuses ids outside it (token_input.py)."""
    if data.tokens_column is not None:  # pre-tokenised rows: nothing to tokenise
        from .token_input import pack_token_block

        yield from pack_token_block(block_id, block, data, packing, bos, chunk_contexts,
                                    max_contexts, start, first_index, last_index, vocab_size)
        return
    if data.format == "chat":
        yield from pack_chat_block(block_id, block, data, packing, tokenizer, bos,
                                   chunk_contexts, max_contexts, start, first_index, last_index,
                                   prompt_tokens)
        return
    p = BlockPacker(packing, bos, block_id, chunk_contexts, max_contexts, start, first_index)
    batch: list = []
    size = 0

    cap = packing.doc_token_cap()
    whole_chars = long_chars(cap)

    def flush():
        nonlocal size
        short = [t for _, _, t in batch if len(t) <= whole_chars]
        enc = iter(tokenizer(short, add_special_tokens=False)["input_ids"] if short else [])
        out = []
        for row, pos, text in batch:
            if len(text) <= whole_chars:
                ids = next(enc)
                cut = len(ids) > cap
                ids = ids[:cap]
            else:
                ids, cut = capped_ids(tokenizer, text, cap)
            p.stats.docs_capped += int(cut)
            out += p.add(row, pos, ids)
        batch.clear()
        size = 0
        return out

    for row, pos, text, reason in read_block(block, data, start):
        if p.done:
            break
        if reason is not None:
            if batch:  # keep source order: pending documents are packed before the skip counts
                stop = yield from emit_until(flush(), last_index)
                if stop:
                    return
            p.skip(row, reason)
            continue
        batch.append((row, pos, text))
        size += len(text)
        # documents per call, and bytes: 256 whole source files can be megabytes, and the first
        # chunk (the first unit) would wait for all of them
        if len(batch) >= packing.tokenize_batch or size >= BATCH_CHARS:
            stop = yield from emit_until(flush(), last_index)
            if stop:
                return
    if batch:
        stop = yield from emit_until(flush(), last_index)
        if stop:
            return
    yield from emit_until(p.finish(), last_index)


def pack_chat_block(block_id: int, block: list[dict], data: DataConfig, packing: PackingConfig,
                    tokenizer, bos: int | None, chunk_contexts: int, max_contexts: int | None,
                    start: dict | None = None, first_index: int = 0,
                    last_index: int | None = None, prompt_tokens: int | None = None) -> Iterator:
    """pack_block for chat input: one conversation at a time, rendered and labelled
    (pipeline/data/chat.py), each ending its context (packing.py). Renders are per conversation (a
    template renders one), so there is no batching to gain; a conversation that cannot be
    labelled exactly is skipped and counted under its reason, a template that cannot be diffed
    stops the block (ChatTemplateError).

    `prompt_tokens` (capture.generate): each conversation is a generation's prompt, rendered with
    the template's generation prompt at its end; one longer than the slot's prompt room is
    skipped (`prompt_too_long`): cut, it would no longer end in the generation prompt."""
    from .chat import ChatLabelError, label_conversation_capped, pad_token_id

    p = BlockPacker(packing, bos, block_id, chunk_contexts, max_contexts, start, first_index,
                    pad_token_id=pad_token_id(tokenizer))
    cap = packing.doc_token_cap()
    # tokens labelled per conversation: the kept ones, and with a generation prompt enough to
    # tell whether the prompt fits its room (a longer render is tokenised from a prefix only)
    limit = cap if prompt_tokens is None else max(cap, prompt_tokens)
    for row, pos, messages, reason in read_block(block, data, start):
        if p.done:
            break
        if reason is None:
            try:
                ids, roles, cut = label_conversation_capped(tokenizer, messages, limit,
                                                            prompt_tokens is not None)
            except ChatLabelError as e:
                reason = e.reason
            else:
                if prompt_tokens is not None and (cut or len(ids) > prompt_tokens):
                    reason = "prompt_too_long"
        if reason is not None:
            chunks = p.skip(row, reason)
        else:
            p.stats.docs_capped += int(cut or len(ids) > cap)
            chunks = p.add(row, pos, ids[:cap], roles[:cap])
        if (yield from emit_until(chunks, last_index)):
            return
    yield from emit_until(p.finish(), last_index)


class TokenizeWorker:
    """Created by the driver with `ray.remote(TokenizeWorker).options(...)`."""

    def __init__(self, spec: dict):
        for k, v in (spec.get("env") or {}).items():
            os.environ[k] = v
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
        self.data = DataConfig(**spec["data"])
        self.packing = PackingConfig(**spec["packing"])
        self.bos = spec["bos"]
        self.chunk_contexts = int(spec["chunk_contexts"])
        self.max_contexts = spec.get("max_contexts")
        self.prompt_tokens = spec.get("prompt_tokens")  # chat_prompt_tokens
        self.vocab_size = spec.get("vocab_size")  # pre-tokenised input's id check
        self.blocks_started = 0

    def ping(self) -> int:
        return os.getpid()

    def tokenize(self, block_id: int, block: list[dict], start: dict | None = None,
                 first_index: int = 0, last_index: int | None = None,
                 budget: int | None = None) -> "Iterator[dict | ChunkDescriptor]":
        """Yields arrays, descriptor, arrays, descriptor, ... (two objects per chunk). `budget`:
        the contexts left to the run from `start` on (a resume), else the run's whole budget."""
        self.blocks_started += 1
        max_contexts = self.max_contexts if budget is None else budget
        for c in pack_block(block_id, block, self.data, self.packing, self.tokenizer, self.bos,
                            self.chunk_contexts, max_contexts, start, first_index, last_index,
                            self.prompt_tokens, self.vocab_size):
            yield c.arrays()
            yield dataclasses.replace(c.describe(), pid=os.getpid())


def chat_prompt_tokens(generate, data: DataConfig, context_size: int) -> "int | None":
    """The prompt room of a chat generation slot (pack_block's prompt_tokens), None otherwise.
    `generate`: the capture.generate section (a GenerateConfig or None)."""
    if generate is None or data.format != "chat":
        return None
    return generate.prompt_len(context_size)
