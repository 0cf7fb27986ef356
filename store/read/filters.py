"""Which rows a reader yields: token ids, context positions, roles, a held-out split by document
hash.

Everything here depends on row metadata and row indices only (numpy, no torch), so the same
filter decides what a worker yields, what the normalisation sample holds and how many rows each
rank gets, and a trainer that recomputes it on its own gets the same answer.

The norm-outlier filter (attention sinks) depends on the activations themselves and lives in
the reader; see `normalize.sq_norms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


import numpy as np
from ..format.jsonattrs import JsonObject

SPLITS = (None, "train", "test")


def check_split(split: str | None, test_fraction: float) -> None:
    """The held-out split's two settings (ReaderConfig checks them when made; RowFilter.build too,
    for callers that build a filter directly)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use None (every row), 'train' or 'test'")
    if split is not None and not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be in (0, 1) with split={split!r}")


# ---- what the store's attributes say ------------------------------------------------------------
def _packing(attrs: dict) -> JsonObject:
    return ((attrs or {}).get("config") or {}).get("packing") or {}


def store_context_size(attrs: dict) -> int | None:
    """Context size C: rows [k*C, (k+1)*C) are one context, so a row's context position is row % C.

    Newer stores record `context_size` at the top of the run attributes; stores written before
    that carry it in the run config (`config.packing.context_size`).
    """
    c = (attrs or {}).get("context_size") or _packing(attrs).get("context_size")
    return int(c) if c else None


def store_special_ids(attrs: dict) -> list[int] | None:
    """Special token ids (BOS included) the driver recorded, or None for stores without them."""
    attrs = attrs or {}
    ids = attrs.get("special_token_ids")
    if ids is None:
        return None
    out = {int(t) for t in ids}
    if attrs.get("bos_token_id") is not None:
        out.add(int(attrs["bos_token_id"]))
    return sorted(out)


def store_facts(store) -> JsonObject:
    """The run attributes with the format facts layout v2 keeps in the `harvest` block laid over
    them (context_size, special/BOS ids, tokenizer, stats_skip_positions): one dict for every
    lookup below, so a v2 store's recorded facts win over a stale copy in the run config."""
    facts = dict(store.attrs or {})
    h = store.harvest_attrs
    for k in ("context_size", "special_token_ids", "bos_token_id", "tokenizer", "stats_skip_positions"):
        if h.get(k) not in (None, [], 0):  # create_store's defaults mean "not recorded"
            facts[k] = h[k]
    if h.get("special_token_ids"):  # the kept-stats filter is recorded whole: 0 skipped is a value
        facts["stats_skip_positions"] = int(h.get("stats_skip_positions") or 0)
    return facts


def recorded_stats_filter(attrs: dict) -> tuple[frozenset, int] | None:
    """(excluded token ids, skipped leading context positions) of the store's "kept" statistics.

    The writer's kept rows are: token_id not in the special ids and context position >= skip
    (the kept-row class the writer's statistics record). Accepted spellings: a `stats_filter` dict with `exclude_token_ids` or
    `special_token_ids` and `skip_positions` or `stats_skip_positions`; or the same keys at the
    top of the attributes. None when the store records no such filter (stores written before it).
    """
    attrs = attrs or {}
    sf = attrs.get("stats_filter")
    src = sf if isinstance(sf, dict) else attrs
    ids = src.get("exclude_token_ids", src.get("special_token_ids"))
    skip = src.get("skip_positions", src.get("stats_skip_positions"))
    if ids is None or skip is None:
        return None
    return frozenset(int(t) for t in ids), int(skip)


# Leading context positions that hold attention sinks whatever their token (FORMAT.md,
# "Statistics"): the first token a model sees carries a huge norm (SmolLM2-135M, resid_post.20:
# ||x||^2 ~ 5.6e8 at position 0 against a median of 5.5e4, with or without a BOS there; a chat
# conversation's continuation context after `overflow: split` starts with an ordinary token that
# is a sink just the same), and the second one is a sink in 1.5-2 % of contexts (a newline or a
# word, ~400x the median), which alone raised E||x||^2 of the other rows 1.2-4x. Positions 2-5:
# one row above 10x the median in 400 contexts. The pipeline's `kept` statistics leave positions
# 0 and 1 out, and so does a reader's `exclude_special=True` unless `seqpos=` says otherwise.
SINK_POSITIONS = 2


def sink_positions(facts: dict) -> int:
    """Leading context positions that hold attention sinks: the store's recorded
    `stats_skip_positions`, and never fewer than SINK_POSITIONS (stores written before the rule,
    whose `bos: none` runs recorded 0, included). `exclude_special=True` drops them by default,
    and a normalising reader that yields them is warned. 0 when the store records no context
    size."""
    if not store_context_size(facts):
        return 0
    return max(SINK_POSITIONS, int((facts or {}).get("stats_skip_positions") or 0))


# ---- the filter ---------------------------------------------------------------------------------
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mix: the same document lands in the same split on every machine and run."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def doc_in_test(doc_id: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """True for documents in the held-out split: a hash of (doc_id, seed) below `fraction`.

    By document, not by shard: a shard holds a few long documents (one package's metadata files
    filled the last shard of a real store), so a shard split is neither random nor leak-free.
    Rows with a negative doc_id (no document: an inserted BOS) are never held out.
    """
    d = np.asarray(doc_id, np.int64)
    with np.errstate(over="ignore"):
        h = _splitmix64(d.view(np.uint64) ^ _splitmix64(np.array([seed], np.int64).view(np.uint64)))
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return (u < fraction) & (d >= 0)


@dataclass(frozen=True)
class RowFilter:
    """Rows kept by metadata: not an excluded token, an allowed context position, in the split."""

    exclude: tuple[int, ...] = ()
    context_size: int | None = None
    seqpos: tuple | None = None        # (start, stop, step) of a slice over context positions
    split: str | None = None
    test_fraction: float = 0.0
    split_seed: int = 0
    roles: tuple | None = None         # role codes kept (store/format/roles.py); None: every role
    _pos_keep: np.ndarray | None = field(default=None, compare=False, repr=False)
    # a generation store: rows whose `gen` says they hold no activations (the last sampled token,
    # dropped prompts, padding; FORMAT.md "Generation") are never yielded, whatever else is asked
    generated: bool = False
    # a shuffled copy (store/shuffled_copy.py): a row's context position is its `source_row` column
    # % context_size, not its own index
    source_rows: bool = False

    @classmethod
    def build(cls, exclude: Iterable[int] = (), context_size: int | None = None, seqpos=None,
              split: str | None = None, test_fraction: float = 0.01, split_seed: int = 0,
              roles: "tuple | None" = None, generated: bool = False,
              source_rows: bool = False) -> "RowFilter":
        check_split(split, test_fraction)
        pos_keep = None
        if seqpos is not None:
            if isinstance(seqpos, int):
                seqpos = slice(seqpos, None)
            if not isinstance(seqpos, slice):
                raise ValueError(f"seqpos={seqpos!r}: give a slice of context positions, e.g. "
                                 "slice(1, None) to drop position 0")
            if not context_size:
                raise ValueError("seqpos needs the context size, and this store does not record it: "
                                 "pass context_size= (the packing.context_size of the run)")
            pos_keep = np.zeros(int(context_size), bool)
            pos_keep[seqpos] = True
            if not pos_keep.any():
                raise ValueError(f"seqpos={seqpos} keeps no position of a {context_size}-token context")
            seqpos = (seqpos.start, seqpos.stop, seqpos.step)
        return cls(tuple(sorted({int(t) for t in exclude})), int(context_size) if context_size else None,
                   seqpos, split, float(test_fraction) if split else 0.0, int(split_seed),
                   None if roles is None else tuple(sorted(int(r) for r in roles)), pos_keep,
                   bool(generated), bool(source_rows))

    @property
    def needs_tokens(self) -> bool:
        return bool(self.exclude)

    @property
    def needs_docs(self) -> bool:
        return self.split is not None

    @property
    def needs_roles(self) -> bool:
        return self.roles is not None

    @property
    def needs_source_rows(self) -> bool:
        return self.source_rows and self._pos_keep is not None

    @property
    def needs_meta(self) -> bool:
        return (self.needs_tokens or self.needs_docs or self.needs_roles or self.generated
                or self.needs_source_rows)

    def meta_names(self) -> list[str]:
        """The metadata columns `mask` needs."""
        return [n for n, need in (("token_id", self.needs_tokens), ("doc_id", self.needs_docs),
                                  ("role", self.needs_roles), ("gen", self.generated),
                                  ("source_row", self.needs_source_rows)) if need]

    def kept_positions(self) -> frozenset | None:
        """Context positions kept, or None for all of them."""
        if self._pos_keep is None:
            return None
        return frozenset(np.flatnonzero(self._pos_keep).tolist())

    def mask_of(self, a: int, b: int, cols: dict) -> np.ndarray | None:
        """`mask` from a dict of the columns `meta_names` names (others may be there too)."""
        return self.mask(a, b, cols.get("token_id"), cols.get("doc_id"), cols.get("role"),
                         cols.get("gen"), cols.get("source_row"))

    def mask(self, a: int, b: int, token_id: np.ndarray | None = None,
             doc_id: np.ndarray | None = None, role: np.ndarray | None = None,
             gen: np.ndarray | None = None, source_row: np.ndarray | None = None
             ) -> np.ndarray | None:
        """Boolean keep-mask of rows [a, b), or None when every row is kept."""
        m = None
        if self.generated:
            from ..format.layout import GEN_HAS_ACTS

            m = np.isin(gen, GEN_HAS_ACTS)
        if self._pos_keep is not None:
            if self.source_rows:
                if source_row is None:
                    raise ValueError("RowFilter.mask: this store is a shuffled copy; pass its "
                                     "source_row column (meta_names() lists it)")
                rows = np.asarray(source_row, np.int64)
            else:
                rows = np.arange(a, b, dtype=np.int64)
            p = self._pos_keep[rows % self.context_size]
            m = p if m is None else m & p
        if self.exclude:
            t = ~np.isin(token_id, np.asarray(self.exclude, np.int64))
            m = t if m is None else m & t
        if self.split is not None:
            s = doc_in_test(doc_id, self.test_fraction, self.split_seed)
            s = s if self.split == "test" else ~s
            m = s if m is None else m & s
        if self.roles is not None:
            r = np.isin(role, np.asarray(self.roles, np.int8))
            m = r if m is None else m & r
        return m

    def describe(self) -> JsonObject:
        return {"exclude_token_ids": list(self.exclude), "context_size": self.context_size,
                "seqpos": list(self.seqpos) if self.seqpos else None, "split": self.split,
                "test_fraction": self.test_fraction, "split_seed": self.split_seed,
                "roles": list(self.roles) if self.roles is not None else None,
                # only in a generation store: other descriptions stay as they were recorded
                **({"generated": True} if self.generated else {}),
                **({"source_rows": True} if self.source_rows else {})}


def matches_recorded(filt: RowFilter, recorded: tuple[frozenset, int] | None,
                     kept_roles: "tuple | None" = None) -> bool:
    """True when `filt` keeps exactly the rows of the store's recorded "kept" statistics.

    `kept_roles`: the roles the kept statistics are limited to (a role-masked store's
    capture.roles; None: every role), which the filter's roles must equal.

    The held-out split is left out of the comparison on purpose: constants describe the kept
    rows of the whole store, so train and test splits are normalised identically.
    """
    if recorded is None or filt.roles != kept_roles:
        return False
    ids, skip = recorded
    if frozenset(filt.exclude) != ids:
        return False
    pos = filt.kept_positions()
    if pos is None:
        return skip == 0
    return filt.context_size is not None and pos == frozenset(range(skip, filt.context_size))
