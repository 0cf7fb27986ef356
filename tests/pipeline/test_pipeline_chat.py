"""Chat input through the real pipeline (issue 26 A): SmolLM2-135M-Instruct, its chat template, a
local jsonl of conversations, two Ray actors, capture.roles: [assistant]. The stored rows must
be exactly the assistant tokens, recounted from an independent ChatML parse of the model's own
render, with the activations of a single-process capture of the same contexts. Conversations
longer than a context continue in the next one (`overflow: split`); three continuations start
with an assistant token, an attention sink that the `kept` statistics and the reader's
`exclude_special=True` leave out (FORMAT.md, "Statistics": positions 0 and 1), and that a reader
keeping position 0 is normalised over (and warned)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from harvest.store.read.dataset import ActivationDataset
from harvest.store.format.roles import CODES
from tests.support.pipeline import make_cfg, reference_capture

# Ray + a model (eager): not in `pytest -m 'not slow'`; beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]

C = 48
POINT = "resid_post.3"


def conversations() -> list:
    out = []
    for i in range(14):
        conv = [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}."}]
        if i % 3 == 0:
            conv.insert(0, {"role": "system", "content": "Answer with one sentence."})
        if i % 4 == 1:  # a second turn: longer than one context once in a while
            conv += [{"role": "user", "content": "And doubled, written out in words please?"},
                     {"role": "assistant", "content": f"Doubled it is {4 * i + 2}; in words, "
                                                      "that takes a few more tokens to say."}]
        out.append(conv)
    out.insert(5, "not a conversation")  # skipped and counted
    return out


def chatml_assistant(ids: list[int], im_start: int, im_end: int, newline: int, tok) -> np.ndarray:
    """Independent of pipeline/data/chat.py: walk the ChatML tokens; a turn is <|im_start|>, a header
    up to the first newline token naming the role, the content, <|im_end|>."""
    out = np.zeros(len(ids), bool)
    i = 0
    while i < len(ids):
        if ids[i] != im_start:
            i += 1
            continue
        j = ids.index(newline, i)
        role = tok.decode(ids[i + 1:j])
        k = ids.index(im_end, j)
        if role == "assistant":
            out[j + 1:k] = True
        i = k + 1
    return out


def test_role_masked_chat_run_stores_exactly_the_assistant_tokens(ray_cluster, smollm2, tmp_path):
    from transformers import AutoTokenizer

    convs = conversations()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = make_cfg(smollm2, str(tmp_path / "store"), data,
                   data={"format": "chat"},
                   packing={"context_size": C, "bos": "none", "max_tokens": None,
                            "overflow": "split"},
                   capture={"points": [POINT], "roles": ["assistant"], "check_model": False},
                   store={"shard_rows": 2 * C},
                   # one context per forward, here and in the reference: the eager engine batches
                   # a stream's contexts up to this many tokens, across units as they arrive, and
                   # bf16 bits depend on the batch
                   model={"max_num_batched_tokens": C})
    summary = run(cfg)
    st = open_store(cfg.store.resolved_url)
    tok = AutoTokenizer.from_pretrained(smollm2)

    # the contexts the pipeline should have made: each usable conversation, in order, over as
    # many contexts as it needs (split), its last one padded
    usable = [(i, c) for i, c in enumerate(convs) if isinstance(c, list)]
    want_tok, want_asst, want_doc = [], [], []
    for i, c in usable:
        own = tok.apply_chat_template(c, tokenize=True)
        ids = list(getattr(own, "input_ids", own))
        k = -(-len(ids) // C)
        t = np.full(k * C, tok.pad_token_id, np.int32)
        t[:len(ids)] = ids
        a = np.zeros(k * C, bool)
        a[:len(ids)] = chatml_assistant(ids, tok.convert_tokens_to_ids("<|im_start|>"),
                                        tok.eos_token_id,
                                        tok("\n", add_special_tokens=False)["input_ids"][0], tok)
        want_tok.append(t)
        want_asst.append(a)
        want_doc += [i] * k
    want_tok, want_asst = np.concatenate(want_tok), np.concatenate(want_asst)
    assert summary["tokens"] == st.n_rows == len(want_tok)
    assert summary["data"]["rows_skipped"] == 1
    tok_ids, doc, _ = st.read_row_meta_checked(0, st.n_rows)
    role = np.asarray(st.meta_array("role")[:])
    np.testing.assert_array_equal(tok_ids, want_tok)
    np.testing.assert_array_equal(doc.reshape(-1, C)[:, 0], want_doc)
    np.testing.assert_array_equal(role == CODES["assistant"], want_asst)

    # stored: the assistant rows, equal to a single-process capture of the same contexts;
    # every other row ran as context and holds zeros
    keep = want_asst
    got = np.asarray(st.read(POINT, 0, st.n_rows))
    ref = reference_capture(smollm2, tok_ids, C, C, 1, [POINT])[POINT]
    np.testing.assert_array_equal(got[keep].view(np.uint16), ref[keep].view(np.uint16))
    assert not got[~keep].view(np.uint16).any()
    assert keep.sum() > 100
    # the console says how many rows hold activations, and which source row was skipped why
    from harvest.pipeline.cli.commands.run import format_summary

    assert summary["tokens_this_run"] == st.n_rows
    assert summary["rows_with_activations_this_run"] == keep.sum()
    text = format_summary(summary)
    assert f"; {keep.sum()} of those rows hold activations" in text, text
    assert f"skipped 1 of {len(convs)} source rows (not_messages 1)" in text, text

    # the reader yields exactly those rows, by default and with roles=["assistant"]
    for kw in ({}, {"roles": ["assistant"]}):
        ds = ActivationDataset(st, batch_size=64, shuffle=False, return_meta=True, **kw)
        rows = np.sort(np.concatenate([b["row"].numpy() for b in ds]))
        np.testing.assert_array_equal(rows, np.flatnonzero(keep))
    assert st.attrs["chat"]["captured"] == ["assistant"]

    # continuation contexts that start inside an assistant turn: their first row is a sink
    rows = np.arange(st.n_rows)
    sinks = keep & (rows % C == 0)
    assert sinks.sum() == 3
    sq = (got.astype(np.float64) ** 2).sum(1)
    assert sq[sinks].min() > 20 * np.median(sq[keep]), (sq[sinks], np.median(sq[keep]))
    check_kept_stats(st, got, tok_ids, keep)
    # a reader that keeps position 0 yields the sinks, and is normalised over every row it
    # yields (warned: the sinks then set the scale)
    with pytest.warns(UserWarning, match="attention"):
        ds = ActivationDataset(st, POINT, batch_size=64, normalize="norm_scale",
                               norm_sample_rows=st.n_rows, return_meta=True)
    assert ds.norm_constants.source == "sample" and ds.norm_constants.rows == keep.sum()
    np.testing.assert_allclose(ds.norm_constants.mean_sq_norm[0], sq[keep].mean(), rtol=1e-9)
    assert sq[keep].mean() > 1.5 * sq[keep & (rows % C >= 2)].mean()   # the sinks' weight
    out = list(ds)
    y = torch.cat([b["acts"] for b in out]).double()
    got_rows = np.concatenate([b["row"].numpy() for b in out])
    assert np.array_equal(np.sort(got_rows), np.flatnonzero(keep))   # the sinks are yielded
    np.testing.assert_allclose(float((y * y).sum(1).mean()), st.width, rtol=1e-3)
    # exclude_special=True: the store's kept rows (sink positions out), E||x||^2 = width on them
    out = list(ActivationDataset(st, POINT, batch_size=64, normalize="norm_scale",
                                 exclude_special=True, return_meta=True))
    y = torch.cat([b["acts"] for b in out]).double()
    got_rows = np.concatenate([b["row"].numpy() for b in out])
    assert np.array_equal(np.sort(got_rows), np.flatnonzero(keep & (rows % C >= 2)
                                                            & ~np.isin(tok_ids, st.special_token_ids)))
    np.testing.assert_allclose(float((y * y).sum(1).mean()), st.width, rtol=1e-3)


def check_mixed_widths(st, model: str) -> None:
    """Each point at its own width, within bf16 tolerance of a single-process capture of the
    stored tokens (the actor's batches run beside other requests: last-bit differences; a row of
    another token, layer or point is > 30% off), and the reader's rows bit for bit the store's."""
    from tests.support.pipeline import reference_capture

    assert st.layout_version == 4 and st.widths == {POINT: 576, "mlp_in.3": 576, "z.3": 576,
                                                    "mlp_act.3": 1536, "mlp_out.3": 576}
    v = st.verify(deep=True)
    assert v.ok and v.complete, v.errors
    tok_ids, _, _ = st.read_row_meta_checked(0, st.n_rows)
    ref = reference_capture(model, tok_ids, C, 4 * C, 4, MIXED)
    stored = {}
    for p in MIXED:
        got = stored[p] = st.read(p, 0, st.n_rows)
        assert got.shape == ref[p].shape == (st.n_rows, st.widths[p])
        g, w = got.astype(np.float32), ref[p].astype(np.float32)
        err = np.linalg.norm(g - w, axis=1) / (np.linalg.norm(w, axis=1) + 1e-12)
        # z (attention's per-head output) is the noisiest in bf16: ~3% worst row, 0.5% median
        assert err.max() < 0.05 and np.median(err) < 0.01, (p, float(err.max()))
    assert all(st.stats([p])[p]["mean"].shape == (st.widths[p],) for p in MIXED)
    ds = ActivationDataset(st, MIXED, batch_size=100, seed=1, return_meta=True)
    n = 0
    for b in ds:
        rows = b["row"].numpy()
        for p in MIXED:
            x = b["acts"][p]
            assert x.shape == (len(rows), st.widths[p])
            assert np.array_equal(x.view(torch.int16).numpy().view(np.uint16),
                                  stored[p][rows].view(np.uint16)), p
        n += len(rows)
    assert n == st.n_rows


def check_kept_stats(st, got: np.ndarray, tok_ids: np.ndarray, stored: np.ndarray) -> None:
    """The store's `kept` statistics against a recount over its rows: stored rows whose token is
    not special and whose context position is at least 2 (FORMAT.md, "Statistics")."""
    rows = np.arange(st.n_rows)
    assert st.stats_skip_positions == 2
    kept = stored & (rows % st.context_size >= 2) & ~np.isin(tok_ids, st.special_token_ids)
    x = got[kept].astype(np.float64)
    s = st.stats([POINT], subset="kept")[POINT]
    assert s["count"] == kept.sum()
    np.testing.assert_allclose(s["mean"], x.mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(s["var"], x.var(0), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(s["mean_sq_norm"], (x * x).sum(1).mean(), rtol=1e-9)


# a transcoder's pair and the MLP's hidden units beside the stream: three widths' worth of points
# in one store (SmolLM2: d_model 576, mlp_act 1,536; z is 9 heads x 64 = 576)
MIXED = [POINT, "mlp_in.3", "z.3", "mlp_act.3", "mlp_out.3"]


def test_text_store_without_bos_leaves_its_sinks_out_of_kept(ray_cluster, smollm2, tmp_path):
    """`bos: none`: each context's first row is a document's token, and an attention sink. The
    run stores points of several widths (layout 4): each at its own, verify --deep passes, and
    every row equals the engine's single-process capture; the reader yields each at its width,
    rows aligned."""
    from transformers import AutoTokenizer
    from pydoc_data.topics import topics

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)[:40]))
    cfg = make_cfg(smollm2, str(tmp_path / "store"), data,
                   packing={"context_size": C, "bos": "none", "max_tokens": 16 * C},
                   capture={"points": MIXED, "check_model": False},
                   store={"shard_rows": 4 * C}, ray={"num_actors": 1})
    run(cfg)
    st = open_store(cfg.store.resolved_url)
    check_mixed_widths(st, smollm2)
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok_ids, _, _ = st.read_row_meta_checked(0, st.n_rows)
    got = np.asarray(st.read(POINT, 0, st.n_rows))
    assert st.n_rows == 16 * C and tok.bos_token_id not in tok_ids[::C]
    sq = (got.astype(np.float64) ** 2).sum(1)
    assert sq[::C].min() > 20 * np.median(sq)
    check_kept_stats(st, got, tok_ids, np.ones(st.n_rows, bool))
