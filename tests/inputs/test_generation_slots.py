"""Generation slots without an engine: a slot's metadata from a completion, its rows without
activations zeroed, and a store of such slots whose statistics (a recount) and reader skip every
row without activations (FORMAT.md, "Generation"). The engine and pipeline runs are in
test_engine_generate.py and test_pipeline_generate.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.engine.vllm.generate import GeneratedRequest
from harvest.pipeline.actor.generation import Slots, slot_meta, slot_seed
from harvest.pipeline.config.generate import GenerateConfig
from harvest.store import create_store
from harvest.store.format.layout import (GEN_DROPPED, GEN_LAST, GEN_PAD, GEN_PROMPT,
                                           GEN_SAMPLED, META_INSERTED, META_PAD)
from harvest.testing import synthetic

C, NEW = 16, 6
P = C - NEW


def _req(prompt, generated, width=4, points=2, sample=0):
    fed = np.concatenate([prompt, generated[:-1]]).astype(np.int32)
    acts = torch.arange(1, points * len(fed) * width + 1, dtype=torch.float32) + 1000 * sample
    return GeneratedRequest(0, fed, np.arange(len(fed), dtype=np.int32), (), acts.reshape(
        points, len(fed), width), sample=sample, prompt_len=len(prompt),
        generated=np.asarray(generated, np.int32), finish_reason="stop")


def test_a_slot_reads_prompt_sampled_last_padding():
    prompt = np.arange(100, 100 + P, dtype=np.int32)
    doc, pos = np.full(C, 7, np.int64), np.arange(20, 20 + C, dtype=np.int32)
    m = slot_meta(GenerateConfig(max_new_tokens=NEW), C, doc, pos, [_req(prompt, [5, 6, 9])])
    want_gen = [GEN_PROMPT] * P + [GEN_SAMPLED] * 2 + [GEN_LAST] + [GEN_PAD] * 3
    assert m["gen"].tolist() == want_gen
    assert m["token_id"].tolist() == prompt.tolist() + [5, 6, 9] + [META_PAD] * 3
    # generated rows continue the prompt's last document and its positions
    assert m["doc_id"].tolist() == [7] * (P + 2) + [META_PAD] * 4
    assert m["position"].tolist() == list(range(20, 20 + P + 2)) + [META_PAD] * 4


def test_all_new_tokens_leave_only_the_last_without_a_row_and_a_bos_has_no_document():
    prompt = np.arange(3, 3 + P, dtype=np.int32)
    doc = np.full(C, META_INSERTED, np.int64)  # e.g. a context that is one inserted BOS + ...
    pos = np.full(C, META_INSERTED, np.int32)
    m = slot_meta(GenerateConfig(max_new_tokens=NEW, keep_prompt=False), C, doc, pos,
                  [_req(prompt, list(range(50, 50 + NEW)))])
    assert m["gen"].tolist() == [GEN_DROPPED] * P + [GEN_SAMPLED] * (NEW - 1) + [GEN_LAST]
    assert (m["doc_id"][P:C - 1] == META_INSERTED).all()
    assert (m["position"][P:C - 1] == META_INSERTED).all()


def test_slot_rows_are_padded_and_zeroed_where_they_hold_no_activations():
    s = Slots(GenerateConfig(max_new_tokens=NEW, keep_prompt=False).describe(), C)
    prompt = np.arange(100, 100 + P, dtype=np.int32)
    req = _req(prompt, [5, 6, 9])
    meta, acts = s.rows(np.concatenate([prompt, np.zeros(NEW, np.int32)]),
                        np.zeros(C, np.int64), np.arange(C, dtype=np.int32), [req])
    assert acts.shape == (2, C, 4)
    assert (acts[:, :P] == 0).all() and (acts[:, P + 2:] == 0).all()  # dropped, last, padding
    assert torch.equal(acts[:, P:P + 2], req.acts[:, P:P + 2])
    # in place: the same zeroing on the engine's view of the shard buffer (raw bits)
    view = np.full((2, C, 4), 0x3F80, np.uint16)
    s.rows(np.concatenate([prompt, np.zeros(NEW, np.int32)]), np.zeros(C, np.int64),
           np.arange(C, dtype=np.int32), [req], view)
    assert (view[:, P:P + 2] == 0x3F80).all() and (view[:, :P] == 0).all() and (view[:, P + 2:] == 0).all()


def test_slot_seeds_depend_on_the_run_seed_and_the_slot_only():
    assert slot_seed(None, 5) is None
    seeds = {slot_seed(3, k) for k in range(1000)}
    assert len(seeds) == 1000 and all(0 <= x < 2 ** 31 for x in seeds)
    assert slot_seed(3, 7) == slot_seed(3, 7) != slot_seed(4, 7)


def test_a_store_of_slots_counts_and_reads_only_rows_with_activations(tmp_path):
    from harvest.store.read.dataset import ActivationDataset

    n, width = 512, 8
    s = create_store(str(tmp_path / "g.zarr"), points=["resid_post.0"], width=width, n_rows=n,
                     shard_rows=128, context_size=C, attrs={"generation": {"max_new_tokens": NEW}},
                     generated=True)
    rng = np.random.default_rng(0)
    gen = np.empty(n, np.int8)
    for k in range(n // C):  # slots of random lengths
        g = int(rng.integers(1, NEW + 1))
        gen[k * C:(k + 1) * C] = [GEN_PROMPT] * P + [GEN_SAMPLED] * (g - 1) + [GEN_LAST] + \
            [GEN_PAD] * (NEW - g)
    have = np.isin(gen, (GEN_PROMPT, GEN_SAMPLED))
    data = synthetic.activations((1, n, width), seed=1)
    data[:, ~have] = 0
    s.ledger.write_plan(s.ledger.default_plan(1))
    for u in s.ledger.plan():
        a, b = u["row_start"], u["row_end"]
        w = s.region_writer(u["unit_id"], a, b)
        w.write_meta(a, np.zeros(b - a, np.int32), np.zeros(b - a, np.int64),
                     np.zeros(b - a, np.int32), gen=gen[a:b])
        w.write(a, data[:, a:b])
        w.commit()
    s.finalize({"status": "complete"})
    assert len(s.read_row_meta(0, n)) == 3  # the base columns, as for every store
    assert np.array_equal(s.read_gen(0, n), gen) and np.array_equal(s.read_gen(0, n, checked=True), gen)
    st = s.stats(["resid_post.0"], "all")["resid_post.0"]
    x = data[0, have].astype(np.float64)
    assert st["count"] == int(have.sum()) < n
    assert np.allclose(st["mean"], x.mean(0), rtol=1e-6, atol=1e-9)
    ds = ActivationDataset(str(tmp_path / "g.zarr"), "resid_post.0", batch_size=100,
                           shuffle=False, return_meta=True)
    batches = list(ds)
    rows = np.concatenate([b["row"].numpy() for b in batches])
    assert np.array_equal(np.sort(rows), np.flatnonzero(have))
    assert all(set(b["gen"].tolist()) <= {GEN_PROMPT, GEN_SAMPLED} for b in batches)


def test_gen_rows_and_a_role_filter_combine_and_a_plain_store_has_no_gen_column(tmp_path):
    """The reader's gen skipping and a chat role filter keep the intersection (through the
    gather-ahead windows); a store not made for generation keeps the three base columns and
    refuses gen= writes and read_gen (old stores resume and verify as before)."""
    from harvest.store.read.dataset import ActivationDataset
    from harvest.store.format.roles import ASSISTANT, USER

    n, width = 512, 8
    url = str(tmp_path / "gr.zarr")
    s = create_store(url, points=["resid_post.0"], width=width, n_rows=n, shard_rows=128,
                     context_size=C, attrs={"chat": {"captured": None}}, roles=True,
                     generated=True)
    assert list(s.meta_columns) == ["token_id", "doc_id", "position", "role", "gen"]
    rng = np.random.default_rng(1)
    gen = rng.choice([GEN_PROMPT, GEN_SAMPLED, GEN_LAST, GEN_PAD], n).astype(np.int8)
    role = rng.choice([ASSISTANT, USER], n).astype(np.int8)
    data = synthetic.activations((1, n, width), seed=2)
    s.ledger.write_plan(s.ledger.default_plan(1))
    for u in s.ledger.plan():
        a, b = u["row_start"], u["row_end"]
        w = s.region_writer(u["unit_id"], a, b)
        w.write_meta(a, np.zeros(b - a, np.int32), np.zeros(b - a, np.int64),
                     np.zeros(b - a, np.int32), role=role[a:b], gen=gen[a:b])
        w.write(a, data[:, a:b])
        w.commit()
    s.finalize({"status": "complete"})
    want = np.flatnonzero(np.isin(gen, (GEN_PROMPT, GEN_SAMPLED)) & (role == ASSISTANT))
    ds = ActivationDataset(url, "resid_post.0", batch_size=37, shuffle=True, roles=["assistant"])
    rows = np.concatenate([b["row"].numpy() for b in ActivationDataset(
        url, "resid_post.0", batch_size=37, shuffle=True, roles=["assistant"], return_meta=True)])
    assert np.array_equal(np.sort(rows), want)
    acts = torch.cat(list(ds))
    assert acts.shape[0] == want.shape[0]

    plain = create_store(str(tmp_path / "p.zarr"), points=["resid_post.0"], width=width,
                         n_rows=128, shard_rows=128, context_size=C)
    assert list(plain.meta_columns) == ["token_id", "doc_id", "position"]
    plain.ledger.write_plan(plain.ledger.default_plan(1))
    w = plain.region_writer(0, 0, 128)
    z = np.zeros(128, np.int32)
    try:
        w.write_meta(0, z, z.astype(np.int64), z, gen=np.zeros(128, np.int8))
        raise AssertionError("gen= on a store without the column was accepted")
    except ValueError as e:
        assert "no gen column" in str(e)
    try:
        plain.read_gen(0, 128)
        raise AssertionError("read_gen on a store without the column worked")
    except ValueError as e:
        assert "no `gen` column" in str(e)


def test_n_samples_store_the_prompt_once_then_one_region_per_sample():
    """n = 2: prompt rows once (sample 0's), region s at [L + s*M, L + (s+1)*M) holding sample s's
    fed tokens, its last token and padding; the sample column says whose region a row is in.
    The in-place path (sample 0's rows in the shard buffer) gives the same rows as the copy."""
    n, M = 2, 4
    Pn = C - n * M
    gc = GenerateConfig(max_new_tokens=M, n=n)
    s = Slots(gc.describe(), C)
    assert s.P == Pn == gc.prompt_len(C)
    prompt = np.arange(100, 100 + Pn, dtype=np.int32)
    reqs = [_req(prompt, [5, 6], sample=0), _req(prompt, [7, 8, 9, 10], sample=1)]
    ctx = np.concatenate([prompt, np.zeros(C - Pn, np.int32)])
    doc, pos = np.full(C, 3, np.int64), np.arange(C, dtype=np.int32)
    meta, acts = s.rows(ctx, doc, pos, reqs)
    assert meta["gen"].tolist() == [GEN_PROMPT] * Pn + [GEN_SAMPLED, GEN_LAST, GEN_PAD, GEN_PAD] \
        + [GEN_SAMPLED] * 3 + [GEN_LAST]
    assert meta["sample"].tolist() == [0] * Pn + [0] * M + [1] * M
    assert meta["token_id"].tolist() == prompt.tolist() + [5, 6, META_PAD, META_PAD, 7, 8, 9, 10]
    # each sample's generated rows continue the prompt's positions
    assert meta["position"].tolist() == list(range(Pn)) + [Pn, META_PAD, META_PAD, META_PAD] \
        + [Pn, Pn + 1, Pn + 2, META_PAD]
    assert torch.equal(acts[:, :Pn + 1], reqs[0].acts)  # prompt + sample 0's fed token
    assert torch.equal(acts[:, Pn + M:Pn + M + 3], reqs[1].acts[:, Pn:])  # sample 1's own rows
    assert (acts[:, Pn + 1:Pn + M] == 0).all() and (acts[:, -1] == 0).all()
    # in place: the engine wrote sample 0's prompt + region (L + M rows) into the buffer
    view = np.zeros((2, Pn + M, 4), np.float32)
    view[:, :Pn + 1] = reqs[0].acts.numpy()
    view[:, Pn + 1:] = 7  # stale bytes of a recycled buffer
    meta2, rest = s.rows(ctx, doc, pos, reqs, view)
    assert all(np.array_equal(meta[k], meta2[k]) for k in meta)
    assert rest.shape == (2, C - Pn - M, 4)
    assert np.array_equal(np.concatenate([view, rest.numpy()], 1), acts.numpy())
    # samples out of order or of another prompt are refused, never written
    with pytest.raises(RuntimeError, match="another prompt"):
        s.rows(ctx, doc, pos, reqs[::-1])
    with pytest.raises(RuntimeError, match="2 samples"):
        Slots(GenerateConfig(max_new_tokens=M, n=3).describe(), C).rows(ctx, doc, pos, reqs)


def test_a_chat_slot_prompt_ends_at_its_padding_and_generated_rows_are_the_assistants():
    """Chat: the prompt is the conversation (up to the first pad row), regions follow it at once;
    generated rows (fed and last) get role assistant, the rest of the slot role pad."""
    from harvest.store.format.roles import ASSISTANT, PAD, SCAFFOLD, USER

    M = 4
    s = Slots(GenerateConfig(max_new_tokens=M).describe(), C)
    L = 7
    role = np.full(C, PAD, np.int8)
    role[:L] = [SCAFFOLD, USER, USER, SCAFFOLD, SCAFFOLD, SCAFFOLD, SCAFFOLD]
    ctx = np.full(C, 2, np.int32)
    ctx[:L] = np.arange(40, 40 + L)
    doc = np.where(role == PAD, META_INSERTED, 9).astype(np.int64)
    pos = np.where(role == PAD, META_INSERTED, np.arange(C)).astype(np.int32)
    assert s.prompt_len(role) == L
    req = _req(ctx[:L], [11, 12, 2])
    meta, acts = s.rows(ctx, doc, pos, [req], role=role)
    want_role = role[:L].tolist() + [ASSISTANT] * 3 + [PAD] * (C - L - 3)
    assert meta["role"].tolist() == want_role
    assert meta["gen"].tolist() == [GEN_PROMPT] * L + [GEN_SAMPLED] * 2 + [GEN_LAST] + \
        [GEN_PAD] * (C - L - 3)
    assert meta["doc_id"][:L + 2].tolist() == [9] * (L + 2) and (meta["doc_id"][L + 2:] == META_PAD).all()
    assert "sample" not in meta  # n = 1: no sample column
    assert torch.equal(acts[:, :L + 2], req.acts) and (acts[:, L + 2:] == 0).all()
    # a conversation that overruns the prompt room (the tokenisers skip those) is refused
    bad = np.full(C, USER, np.int8)
    with pytest.raises(RuntimeError, match="prompt room"):
        s.prompt_len(bad)


def test_sample_column_only_in_n_sample_stores_and_old_generation_stores_read_sample_0(tmp_path):
    n = 128
    one = create_store(str(tmp_path / "one.zarr"), points=["resid_post.0"], width=4, n_rows=n,
                       shard_rows=128, context_size=C, generated=True, dtype="float32")
    many = create_store(str(tmp_path / "many.zarr"), points=["resid_post.0"], width=4, n_rows=n,
                        shard_rows=128, context_size=C, generated=True, samples=True,
                        dtype="float32")
    assert "sample" not in one.meta_columns and list(many.meta_columns)[-1] == "sample"
    smp = (np.arange(n) % 3).astype(np.int16)
    for st in (one, many):
        st.ledger.write_plan(st.ledger.default_plan(1))
        w = st.region_writer(0, 0, n)
        z = np.zeros(n, np.int32)
        if st is one:
            with pytest.raises(ValueError, match="no sample column"):
                w.write_meta(0, z, z.astype(np.int64), z, sample=smp)
            w.write_meta(0, z, z.astype(np.int64), z)
        else:
            w.write_meta(0, z, z.astype(np.int64), z, sample=smp)
        w.write(0, np.zeros((1, n, 4), np.float32))
        w.commit()
        st.finalize({"status": "complete"})
    assert np.array_equal(many.read_sample(0, n), smp)
    assert np.array_equal(many.read_sample(0, n, checked=True), smp)
    assert not one.read_sample(0, n).any() and one.read_sample(0, n).shape == (n,)
    # the reader's metadata carries it, row for row
    from harvest.store.read.dataset import ActivationDataset

    for shuffle in (False, True):
        batches = list(ActivationDataset(many, "resid_post.0", batch_size=50, shuffle=shuffle,
                                         return_meta=True))
        rows = np.concatenate([b["row"].numpy() for b in batches])
        got = np.concatenate([b["sample"].numpy() for b in batches])
        assert np.array_equal(np.sort(rows), np.arange(n)) and np.array_equal(got, smp[rows])
    assert "sample" not in next(iter(ActivationDataset(one, "resid_post.0", batch_size=50,
                                                       return_meta=True)))
    plain = create_store(str(tmp_path / "p.zarr"), points=["resid_post.0"], width=4, n_rows=n,
                         shard_rows=128, context_size=C)
    with pytest.raises(ValueError, match="not created for generation"):
        plain.read_sample(0, n)
    with pytest.raises(ValueError, match="needs generated=True"):
        create_store(str(tmp_path / "x.zarr"), points=["resid_post.0"], width=4, n_rows=n,
                     shard_rows=128, samples=True)


def test_a_text_generation_store_names_the_eos_ids_that_stop_its_samples(tmp_path):
    """`generation.stop_ids` lists every id the engine stops at: with stop_at_eos the checkpoint's
    EOS ids (config and generation config) are among them in a text store too, not only in chat."""
    import json

    import transformers as tf

    from harvest.pipeline.config.run import from_dict
    from harvest.pipeline.actor.generation import store_attrs

    tf.LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=1, eos_token_id=[7, 9]).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))

    def stop_ids(**generate):
        cfg = from_dict({"model": {"path": str(tmp_path), "backend": "vllm"},
                         "data": {"source": str(tmp_path / "corpus.jsonl")},
                         "packing": {"context_size": 32},
                         "capture": {"generate": {"max_new_tokens": 4, "stop": [3], **generate}}})
        return store_attrs(cfg.capture.generate, cfg.data.format == "chat",
                           cfg.packing.context_size, str(tmp_path))["stop_ids"]

    assert stop_ids() == [3, 7, 9, 11]
    assert stop_ids(stop_at_eos=False) == [3]
