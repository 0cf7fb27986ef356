"""Packing documents into fixed contexts: BOS modes, split/truncate, budget, provenance."""

from __future__ import annotations

import numpy as np
import pytest

from harvest.pipeline.config.run import ConfigError, PackingConfig, load_config
from harvest.pipeline.data.packing import PackingError, pack_texts, pack_token_docs, resolve_bos

BOS = 0


def docs(*lengths, start_doc=0):
    """Documents whose token ids encode (doc, position): id = 100 * doc + position + 1."""
    return [(d, [100 * d + p + 1 for p in range(n)]) for d, n in enumerate(lengths, start_doc)]


def pack(ds, **kw):
    cfg = PackingConfig(**kw)
    cfg.validate()
    return pack_token_docs(ds, cfg, BOS)


def test_bos_per_context_split_documents_across_contexts():
    p = pack(docs(5, 3), context_size=4, bos="context", overflow="split")
    # contexts: [B d0p0 d0p1 d0p2] [B d0p3 d0p4 d1p0]; d1p1, d1p2 form an incomplete tail
    assert p.token_ids.tolist() == [0, 1, 2, 3, 0, 4, 5, 101]
    # an inserted BOS is from no document: -2, distinct from the store's -1 "never written"
    assert p.doc_ids.tolist() == [-2, 0, 0, 0, -2, 0, 0, 1]
    assert p.positions.tolist() == [-2, 0, 1, 2, -2, 3, 4, 0]
    assert p.n_contexts == 2
    assert p.stats.tokens_tail_dropped == 2


def test_bos_per_document_is_position_zero_of_its_document():
    p = pack(docs(3, 2), context_size=3, bos="document", overflow="split")
    # docs become [B 1 2 3] [B 101 102]: contexts [B 1 2] [3 B 101]; 102 is the tail
    assert p.token_ids.tolist() == [0, 1, 2, 3, 0, 101]
    assert p.doc_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert p.positions.tolist() == [0, 1, 2, 3, 0, 1]


def test_truncate_never_continues_a_document_into_the_next_context():
    p = pack(docs(6, 2, 1), context_size=4, bos="context", overflow="truncate")
    # [B d0p0 d0p1 d0p2] (d0p3.. dropped) [B d1p0 d1p1 d2p0]
    assert p.token_ids.tolist() == [0, 1, 2, 3, 0, 101, 102, 201]
    assert p.stats.tokens_truncated == 3


def test_no_bos_packs_tokens_back_to_back():
    p = pack(docs(3, 3), context_size=2, bos="none")
    assert p.token_ids.tolist() == [1, 2, 3, 101, 102, 103]
    assert p.positions.tolist() == [0, 1, 2, 0, 1, 2]


def test_every_row_maps_back_to_its_document_token():
    ds = docs(17, 1, 40, 9, 33, start_doc=3)
    p = pack(ds, context_size=8, bos="context")
    real = p.doc_ids >= 0
    assert np.all(p.token_ids[real] == 100 * p.doc_ids[real] + p.positions[real] + 1)
    assert np.all(p.token_ids[~real] == BOS)
    assert np.all(p.token_ids[:: 8] == BOS)


def test_budget_stops_reading_documents():
    read = []

    def gen():
        for d, ids in docs(*([10] * 100)):
            read.append(d)
            yield d, ids

    p = pack(gen(), context_size=8, bos="context", max_tokens=20)
    assert p.n_rows == 16  # whole contexts only: 20 // 8 = 2
    assert p.stats.budget_reached
    assert len(read) <= 3


def test_empty_token_lists_are_skipped_and_counted():
    p = pack([(0, []), (1, [5, 6, 7, 8])], context_size=4, bos="none")
    assert p.stats.docs_empty_tokens == 1
    assert p.doc_ids.tolist() == [1, 1, 1, 1]


def test_too_few_tokens_gives_zero_rows():
    p = pack(docs(2), context_size=8, bos="context")
    assert p.n_rows == 0 and p.stats.tokens_tail_dropped == 2


def test_config_refuses_budget_below_one_context():
    with pytest.raises(ConfigError, match="packing.max_tokens=10 is smaller than one context"):
        load_config(data={"packing": {"context_size": 16, "max_tokens": 10}})
    with pytest.raises(ConfigError, match="packing.bos='start'"):
        load_config(data={"packing": {"bos": "start"}})


@pytest.fixture(scope="module")
def tokenizer():
    from harvest.engine.models import train_tokenizer

    return train_tokenizer()


def test_real_tokenizer_is_deterministic_and_matches_plain_encoding(tokenizer):
    texts = [(0, "def f(x):\n    return x"), (1, ""), (2, "The while statement loops.")] * 5
    cfg = PackingConfig(context_size=16, bos="context", tokenize_batch=4)
    a = pack_texts(texts, tokenizer, cfg)
    b = pack_texts(texts, tokenizer, cfg)
    assert a.tokens_sha256() == b.tokens_sha256() and a.n_rows > 0
    # the rows of document 0 are exactly its plain encoding
    first = tokenizer("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    sel = (a.doc_ids == 0)
    got = a.token_ids[sel][: len(first)]
    assert got.tolist() == first[: len(got)]
    assert a.token_ids[0] == tokenizer.bos_token_id


def test_tokenizer_without_bos_needs_an_explicit_choice(tokenizer):
    from transformers import PreTrainedTokenizerFast

    no_bos = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    assert no_bos.bos_token_id is None
    with pytest.raises(PackingError, match="packing.bos='context'.*packing.bos_token_id"):
        resolve_bos(PackingConfig(bos="context"), no_bos)
    assert resolve_bos(PackingConfig(bos="context", bos_token_id=1), no_bos) == 1
    assert resolve_bos(PackingConfig(bos="none"), no_bos) is None


@pytest.mark.parametrize("bos, overflow", [("context", "split"), ("document", "split"),
                                           ("none", "truncate"), ("context", "truncate")])
def test_chunks_resumed_at_their_cursor_are_the_same_chunks(bos, overflow):
    """A block packed in chunks equals the block packed whole, and packing resumed at any chunk's
    cursor re-creates that chunk and every later one bit for bit (what a resumed run relies on)."""
    from harvest.pipeline.data.packing import BlockPacker

    cfg = PackingConfig(context_size=8, bos=bos, overflow=overflow)
    ds = docs(17, 0, 40, 9, 33, 5, 21, 60, 2, 11)
    skipped = {3: "empty", 6: "null"}

    def run(start=None, first=0):
        p = BlockPacker(cfg, BOS, block=7, chunk_contexts=3, start=start, first_index=first)
        out = []
        for d, ids in ds:
            if start is not None and d < start["row"]:
                continue
            out += p.skip(d, skipped[d]) if d in skipped else p.add(d, [d, 0], ids)
        return out + p.finish()

    chunks = run()
    whole = pack_token_docs([(d, ids) for d, ids in ds if d not in skipped], cfg, BOS)
    assert np.array_equal(np.concatenate([c.token_id for c in chunks]), whole.token_ids)
    assert np.array_equal(np.concatenate([c.doc_id for c in chunks]), whole.doc_ids)
    assert all(c.n_contexts == 3 for c in chunks[:-1]) and chunks[-1].final
    assert sum(c.stats["rows_read"] for c in chunks) == len(ds)
    assert sum(c.stats["rows_skipped"] for c in chunks) == 2
    for c in chunks[1:]:
        again = run(c.cursor, c.index)
        assert [x.describe() for x in again] == [x.describe() for x in chunks[c.index:]]


def test_a_packer_resumed_with_the_budget_left_stops_where_the_run_ends():
    """packing.max_tokens counts from where a packer starts. Resumed at chunk k's cursor with
    the run's whole budget it packs k chunks past the run's end (a resumed driver received all
    of them: 24 chunk events from chunk 7 of a 24-chunk run); with the budget left at chunk k
    (what resume_state gives the continuation job) it re-creates chunks k.. and stops."""
    from harvest.pipeline.data.packing import BlockPacker

    cfg = PackingConfig(context_size=8, bos="context")
    ds = docs(*([30] * 40))  # 40 documents, far more than the budget

    def run(budget, start=None, first=0):
        p = BlockPacker(cfg, BOS, block=0, chunk_contexts=2, max_contexts=budget, start=start,
                        first_index=first)
        out = []
        for d, ids in ds:
            if p.done:
                break
            if start is None or d >= start["row"]:
                out += p.add(d, [d, 0], ids)
        return out + p.finish()

    chunks = run(12)
    assert [c.n_contexts for c in chunks] == [2] * 6 and chunks[-1].stats["budget_reached"]
    # the last chunk says the budget, not the data, ended the block (finish read the flag after
    # resetting the stats, so `capped` was always False); one that runs out of data is not capped
    assert chunks[-1].capped and chunks[-1].final and not any(c.capped for c in chunks[:-1])
    assert not run(10_000)[-1].capped
    for c in chunks[1:]:
        before = sum(x.n_contexts for x in chunks[:c.index])
        again = run(12 - before, c.cursor, c.index)
        assert [x.describe() for x in again] == [x.describe() for x in chunks[c.index:]]
        over = run(12, c.cursor, c.index)  # the whole budget again: c.index chunks too many
        assert len(over) == 6 and over[-1].index == c.index + 5
