"""Role codes of the `role` row-metadata column, and the reader's `roles=` filter.

A chat store (data.format: chat) labels every row with the part of the conversation its token
came from. The codes are small fixed integers (int8 in the store) so a reader can filter a shard's
rows with one `np.isin`; their names are what configs (`capture.roles`) and readers (`roles=`)
use. FORMAT.md lists the same table: the codes are part of the format and never renumbered.

Only chat stores have the column. A plain-text store, and any store written before the column
existed, has no `role` array (its `harvest.row_meta` attribute does not name it): it reads as
before, and `roles=` on it is refused, because there is nothing to
filter by and silently yielding every row would train on user and scaffold tokens.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from .jsonattrs import JsonObject

# -1 (layout.META_UNWRITTEN) is the column's fill: "never written".
TEXT = 0        # a row written without roles into a store that has the column
SYSTEM, USER, ASSISTANT, TOOL = 1, 2, 3, 4
SCAFFOLD = 5    # the chat template's own tokens: <|im_start|>assistant\n, <|im_end|>, a default
                # system prompt the template injects, a BOS the packer inserts
PAD = 6         # a row after a conversation's end that fills its context (see FORMAT.md, "Chat")

CODES = {"text": TEXT, "system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL,
         "scaffold": SCAFFOLD, "pad": PAD}
NAMES = {v: k for k, v in CODES.items()}
# Message roles of a conversation, as written in a `messages` column.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# What capture.roles and roles= may name: the labels a chat row can carry, padding excluded
# (pad rows hold no token of the conversation; they are never worth storing or reading).
SELECTABLE = ("system", "user", "assistant", "tool", "scaffold")


def codes_of(names: Iterable[str], field: str = "roles") -> tuple[int, ...]:
    """Sorted codes of role names; a clear error naming `field` for anything else."""
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
        raise ValueError(f"{field}={names!r}: give a list of role names, e.g. [assistant]")
    names = list(names)
    if not names:
        raise ValueError(f"{field} is empty: name at least one of {', '.join(SELECTABLE)}")
    bad = [n for n in names if n not in SELECTABLE]
    if bad:
        raise ValueError(f"{field}: unknown role {bad[0]!r}; roles are {', '.join(SELECTABLE)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{field}={names!r} repeats a role: name each once")
    return tuple(sorted(CODES[n] for n in names))


def names_of(codes: Iterable[int]) -> list[str]:
    return [NAMES[int(c)] for c in sorted(codes)]


def store_has_roles(store) -> bool:
    """Whether the store has a `role` array (stores written before it exist and stay readable)."""
    return "role" in store.meta_columns


def captured_codes(store) -> "tuple[int, ...] | None":
    """Codes of the roles a role-masked store keeps (capture.roles), None when it keeps all."""
    captured = store_role_info(store).get("captured")
    return codes_of(captured, "capture.roles") if captured else None


def store_role_info(store) -> JsonObject:
    """The `chat` block the driver records in the run attributes: {"captured": [names] | None}.
    An empty dict for a plain-text store."""
    chat = (store.attrs or {}).get("chat")
    return chat if isinstance(chat, dict) else {}


def resolve_roles(store, roles) -> "tuple[int, ...] | None":
    """The codes a reader keeps, from its `roles=` argument and what the store recorded.

    - roles=None on a role-masked store (capture.roles) keeps the captured roles: the other
      rows hold no activations (zeros), so they must never reach a trainer by default;
    - roles=None elsewhere keeps every row (None);
    - roles on a store without the column, or on a plain-text store, is refused;
    - roles naming a role the store did not capture is refused (its rows are zeros).
    """
    captured = store_role_info(store).get("captured")
    if roles is None:
        return captured_codes(store)
    if isinstance(roles, str):
        roles = [roles]
    if not store_has_roles(store):
        raise ValueError(
            f"roles={list(roles)!r}: this store has no role column (plain text, or written "
            "before chat input existed): its rows have no roles; drop roles=")
    if not store_role_info(store):
        raise ValueError(
            f"roles={list(roles)!r}: this store holds plain text (data.format was not chat), so "
            "its rows have no roles; drop roles=")
    want = codes_of(roles, "roles")
    if captured:
        missing = sorted(set(names_of(want)) - set(captured))
        if missing:
            raise ValueError(
                f"roles={list(roles)!r}: the store kept only {captured} (capture.roles); rows of "
                f"{missing} were not stored (they hold zeros): ask for a subset of {captured}")
    return want


def role_mask(role: np.ndarray, codes: "tuple[int, ...] | None") -> "np.ndarray | None":
    """Keep-mask of rows whose role is one of `codes` (None: keep every row)."""
    if codes is None:
        return None
    return np.isin(np.asarray(role), np.asarray(codes, np.int8))
