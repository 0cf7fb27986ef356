"""Chat input through the real pipeline (issue 26 A): SmolLM2-135M-Instruct, its chat template, a
local jsonl of conversations, two Ray actors, capture.roles: [assistant]. The stored rows must
be exactly the assistant tokens, recounted from an independent ChatML parse of the model's own
render, with the activations of a single-process capture of the same contexts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harvest.pipeline.driver import run
from harvest.pipeline.store import open_store
from harvest.pipeline.store.reader import ActivationDataset
from harvest.pipeline.store.roles import CODES
from tests.support.pipeline import make_cfg, reference_capture

pytestmark = pytest.mark.slow  # Ray + a model: not in `pytest -m 'not slow'`

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
    """Independent of pipeline/chat.py: walk the ChatML tokens; a turn is <|im_start|>, a header
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
                            "overflow": "truncate"},
                   capture={"points": [POINT], "roles": ["assistant"], "check_model": False},
                   store={"shard_rows": 2 * C})
    summary = run(cfg)
    st = open_store(cfg.store.resolved_url)
    tok = AutoTokenizer.from_pretrained(smollm2)

    # the contexts the pipeline should have made: one per usable conversation, in order
    usable = [(i, c) for i, c in enumerate(convs) if isinstance(c, list)]
    want_tok = np.full((len(usable), C), tok.pad_token_id, np.int32)
    want_asst = np.zeros((len(usable), C), bool)
    for k, (_, c) in enumerate(usable):
        own = tok.apply_chat_template(c, tokenize=True)
        ids = list(getattr(own, "input_ids", own))
        n = min(C, len(ids))
        want_tok[k, :n] = ids[:n]
        asst = chatml_assistant(ids, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id,
                                tok("\n", add_special_tokens=False)["input_ids"][0], tok)
        want_asst[k, :n] = asst[:n]
    assert summary["tokens"] == st.n_rows == len(usable) * C
    assert summary["data"]["rows_skipped"] == 1
    tok_ids, doc, _ = st.read_row_meta_checked(0, st.n_rows)
    role = np.asarray(st._meta_array("role")[:])
    np.testing.assert_array_equal(tok_ids.reshape(-1, C), want_tok)
    np.testing.assert_array_equal(doc.reshape(-1, C)[:, 0], [i for i, _ in usable])
    np.testing.assert_array_equal(role == CODES["assistant"], want_asst.ravel())

    # stored: the assistant rows, equal to a single-process capture of the same contexts;
    # every other row ran as context and holds zeros
    keep = want_asst.ravel()
    got = np.asarray(st.read(POINT, 0, st.n_rows))
    ref = reference_capture(smollm2, tok_ids, C, st.shard_rows, cfg.capture.batch_contexts,
                            [POINT])[POINT]
    np.testing.assert_array_equal(got[keep].view(np.uint16), ref[keep].view(np.uint16))
    assert not got[~keep].view(np.uint16).any()
    assert keep.sum() > 100

    # the reader yields exactly those rows, by default and with roles=["assistant"]
    for kw in ({}, {"roles": ["assistant"]}):
        ds = ActivationDataset(st, batch_size=64, shuffle=False, return_meta=True, **kw)
        rows = np.sort(np.concatenate([b["row"].numpy() for b in ds]))
        np.testing.assert_array_equal(rows, np.flatnonzero(keep))
    assert st.attrs["chat"]["captured"] == ["assistant"]
