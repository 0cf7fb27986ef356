"""What an ActivationDataset reads and how: one validated dataclass, every option checked here
once (not here and there in the dataset's constructor).

`ActivationDataset(store, config=ReaderConfig(...))` is the explicit form; the keyword form
`ActivationDataset(store, points, batch_size=..., seed=...)` that trainers, examples and docs use
builds the same config (`build`), so there is one list of options and one place that checks them.
Everything that can be checked without the store is checked when the config is made, with an error
that names the field and the fix; what needs the store (are the points in it, does it record the
special tokens or the context size) is checked by the dataset that opens it.

No torch here (annotations only), so a config can be built, validated and pickled where torch is
not imported.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .filters import check_split
from ..keywordconfig import config_from

if TYPE_CHECKING:
    import torch

    from .normalize import NormConstants

NORMALIZE_MODES = (None, "standardize", "norm_scale", "center_norm_scale")


@dataclass(frozen=True)
class ReaderConfig:
    """The options of ActivationDataset, grouped by what they decide.

    What is read:
        points: a point name -> 2-D batches; a list -> 3-D batches in that order; None -> all
            points (2-D if the store has one).
        batch_size: rows per batch; each worker's last batch of an epoch may be short unless
            drop_last (never in endless mode: batches run on into the next epoch).
        return_meta: yield dicts {acts, row, token_id, doc_id, position} (and gen in a
            generation store, sample in one of n > 1 samples per prompt, float32 logprob and
            entropy in a store that captured them) instead of tensors.
        out_dtype: torch dtype of acts (default: store dtype, float32 when normalizing or
            dequantising an fp8 store).
        dequantize: an fp8 store's rows as values (default). False hands the stored form to a
            GPU trainer, so the host never expands it: acts are `torch.float8_e4m3fn`
            `[batch, (points,) width]` with `scale`, float32 `[batch, (points)]` beside them
            (a tuple `(acts, scale)`, or the `scale` key with return_meta); values are
            `acts.float() * scale[..., None]` (on the GPU: `fp8.to(device)` first). Refused
            with normalize= (apply the constants after dequantising on the device).
    Order:
        shuffle, seed: True (or "window"): shards in a seeded order, rows permuted within windows
            of shuffle_buffer_rows; "global": every kept row of the store in one keyed permutation
            per epoch (permute.py: exact, 1.0x a uniform shuffle's documents per batch, but each
            block of shuffle_buffer_rows rows reads every shard holding one of its rows, about
            store / buffer times the window shuffle's reads); False: row order. Either order is
            reproducible from (seed, epoch). `describe()` says how well the choice mixes.
        shuffle_buffer_rows: rows in one shuffle window, rounded up to whole shards (default 1 GiB
            worth per process); every batch is a uniform draw from its window, mixed across its
            shards. Memory: up to two windows per process (the next one decodes meanwhile).
        epoch: the epoch the first iteration reads (then `set_epoch`).
    Sharding:
        rank, world_size: default from torch.distributed, else RANK/WORLD_SIZE, else 0/1.
    Rows kept:
        exclude_token_ids: rows whose token_id is in this set are dropped.
        exclude_special: also drop the special token ids (BOS included) the store records, and,
            unless `seqpos` is given, the leading context positions that hold attention sinks
            (the store's `stats_skip_positions`, at least 2; FORMAT.md "Statistics"): the
            store's kept rows, which its kept statistics describe exactly.
        seqpos: slice of context positions kept (context position = row % context_size), e.g.
            slice(2, None) drops each context's first two tokens; `context_size` from the
            store's attributes, or this option for stores that lack it. Given, it decides the
            positions alone (exclude_special then drops token ids only).
        max_norm_ratio: drop rows whose norm exceeds this multiple of the median row norm (per
            point, median from the start-up sample; a row goes if any point exceeds): attention
            sinks that are not special tokens (SmolLM2: ~100 rows at positions 1-5).
        split, test_fraction, split_seed: None (all rows), "train" or "test": a held-out split by
            a hash of doc_id, `test_fraction` of the documents in "test".
        roles: chat stores only: role names kept, e.g. ["assistant"] (store/format/roles.py). A
            role-masked store (capture.roles) yields its stored roles by default and refuses
            others; a store without roles refuses roles= (FORMAT.md, "Chat").
    Normalisation:
        normalize: None | "standardize" ((x-mean)/std per dim) | "norm_scale" (E||x||^2 = width)
            | "center_norm_scale" (subtract mean, then E||x-mean||^2 = width), over the rows
            this dataset yields, with statistics of exactly those rows: the store's kept-row
            statistics when the filters select that class (exact; `split=` aside: train and
            test share the whole class's constants), else a seeded start-up sample of
            `norm_sample_rows` of the filtered rows (exact when there are no more). A reader
            that yields the attention-sink positions is normalised over them too, with a
            warning. `norm_constants` shows which; pass a train split's constants as
            `norm_constants=` to normalise its held-out split identically.
        eps: added to the variance before dividing by its root (standardize).
    Length:
        endless, steps: endless=True runs epoch after epoch; steps=N stops after N batches per
            rank (spread over its DataLoader workers), crossing epochs as needed.
    Follow (a store a run is writing; follow.py):
        follow: yield each unit's rows once as units commit, and end when the run finalizes the
            store (raise when it ends unfinished or its driver's lease goes stale). Global worker
            g of ranks x DataLoader workers reads the units with unit_id % (ranks x workers) == g.
            One pass (no endless=), no max_norm_ratio= (it needs the whole store's sample).
        follow_timeout: seconds to wait for the next unit before FollowTimeout, whose message
            names the run's state (None: as long as the driver's lease is fresh).
        follow_poll: seconds between looks at the store while waiting.
    I/O:
        prefetch_shards, io_threads: concurrent fetch+decode tasks (default 2 x prefetch_shards).

    Frozen: derive a variant with `dataclasses.replace(cfg, seed=1)`.
    """

    points: "str | tuple[str, ...] | None" = None
    batch_size: int = 4096
    shuffle: "bool | str" = True
    seed: int = 0
    shuffle_buffer_rows: int | None = None
    rank: int | None = None
    world_size: int | None = None
    exclude_token_ids: tuple[int, ...] = ()
    exclude_special: bool = False
    seqpos: slice | None = None
    context_size: int | None = None
    max_norm_ratio: float | None = None
    split: str | None = None
    test_fraction: float = 0.01
    split_seed: int = 0
    roles: "tuple[str, ...] | None" = None
    normalize: str | None = None
    norm_constants: "NormConstants | None" = None
    norm_sample_rows: int = 1 << 16
    eps: float = 1e-6
    endless: bool = False
    steps: int | None = None
    prefetch_shards: int = 4
    io_threads: int | None = None
    drop_last: bool = False
    return_meta: bool = False
    out_dtype: "torch.dtype | None" = None
    epoch: int = 0
    dequantize: bool = True
    follow: bool = False
    follow_timeout: float | None = None
    follow_poll: float = 1.0

    def __post_init__(self):
        set_ = object.__setattr__   # frozen: normalise the containers once, here
        if self.points is not None and not isinstance(self.points, str):
            set_(self, "points", tuple(str(p) for p in self.points))
        set_(self, "exclude_token_ids", tuple(int(t) for t in self.exclude_token_ids))
        if isinstance(self.roles, str):
            raise ValueError(f"roles={self.roles!r}: give a list of role names, e.g. [{self.roles!r}]")
        if self.roles is not None:
            set_(self, "roles", tuple(self.roles))
        for name, unit, optional in (("batch_size", "rows", False), ("norm_sample_rows", "rows", False),
                                     ("prefetch_shards", "shards", False), ("steps", "batches", True),
                                     ("io_threads", "threads", True), ("context_size", "tokens", True),
                                     ("shuffle_buffer_rows", "rows", True)):
            set_(self, name, _count(name, getattr(self, name), unit, optional))
        if self.shuffle not in (True, False, "window", "global"):
            raise ValueError(f"shuffle={self.shuffle!r}: use True (= 'window'), False, or 'global' "
                             "(a permutation of every kept row; reads more, see permute.py)")
        if self.shuffle == "window":
            set_(self, "shuffle", True)
        if self.shuffle == "global" and self.max_norm_ratio is not None:
            raise ValueError("max_norm_ratio= with shuffle='global': the norm filter drops rows only "
                             "known once read, which a fixed permutation of the kept rows cannot "
                             "absorb; use shuffle=True (window) or drop max_norm_ratio")
        if self.shuffle_buffer_rows is not None and self.shuffle_buffer_rows < self.batch_size:
            raise ValueError(f"shuffle_buffer_rows={self.shuffle_buffer_rows} must be >= batch_size="
                             f"{self.batch_size}: a batch is drawn from one window")
        if self.normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize={self.normalize!r}: use one of {NORMALIZE_MODES}")
        if self.norm_constants is not None and not self.normalize:
            raise ValueError("norm_constants= given without normalize=; pass normalize=given.mode")
        if self.max_norm_ratio is not None and not self.max_norm_ratio > 1:
            raise ValueError(f"max_norm_ratio={self.max_norm_ratio!r} must be > 1 (a multiple of the "
                             "median norm), or None")
        if not self.eps >= 0:
            raise ValueError(f"eps={self.eps!r} must be >= 0 (added to the variance before dividing)")
        check_split(self.split, self.test_fraction)
        if not isinstance(self.dequantize, bool):
            raise ValueError(f"dequantize={self.dequantize!r} must be True or False")
        if not self.dequantize and (self.normalize or self.out_dtype is not None):
            raise ValueError("dequantize=False yields the stored fp8 rows and their scales: "
                             "normalize= and out_dtype= need values; leave them out and apply "
                             "them after `acts.float() * scale[..., None]` on the device")
        _check_follow(self)

    @classmethod
    def build(cls, config: "ReaderConfig | None" = None, **options) -> "ReaderConfig":
        """`config` as given, or one made of keyword `options` (keywordconfig.config_from)."""
        return config_from(cls, config, options, "config")


def _check_follow(c: "ReaderConfig") -> None:
    if not isinstance(c.follow, bool):
        raise ValueError(f"follow={c.follow!r} must be True or False")
    for name, v, optional in (("follow_timeout", c.follow_timeout, True), ("follow_poll", c.follow_poll, False)):
        if (v is None and optional) or (isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0):
            continue
        raise ValueError(f"{name}={v!r} must be a number of seconds > 0" + (", or None" if optional else ""))
    if c.follow and c.endless:
        raise ValueError("follow=True reads a store once, as its units commit, and ends when the run "
                         "finalizes it: drop endless=True (read the finished store again for more epochs)")
    if c.follow and c.max_norm_ratio is not None:
        raise ValueError("follow=True with max_norm_ratio=: the norm filter's median comes from a "
                         "sample of the whole store, which a follower does not have; drop "
                         "max_norm_ratio, or filter after the run")


def _count(name: str, v, unit: str, optional: bool) -> int | None:
    """A positive int (numpy ints too: sizes often come from arithmetic on arrays), as int."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive number of {unit}"
                         + (", or None" if optional else ""))
    return int(v)


__all__ = ["NORMALIZE_MODES", "ReaderConfig"]
