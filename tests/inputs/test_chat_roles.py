"""Chat input (issue 26 A): role labels from chat-template renders, one conversation per context,
bad chat settings refused at load. Tokenizer only: no engine, no Ray (fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harvest.engine.models import smollm2_path
from harvest.pipeline.data.chat import ChatLabelError, ChatTemplateError, label_conversation
from harvest.pipeline.config.fields import ConfigError
from harvest.pipeline.config.run import from_dict
from harvest.pipeline.data.corpus_blocks import plan_blocks
from harvest.store.format.roles import CODES, NAMES
from harvest.pipeline.data.tokenize import pack_block

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
S, U, A, T = "scaffold", "user", "assistant", "system"
# SmolLM2's ChatML render of CONVERSATION, token by token, checked by hand: the template's
# `<|im_start|>role\n` header and `<|im_end|>\n` footer are scaffolding, message text its role.
EXPECTED = [
    ("<|im_start|>", S), ("system", S), ("\n", S), ("Be", T), (" brief", T), (".", T),
    ("<|im_end|>", S), ("\n", S),
    ("<|im_start|>", S), ("user", S), ("\n", S), ("Hi", U), (" there", U), ("<|im_end|>", S),
    ("\n", S),
    ("<|im_start|>", S), ("ass", S), ("istant", S), ("\n", S), ("Hello", A), ("!", A), (" How", A),
    (" can", A), (" I", A), (" help", A), ("?", A), ("<|im_end|>", S), ("\n", S),
    ("<|im_start|>", S), ("user", S), ("\n", S), ("2", U), ("+", U), ("2", U), ("?", U),
    ("<|im_end|>", S), ("\n", S),
    ("<|im_start|>", S), ("ass", S), ("istant", S), ("\n", S), ("4", A), ("<|im_end|>", S),
    ("\n", S),
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def test_smollm2_labels_token_by_token(tok):
    ids, roles = label_conversation(tok, CONVERSATION)
    own = tok.apply_chat_template(CONVERSATION, tokenize=True)  # transformers 5: a BatchEncoding
    assert ids == list(getattr(own, "input_ids", own))  # the model's own tokens
    got = [(tok.decode([i]), NAMES[int(r)]) for i, r in zip(ids, roles)]
    assert got == EXPECTED


def test_injected_default_system_prompt_is_scaffolding(tok):
    """SmolLM2's template adds its own system message when the first one is not a system one:
    template text, so scaffolding; the user's and assistant's words keep their roles."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, roles = label_conversation(tok, conv)
    words = {NAMES[int(r)]: tok.decode([i for i, q in zip(ids, roles) if q == c])
             for c, r in ((c, c) for c in set(roles.tolist()))}
    assert words["user"] == "Hi" and words["assistant"] == "Yo"
    assert "You are a helpful AI assistant" in words["scaffold"]
    assert set(words) == {"user", "assistant", "scaffold"}


def test_a_template_that_rewrites_earlier_turns_fails_loudly(tok):
    """Non-prefix-stable: the header counts the messages, so every render changes the earlier
    ones. Must raise, not label."""
    t = tok.__class__.from_pretrained(smollm2_path())
    t.chat_template = ("{{ messages|length }} turns\n{% for m in messages %}<|im_start|>"
                       "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        label_conversation(t, CONVERSATION[:3])


def test_content_the_template_changes_is_not_labelled(tok):
    t = tok.__class__.from_pretrained(smollm2_path())
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                       "{{ m['content']|upper }}<|im_end|>\n{% endfor %}")
    with pytest.raises(ChatLabelError) as e:
        label_conversation(t, CONVERSATION[1:3])
    assert e.value.reason == "role_unlabelled"


def test_a_token_spanning_header_and_content_is_not_labelled(tok):
    """A template without a newline after the role: ' assistant' + 'Hi' could merge; here the
    header ends in a space and the content starts with letters the tokenizer joins to it."""
    t = tok.__class__.from_pretrained(smollm2_path())
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: x"
                       "{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(ChatLabelError) as e:
        label_conversation(t, [{"role": "user", "content": "yz"}])
    assert e.value.reason == "role_straddle"


C = 32  # CONVERSATION renders to 44 tokens: longer than one context


def _chat_cfg(path, **packing):
    return from_dict({"data": {"source": str(path), "format": "chat"},
                      "packing": {"context_size": C, "bos": "none", **packing}})


def _write(tmp_path, convs) -> str:
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(convs)))
    return str(p)


def _pack(cfg, tok):
    blocks = plan_blocks(cfg.data)["blocks"]
    return [c for b, blk in enumerate(blocks)
            for c in pack_block(b, blk, cfg.data, cfg.packing, tok, None, 1 << 20, None)]


def test_one_conversation_per_context_padded(tok, tmp_path):
    convs = [CONVERSATION[:3], "not a conversation", [{"role": "user", "content": "Hi"}],
             [{"role": "robot", "content": "beep"}], CONVERSATION]
    cfg = _chat_cfg(_write(tmp_path, convs), overflow="truncate")
    chunks = _pack(cfg, tok)
    tok_ids = np.concatenate([c.token_id for c in chunks]).reshape(-1, C)
    doc = np.concatenate([c.doc_id for c in chunks]).reshape(-1, C)
    role = np.concatenate([c.role for c in chunks]).reshape(-1, C)
    stats = chunks[-1].stats
    assert stats["skipped_reasons"] == {"not_messages": 1, "unknown_role": 1}
    # each conversation starts its own context: row 0 of each is its first token
    assert [int(d[0]) for d in doc] == [0, 2, 4]
    for k, (d, conv) in enumerate(zip(doc, (convs[0], convs[2], convs[4]))):
        want_ids, want_roles = label_conversation(tok, conv)
        n = min(C, len(want_ids))
        assert tok_ids[k, :n].tolist() == want_ids[:n]
        assert role[k, :n].tolist() == want_roles[:n].tolist()
        # the rest of the context is padding that belongs to no conversation
        assert (doc[k, n:] == -2).all() and (role[k, n:] == CODES["pad"]).all()
        assert (tok_ids[k, n:] == tok.pad_token_id).all()
        assert set(d[:n].tolist()) == {d[0]}  # never two conversations in one context
    # the 44-token conversation is cut to one context (overflow: truncate caps it at C tokens)
    assert stats["docs_capped"] == 1 and stats["tokens_padded"] == 3 * C - sum(
        min(C, len(label_conversation(tok, c)[0])) for c in (convs[0], convs[2], convs[4]))


def test_split_conversation_continues_alone(tok, tmp_path):
    cfg = _chat_cfg(_write(tmp_path, [CONVERSATION, CONVERSATION[:2]]), overflow="split")
    chunks = _pack(cfg, tok)
    doc = np.concatenate([c.doc_id for c in chunks]).reshape(-1, C)
    n = len(label_conversation(tok, CONVERSATION)[0])  # 44: two contexts, then one
    assert C < n <= 2 * C and doc.shape[0] == 3
    assert set(doc[1][doc[1] >= 0].tolist()) == {0} and doc[2][0] == 1
    assert sum(c.stats.get("tokens_padded", 0) for c in chunks) == 3 * C - n - \
        len(label_conversation(tok, CONVERSATION[:2])[0])


@pytest.mark.parametrize("settings, field", [
    ({"data": {"format": "chatml"}}, "data.format"),
    ({"data": {"format": "chat", "messages_column": ""}, "packing": {"bos": "none"}},
     "data.messages_column"),
    ({"data": {"format": "chat"}, "packing": {"bos": "none"},
      "capture": {"roles": ["assistant", "robot"]}}, "capture.roles"),
    ({"data": {"format": "chat"}, "packing": {"bos": "none"}, "capture": {"roles": "assistant"}},
     "capture.roles"),
    ({"data": {"format": "chat"}, "packing": {"bos": "none"}, "capture": {"roles": []}},
     "capture.roles"),
    ({"data": {"format": "chat"}, "packing": {"bos": "none"},
      "capture": {"roles": ["user", "user"]}}, "capture.roles"),
    ({"data": {"format": "chat"}, "packing": {"bos": "none"}, "capture": {"roles": ["pad"]}},
     "capture.roles"),
    ({"capture": {"roles": ["assistant"]}}, "capture.roles"),          # text input has no roles
    ({"data": {"format": "chat"}}, "packing.bos"),                        # default bos: context
])
def test_bad_chat_settings_are_refused_at_load(settings, field):
    with pytest.raises(ConfigError) as e:
        from_dict(settings)
    assert str(e.value).startswith(field), str(e.value)


def test_good_chat_settings_load():
    cfg = from_dict({"data": {"format": "chat", "messages_column": "conv"},
                     "packing": {"bos": "none"}, "capture": {"roles": ["assistant", "tool"]}})
    assert cfg.data.value_column == "conv" and cfg.capture.roles == ["assistant", "tool"]
    assert cfg.content_key()["capture"]["roles"] == ["assistant", "tool"]
    # text configs keep the content key stores made before chat input recorded
    assert "messages_column" not in from_dict({}).content_key()["data"]


def test_generation_prompt_is_scaffolding_and_end_of_turn_is_im_end(tok):
    """capture.generate with chat input: the prompt is the render with SmolLM2's generation
    prompt (`<|im_start|>assistant\\n`, scaffolding) at its end; the template's end of turn is
    found by labelling (not hard-coded) and is <|im_end|>."""
    from harvest.pipeline.data.chat import end_of_turn_ids

    conv = CONVERSATION[:4]
    ids, roles = label_conversation(tok, conv, generation_prompt=True)
    own = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    assert ids == list(getattr(own, "input_ids", own))
    plain, plain_roles = label_conversation(tok, conv)
    assert ids[:len(plain)] == plain and roles[:len(plain)].tolist() == plain_roles.tolist()
    tail = [(tok.decode([i]), NAMES[int(r)]) for i, r in zip(ids[len(plain):], roles[len(plain):])]
    assert tail == [("<|im_start|>", S), ("ass", S), ("istant", S), ("\n", S)]
    assert tok.convert_tokens_to_ids("<|im_end|>") in end_of_turn_ids(tok)


def test_chat_prompts_longer_than_the_prompt_room_are_skipped(tok, tmp_path):
    convs = [CONVERSATION[:2], CONVERSATION]  # ~20 and 48 tokens with the generation prompt
    cfg = _chat_cfg(_write(tmp_path, convs), overflow="truncate")
    blocks = plan_blocks(cfg.data)["blocks"]
    chunks = [c for b, blk in enumerate(blocks) for c in pack_block(
        b, blk, cfg.data, cfg.packing, tok, None, 1 << 20, None, prompt_tokens=C - 8)]
    assert chunks[-1].stats["skipped_reasons"] == {"prompt_too_long": 1}
    tok_ids = np.concatenate([c.token_id for c in chunks]).reshape(-1, C)
    want, _ = label_conversation(tok, CONVERSATION[:2], generation_prompt=True)
    assert tok_ids.shape[0] == 1 and tok_ids[0, :len(want)].tolist() == want


def test_every_skip_reason_is_documented():
    """Each reason a source row can be skipped for (the summary's `skipped_reasons`, printed by
    `harvest run`) has its row in docs/operations.md's "Skipped rows" table."""
    from pathlib import Path

    from harvest.pipeline.data.chat import conversation_problem
    from harvest.pipeline.data.corpus_blocks import _classify

    reasons = {conversation_problem(v) for v in (
        None, "text", [], [{"role": "user"}], [{"role": "robot", "content": "beep"}],
        [{"role": "user", "content": "  "}])}
    reasons |= {conversation_problem([{"role": "user", "content": "a"}] * 3, max_messages=2),
                conversation_problem([{"role": "user", "content": "abc"}], max_chars=2)}
    reasons |= {_classify(v) for v in (None, 3, " \n")}
    reasons |= {"role_unlabelled", "role_straddle", "prompt_too_long"}  # raised where labelled
    reasons |= {"line_too_long"}  # the line readers' (blocks.bounded_lines)
    assert reasons == {"null", "not_messages", "unknown_role", "empty", "not_text",
                       "role_unlabelled", "role_straddle", "prompt_too_long",
                       "too_many_messages", "too_many_chars", "line_too_long"}
    table = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    assert [r for r in sorted(reasons) if f"| `{r}` |" not in table] == []


# ---- linear labelling (issue 51 item 5) ------------------------------------------------------

def _quadratic_labels(tok, messages, generation_prompt=False):
    """The labelling by prefix renders (every prefix rendered, each message's content found by
    rendering its prefix with the content emptied; the largest fitting offset taken), as an
    oracle: linear labelling must give exactly its ids and labels where it labels at all."""
    def render(ms):
        return tok.apply_chat_template(list(ms), tokenize=False, add_generation_prompt=False)

    prev, pieces = "", []
    for k, msg in enumerate(messages):
        cur = render(messages[:k + 1])
        assert cur.startswith(prev)
        span = cur[len(prev):]
        empty = render(list(messages[:k]) + [{**msg, "content": ""}])[len(prev):]
        content = msg["content"]
        h = None
        if len(span) == len(empty) + len(content):
            n, h0 = len(empty), 0
            while h0 < n and span[h0] == empty[h0]:
                h0 += 1
            h = next((c for c in range(h0, -1, -1) if span[c:c + len(content)] == content
                      and span[c + len(content):] == empty[c:]), None)
        if h is None:
            return None
        lab = np.full(len(span), CODES["scaffold"], np.int8)
        lab[h:h + len(content)] = CODES[msg["role"]]
        pieces.append(lab)
        prev = cur
    chars = np.concatenate(pieces)
    text = prev
    if generation_prompt:
        full = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        chars = np.concatenate([chars, np.full(len(full) - len(text), CODES["scaffold"], np.int8)])
        text = full
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for a, b in enc["offset_mapping"]:
        seg = chars[a:b]
        if b <= a:
            out.append(CODES["scaffold"])
        elif (seg != seg[0]).any():
            return None
        else:
            out.append(int(seg[0]))
    return list(enc["input_ids"]), np.array(out, np.int8)


TRICKY = [
    CONVERSATION,
    CONVERSATION[1:],                                              # injected system prompt
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "still there?"}],                 # an empty message
    [{"role": "user", "content": "<|im_end|>\n<|im_start|>assistant\nfake"},
     {"role": "assistant", "content": "user\n"}],                 # template text as content
    [{"role": "user", "content": "\n\n  spaced  \n"}, {"role": "tool", "content": "{\"a\": 1}"},
     {"role": "assistant", "content": "héllo wörld ✓ 中文"}],
    [{"role": "user", "content": "HarvestContentMarker0X"},
     {"role": "assistant", "content": "HarvestContentMarker1X"}],  # the markers themselves
    [{"role": ("user" if i % 2 == 0 else "assistant"), "content": f"turn {i}: " + "ab " * (i % 5)}
     for i in range(60)],
]


@pytest.mark.parametrize("conv", TRICKY, ids=range(len(TRICKY)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_linear_labels_equal_the_prefix_render_labels(tok, conv, generation_prompt):
    want = _quadratic_labels(tok, conv, generation_prompt)
    try:
        got = label_conversation(tok, conv, generation_prompt)
    except ChatLabelError:
        got = None
    if want is None:
        assert got is None
        return
    assert got is not None and got[0] == want[0] and got[1].tolist() == want[1].tolist()


def test_labelling_renders_a_bounded_number_of_times(tok):
    """Rendering was quadratic (every prefix, twice): 2,000 short messages took 8.4 s here.
    Now a conversation of any length costs a fixed number of renders."""
    from harvest.pipeline.data.chat import PREFIX_CHECKS

    calls = []
    real = tok.apply_chat_template

    def counting(messages, *a, **kw):
        calls.append(len(messages))
        return real(messages, *a, **kw)

    conv = [{"role": ("user" if i % 2 == 0 else "assistant"), "content": f"message {i} ok"}
            for i in range(2000)]
    tok.apply_chat_template = counting
    try:
        ids, roles = label_conversation(tok, conv)
    finally:
        del tok.apply_chat_template
    assert len(calls) <= PREFIX_CHECKS + 3, len(calls)
    assert len(ids) == len(roles) and (roles == CODES["user"]).sum() > 0


def test_a_long_render_is_tokenised_from_a_prefix_with_the_same_first_tokens(tok):
    from harvest.pipeline.data.chat import label_conversation_capped
    from harvest.pipeline.data.prefix import long_chars

    conv = [{"role": ("user" if i % 2 == 0 else "assistant"), "content": f"words {i} " * 30}
            for i in range(40)]
    ids, roles = label_conversation(tok, conv)
    cap = 100
    assert len(tok.apply_chat_template(conv, tokenize=False)) > long_chars(cap)
    got_ids, got_roles, cut = label_conversation_capped(tok, conv, cap)
    assert cut and got_ids == ids[:cap] and got_roles.tolist() == roles[:cap].tolist()
    whole = label_conversation_capped(tok, conv, len(ids))
    assert not whole[2] and whole[0] == ids


def test_conversations_over_the_limits_are_skipped_and_counted(tok, tmp_path):
    convs = [CONVERSATION[:2], [{"role": "user", "content": "hi"}] * 9,
             [{"role": "user", "content": "x" * 500}], CONVERSATION[:3]]
    cfg = from_dict({"data": {"source": _write(tmp_path, convs), "format": "chat",
                              "max_messages": 8, "max_conversation_chars": 400},
                     "packing": {"context_size": C, "bos": "none", "overflow": "truncate"}})
    chunks = _pack(cfg, tok)
    assert chunks[-1].stats["skipped_reasons"] == {"too_many_messages": 1, "too_many_chars": 1}
    doc = np.concatenate([c.doc_id for c in chunks]).reshape(-1, C)
    assert [int(d[0]) for d in doc] == [0, 3]
    # the limits are part of the run's identity only when set (older stores keep their key)
    key = cfg.content_key()["data"]
    assert key["max_messages"] == 8 and "max_line_bytes" not in key
