"""Conversations rendered with the model's chat template, each token labelled with its role.

The tokens a chat store holds are exactly the tokens the model sees for the conversation: the
template's text render, tokenised whole (`add_special_tokens=False`, as `apply_chat_template(
tokenize=True)` does; a render longer than the tokens kept is tokenised from a bounded prefix,
pipeline/data/prefix.py). Labels come from comparing renders, never from parsing one template's
syntax (the same code must serve ChatML, Llama-3, Gemma ... templates), in a number of renders
that does not grow with the conversation (the cost is linear in its length):

1. render the conversation, `text`, and once more with every non-empty content replaced by a
   marker of its own (`_marker(k)`), the `skeleton`;
2. the skeleton is scaffolding with the markers in it: s_0 + m_1 + s_1 + ... + m_n + s_n. The
   render must be s_0 + c_1 + s_1 + ... + c_n + s_n, each marker where its content is, each
   exactly once; then content k's characters are known exactly and get message k's role, the
   rest (the template's headers and footers, a default system prompt it injects) is scaffolding;
3. map characters to tokens through the fast tokenizer's offsets: a token gets the label its
   characters share.

Failures are loud and never a guess:
- a template whose renders are not prefix-stable (it rewrites earlier turns when a later one
  comes: a message count in a header, reasoning dropped from earlier assistant turns) is
  refused: `ChatTemplateError`, which stops the run. Checked on the first PREFIX_CHECKS prefixes
  of every conversation and on its last one (the render of all messages but the last must
  begin the render of all): a violation found is a real one, and the labels never rely on the
  check (step 2 is verified for every conversation by itself);
- one conversation that cannot be labelled (a token spanning content and scaffolding, a template
  that changes the content or whose scaffolding depends on it, an unknown role): `ChatLabelError`,
  the row is skipped and counted under its reason, like a row without text.
"""

from __future__ import annotations

import numpy as np

from .documents import DataError
from .prefix import capped_encoding
from ..config.corpus import MAX_CONVERSATION_CHARS_DEFAULT, MAX_MESSAGES_DEFAULT
from ...store import roles as R


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


# Prefixes of each conversation whose renders are checked for prefix stability (module
# docstring), besides the last one: templates that rewrite earlier turns show it within a few.
PREFIX_CHECKS = 4


def _marker(k: int) -> str:
    """What stands for message k's content in the skeleton render: letters and digits only, so
    a template that escapes or trims content (`tojson`, `trim`) passes it through unchanged."""
    return f"HarvestContentMarker{k}X"


def check_prefix_stable(tokenizer, messages, full: "str | None" = None) -> None:
    """Refuse a template that is not prefix-stable on `messages` (module docstring): the render
    of the first k messages must begin the render of the first k' > k, checked for k = 1 ..
    PREFIX_CHECKS and for the last two prefixes; `full`: the render of all messages, when made."""
    n = len(messages)
    ks = sorted({k for k in range(1, min(n, PREFIX_CHECKS) + 1)} | {n - 1, n} - {0})
    prev_k, prev = 0, ""
    for k in ks:
        cur = full if k == n and full is not None else _render(tokenizer, messages[:k])
        if not cur.startswith(prev):
            at = next((i for i, (a, b) in enumerate(zip(prev, cur)) if a != b), len(cur))
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: rendering {k} messages changes the "
                f"render of the first {prev_k} at character {at} ({prev[at:at + 40]!r} became "
                f"{cur[at:at + 40]!r}), so tokens cannot be attributed to messages by diffing "
                "renders; use a template that renders earlier turns the same way, or data.format "
                "text with conversations rendered beforehand")
        prev_k, prev = k, cur


def char_labels(tokenizer, messages) -> tuple[str, np.ndarray]:
    """(the full render, a role code per character of it); module docstring, steps 1 and 2."""
    messages = list(messages)
    text = _render(tokenizer, messages)
    check_prefix_stable(tokenizer, messages, text)
    marks = [_marker(k) if m["content"] else "" for k, m in enumerate(messages)]
    skeleton = _render(tokenizer, [{**m, "content": mk} if mk else m
                                   for m, mk in zip(messages, marks)])
    labels = np.full(len(text), R.SCAFFOLD, np.int8)
    at_skel = at_text = 0
    for k, (msg, mk) in enumerate(zip(messages, marks)):
        if not mk:
            continue
        found = skeleton.find(mk, at_skel)
        gap = skeleton[at_skel:found]
        content = msg["content"]
        if (found < 0 or skeleton.find(mk, found + len(mk)) >= 0
                or not text.startswith(gap, at_text)
                or not text.startswith(content, at_text + len(gap))):
            raise ChatLabelError(
                "role_unlabelled",
                f"message {k} ({msg['role']}): the template does not copy its content verbatim "
                "between a header and a footer, so its tokens cannot be labelled exactly")
        at_text += len(gap)
        labels[at_text:at_text + len(content)] = R.CODES[msg["role"]]
        at_text += len(content)
        at_skel = found + len(mk)
    if text[at_text:] != skeleton[at_skel:]:
        last = max((k for k, mk in enumerate(marks) if mk), default=0)
        raise ChatLabelError(
            "role_unlabelled",
            f"message {last} ({messages[last]['role']}): the template's text after it depends on "
            "the content, so its tokens cannot be labelled exactly")
    return text, labels


def label_conversation(tokenizer, messages, generation_prompt: bool = False
                       ) -> tuple[list[int], np.ndarray]:
    """(token ids of the rendered conversation, role code per token); see the module docstring.

    `generation_prompt`: the render ends with the template's opening of an assistant turn
    (`add_generation_prompt=True`), the prompt of a generation (capture.generate); those
    characters are scaffolding. They must extend the plain render, as every turn must."""
    ids, labels, _ = label_conversation_capped(tokenizer, messages, None, generation_prompt)
    return ids, labels


def label_conversation_capped(tokenizer, messages, cap: "int | None",
                              generation_prompt: bool = False
                              ) -> tuple[list[int], np.ndarray, bool]:
    """label_conversation's first `cap` tokens (all for None) and whether there were more: a
    render longer than the cap is tokenised from a bounded prefix (pipeline/data/prefix.py),
    whose first `cap` tokens are the whole render's."""
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
    if cap is None:
        enc, cut = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True), False
    else:
        enc, cut = capped_encoding(tokenizer, text, cap, offsets=True)
    n = len(enc["input_ids"]) if cap is None else min(cap, len(enc["input_ids"]))
    ids = list(enc["input_ids"][:n])
    return ids, _token_labels(text, chars, enc["offset_mapping"][:n]), cut


def _token_labels(text: str, chars: np.ndarray, offsets) -> np.ndarray:
    """The label of each token: the one its characters share (step 3); a token with no
    characters of its own (none in ChatML) is template-made, scaffolding. A token whose
    characters have two labels raises ChatLabelError (`role_straddle`), naming the first."""
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    a, b = spans[:, 0], spans[:, 1]
    empty = b <= a
    out = np.full(len(spans), R.SCAFFOLD, np.int8)
    if len(chars) == 0 or empty.all():
        return out
    out[~empty] = chars[np.minimum(a[~empty], len(chars) - 1)]
    # a label change inside [a, b): the first change point after a comes before b
    changes = np.flatnonzero(chars[1:] != chars[:-1]) + 1
    nxt = np.asarray(np.searchsorted(changes, a, side="right"))
    inside = ~empty & (nxt < len(changes))
    inside[inside] = changes[nxt[inside]] < b[inside]
    if inside.any():
        i = int(np.flatnonzero(inside)[0])
        seg = chars[a[i]:b[i]]
        raise ChatLabelError(
            "role_straddle",
            f"token {i} ({text[a[i]:b[i]]!r}) spans {R.names_of(set(seg.tolist()))}: the "
            "tokenizer merged message text with template text, so the token has no single role")
    return out


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
