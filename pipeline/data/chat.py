"""Conversations rendered with the model's chat template, each token labelled with its role.

The tokens a chat store holds are exactly the tokens the model sees for the conversation: the
template's text render, tokenised whole (`add_special_tokens=False`, as `apply_chat_template(
tokenize=True)` does). Labels come from diffing renders, never from parsing one template's syntax
(the same code must serve ChatML, Llama-3, Gemma ... templates):

1. render the conversation prefix by prefix, r_k = template(messages[:k]); every r_k must be a
   prefix of r_(k+1), so the characters [len(r_(k-1)), len(r_k)) are "what message k added";
2. inside that span, find the message's own content by rendering the same prefix with message k's
   content emptied: span = e[:h] + content + e[h:] for exactly the h where both sides match; the
   content characters get the message's role, the rest of the span (the template's header and
   footer, a default system prompt it injects) is scaffolding;
3. map characters to tokens through the fast tokenizer's offsets: a token gets the label its
   characters share.

Failures are loud and never a guess:
- a template whose renders are not prefix-stable (it rewrites earlier turns when a later one
  comes, e.g. drops reasoning from earlier assistant turns) cannot be diffed: `ChatTemplateError`,
  which stops the run (every multi-turn conversation would hit it);
- one conversation that cannot be labelled (a token spanning content and scaffolding, a template
  that changes the content, an unknown role): `ChatLabelError`, the row is skipped and counted
  under its reason, like a row without text.
"""

from __future__ import annotations

import numpy as np

from .documents import DataError
from harvest.pipeline.config.corpus import MAX_CONVERSATION_CHARS_DEFAULT, MAX_MESSAGES_DEFAULT
from harvest.store.format import roles as R


class ChatTemplateError(DataError):
    """The model's chat template cannot be diffed; the message says why and what to do."""


class ChatLabelError(ValueError):
    """One conversation cannot be labelled exactly; `reason` is the skip-reason it is counted as."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason


def conversation_problem(value, max_messages: int = MAX_MESSAGES_DEFAULT,
                         max_chars: int = MAX_CONVERSATION_CHARS_DEFAULT) -> "str | None":
    """Why a `messages` value is not a usable conversation (a skip reason), or None. The limits
    are data.max_messages and data.max_conversation_chars (the sum of the contents' lengths);
    the message count is checked before any message is looked at."""
    if value is None:
        return "null"
    if not isinstance(value, (list, tuple)) or not value:
        return "not_messages"
    if len(value) > max_messages:
        return "too_many_messages"
    chars = 0
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return "not_messages"
        if m.get("role") not in R.MESSAGE_ROLES:
            return "unknown_role"
        chars += len(m["content"])
    if chars > max_chars:
        return "too_many_chars"
    if not any(m["content"].strip() for m in value):
        return "empty"
    return None


def _render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=False)


def check_template(tokenizer, where: str) -> None:
    """Refuse a tokenizer without a chat template (`where` names the model) before anything runs."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"data.format: chat needs the model's chat template, and {where} has none (no "
            "chat_template in its tokenizer_config.json or chat_template.jinja): use an instruct "
            "checkpoint, or render the conversations to text yourself and use data.format text")
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"data.format: chat labels tokens through a fast tokenizer's character offsets, and "
            f"{where} loads a slow one: give a checkpoint with tokenizer.json")


def pad_token_id(tokenizer) -> int:
    """The token that fills a context after its conversation ends: the tokenizer's pad token,
    else its EOS. Pad rows come after the conversation, so (causal attention) they change none
    of its rows; they are labelled `pad` and their id is a special token (out of kept stats)."""
    for name in ("pad_token_id", "eos_token_id"):
        t = getattr(tokenizer, name, None)
        if t is not None:
            return int(t)
    raise ChatTemplateError(
        "data.format: chat pads each conversation's last context, and the tokenizer has neither "
        "a pad nor an EOS token: give a checkpoint whose tokenizer defines one")


def chat_attrs(data, roles: "list | None") -> dict:
    """What the store records about chat input (run attributes, key `chat`): {} for text.
    `data`: the data section; `roles`: capture.roles."""
    if data.format != "chat":
        return {}
    return {"chat": {"messages_column": data.messages_column,
                     "captured": sorted(roles, key=R.CODES.get) if roles else None,
                     "codes": dict(R.CODES)}}


def char_labels(tokenizer, messages) -> tuple[str, np.ndarray]:
    """(the full render, a role code per character of it)."""
    prev = ""
    pieces: list[np.ndarray] = []
    for k, msg in enumerate(messages):
        cur = _render(tokenizer, messages[:k + 1])
        if not cur.startswith(prev):
            at = next((i for i, (a, b) in enumerate(zip(prev, cur)) if a != b), len(cur))
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: rendering {k + 1} messages changes the "
                f"render of the first {k} at character {at} ({prev[at:at + 40]!r} became "
                f"{cur[at:at + 40]!r}), so tokens cannot be attributed to messages by diffing "
                "renders; use a template that renders earlier turns the same way, or data.format "
                "text with conversations rendered beforehand")
        span = cur[len(prev):]
        empty = _render(tokenizer, list(messages[:k]) + [{**msg, "content": ""}])
        if not empty.startswith(prev):
            raise ChatTemplateError(
                "the chat template is not prefix-stable when a message is empty: cannot find "
                f"where message {k}'s content sits; render the conversations to text first")
        h = _content_offset(span, empty[len(prev):], msg["content"])
        if h is None:
            raise ChatLabelError(
                "role_unlabelled",
                f"message {k} ({msg['role']}): the template does not copy its content verbatim "
                "between a header and a footer, so its tokens cannot be labelled exactly")
        lab = np.full(len(span), R.SCAFFOLD, np.int8)
        lab[h:h + len(msg["content"])] = R.CODES[msg["role"]]
        pieces.append(lab)
        prev = cur
    return prev, (np.concatenate(pieces) if pieces else np.zeros(0, np.int8))


def _content_offset(span: str, empty: str, content: str) -> "int | None":
    """The h with span == empty[:h] + content + empty[h:], or None. When several h fit (the
    content starts with the text that follows it in the template) the content is ambiguous only
    in which copy of a repeated string it is; the largest h is the content's own place in every
    template seen (header, then content, then footer), so it is taken."""
    if len(span) != len(empty) + len(content):
        return None
    n = len(empty)
    h = 0
    while h < n and span[h] == empty[h]:
        h += 1
    for cand in range(h, -1, -1):
        if span[cand:cand + len(content)] == content and span[cand + len(content):] == empty[cand:]:
            return cand
    return None


def label_conversation(tokenizer, messages, generation_prompt: bool = False
                       ) -> tuple[list[int], np.ndarray]:
    """(token ids of the rendered conversation, role code per token); see the module docstring.

    `generation_prompt`: the render ends with the template's opening of an assistant turn
    (`add_generation_prompt=True`), the prompt of a generation (capture.generate); those
    characters are scaffolding. They must extend the plain render, as every turn must."""
    text, chars = char_labels(tokenizer, messages)
    if generation_prompt:
        full = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=True)
        if not full.startswith(text) or len(full) == len(text):
            raise ChatTemplateError(
                "capture.generate with data.format: chat needs a chat template whose generation "
                "prompt (add_generation_prompt=True) is appended to the conversation's render, "
                f"and this one's is not (it ends {full[-40:]!r}): use another instruct checkpoint "
                "or render the prompts to text yourself and use data.format: text")
        chars = np.concatenate([chars, np.full(len(full) - len(text), R.SCAFFOLD, np.int8)])
        text = full
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    out = np.empty(len(ids), np.int8)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if b <= a:  # a token with no characters of its own (none in ChatML): template-made
            out[i] = R.SCAFFOLD
            continue
        seg = chars[a:b]
        if (seg != seg[0]).any():
            raise ChatLabelError(
                "role_straddle",
                f"token {i} ({text[a:b]!r}) spans {R.names_of(set(seg.tolist()))}: the tokenizer "
                "merged message text with template text, so the token has no single role")
        out[i] = seg[0]
    return ids, out


def end_of_turn_ids(tokenizer) -> list[int]:
    """The tokens that end an assistant turn: the tokenizer's EOS, and the first token the
    template writes after an assistant message's content when it is a special token (ChatML's
    <|im_end|>, Llama-3's <|eot_id|>, Gemma's <end_of_turn>). Found by labelling a probe
    conversation, as every label is, so no template's syntax is hard-coded here. A generation
    stops on them (generation.resolved_stop)."""
    out = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        ids, labels = label_conversation(tokenizer, probe)
    except (ChatLabelError, ChatTemplateError):
        return sorted(out)
    asst = np.flatnonzero(labels == R.ASSISTANT)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(
        (tokenizer.get_added_vocab() or {}).values())
    if asst.size and asst[-1] + 1 < len(ids) and ids[asst[-1] + 1] in special:
        out.add(int(ids[asst[-1] + 1]))
    return sorted(out)
