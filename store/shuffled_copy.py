"""A shuffled copy of a store: every row of the source once, in one keyed random order
(`harvest shuffle SRC DST`; FORMAT.md "Shuffled copies").

Why: the reader's window shuffle holds a few whole shards at a time, and a shard of a captured
store is a run of whole documents, so a batch can only hold the documents of its window: with a
store of k windows about 1/k of them (0.54x a uniform draw's distinct documents at SmolLM2's
layout, 0.31x at the 8B one; RESULTS.md). No reader that keeps bounded memory and reads each row
once an epoch can do better on such a store: the rows in memory are all it can draw from.
`shuffle="global"` reads the store (store / buffer) times an epoch instead. A shuffled copy pays
one pass over the rows, once, and then every shard is a uniform sample of the whole store: the
default window shuffle on it draws like a uniform shuffle (bench_shuffle measures both).

The order: source row i goes to row d(i) = Feistel(N, key)(i) of the copy (the global reader's
keyed bijection, read/shuffle/permute.py), key = (seed, "shuffle"). Each row of the copy records
its source row (`source_row`), so context positions (source_row % context_size, what `seqpos`
and the `kept` statistics use) and any link back to the source survive the move.

Scatter levels, then a gather, each reading and writing every row once; all restart where a
crash left them, because every step is a unit committed exactly once by the store's own writer:
  1. scatter: one scan feeds `group` writers at a time (as many as `memory_bytes` holds: each
     keeps one block of every point open and one in flight). With K units in the copy and
     L = ceil(log_group K) levels, unit c of level l (a spill store, the copy's layout, under
     `spill_url`/level-l) holds the rows bound for the copy's units [c g^(L-l), (c+1) g^(L-l)),
     in the order they came: level 1 from one scan of the source, each unit of level l + 1 from
     one scan of its parent unit in level l. Level L's unit b holds the copy's unit b's rows.
     A rerun writes only the units not yet committed that a copy unit still to write needs,
     starting below the deepest level that holds them all. A level is deleted once the next
     holds its rows: besides the source and the copy, at most two levels' rows are stored.
  2. gather: the copy's unit b is level L's unit b read whole, each row put at d(i) - start(b)
     in memory (one unit: one shard of every point copied), written in order and committed.
Then the copy is finalized (statistics merged from its units: the source's values, summed in
another order) and the spill stores deleted. Reads: the source once, each level once; writes:
each level and the copy once: linear in the store, L + 1 times. Memory: one unit plus the
group's writers (`memory_bytes`).

How many levels: group = memory_bytes / (2 blocks of every point copied). At the default
4 GiB, all 30 points of SmolLM2 make groups of 17-30 units (one level up to ~2 M tokens, two up
to ~60 M) and all 32 of an 8B model 16 (0.26 M, 4 M, 67 M tokens for 1-3 levels); one point
(`points=`, what an SAE of one layer needs) 256-455 and 128 (one level up to ~30 M and 2 M
tokens, two up to billions and ~270 M).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from .errors import StoreError
from .format import layout
from .format.jsonattrs import JsonObject
from .format.spec import StoreSpec

log = logging.getLogger(__name__)

KEY_TAG = 0x5A0FF1E   # the key's last word: this order is not an epoch order of the reader
DEFAULT_MEMORY = 4 << 30


def _order(n: int, seed: int):
    from .read.shuffle.permute import Feistel

    return Feistel(n, (int(seed), KEY_TAG))


def _spec_of(src, n_rows: int, unit_rows: int, points: list) -> StoreSpec:
    """The spec of a store laid out as `src` holding `points`, with a source_row column."""
    cols = src.meta_columns
    return StoreSpec(points=tuple(points), width=src.width, widths={p: src.widths[p] for p in points},
                values={p: t for p, t in src.point_values.items() if p in points},
                n_rows=n_rows,
                shard_rows=src.shard_rows, chunk_rows=src.chunk_rows, dtype=src.dtype,
                compression=src.compression, meta_chunk_rows=unit_rows,
                context_size=src.context_size, special_token_ids=tuple(src.special_token_ids),
                bos_token_id=src.bos_token_id, tokenizer=src.tokenizer,
                stats_skip_positions=src.stats_skip_positions, roles="role" in cols,
                generated="gen" in cols, samples="sample" in cols, source_rows=True,
                logprob="logprob" in cols, entropy="entropy" in cols)


def _open_or_create(url: str, storage_options, src, n: int, unit_rows: int, facts: dict,
                    what: str, points: list, create: bool = True):
    """The copy or a spill level: an existing one must be this very shuffle's; None where there
    is none and not `create`."""
    from .store import open_store
    from .write.create import create_store

    try:
        st = open_store(url, storage_options=storage_options)
    except (StoreError, FileNotFoundError):
        st = None
    if st is not None:
        got = (st.attrs or {}).get("shuffled")
        if got != facts:
            fix = ("rerun with the --memory-gb and --points it was started with, or give --spill "
                   "a new place" if what == "spill" else "give the copy a new place")
            raise StoreError(f"shuffle: {url} already holds a store that is not this shuffle's "
                             f"{what} (it records {got!r}, this shuffle is {facts!r}): {fix}")
    elif not create:
        return None
    else:
        st = create_store(url, attrs={**(src.attrs or {}), "shuffled": facts},
                          storage_options=storage_options, spec=_spec_of(src, n, unit_rows, points))
    if not st.ledger.plan():   # new, or a crash came between create_store and its plan
        st.ledger.write_plan([{"unit_id": b, "row_start": a, "row_end": min(n, a + unit_rows)}
                              for b, a in enumerate(range(0, n, unit_rows))])
    return st


def _read_rows(st, a: int, b: int, into) -> "tuple[np.ndarray, dict]":
    """Rows [a, b) of the points of store `into` (the spill or the copy), [points, n, its
    row_width] in the raw dtype (a narrower point in its first columns), and every metadata
    column of `st`; shard by shard, each checked."""
    from .read.checked_rows import read_meta_checked

    acts = np.zeros((len(into.points), b - a, into.row_width), st.np_dtype)
    for s in range(a // st.shard_rows, -(-b // st.shard_rows)):
        s0, s1 = st.shard_range(s)
        lo, hi = max(a, s0), min(b, s1)
        for p, point in enumerate(into.points):
            x = st.read_shard(point, s)
            acts[p, lo - a:hi - a, :x.shape[1]] = x[lo - s0:hi - s0]
    cols = {n: read_meta_checked(st, n, a, b) for n in st.meta_columns}
    return acts, cols


def _write_unit(w, a: int, acts: np.ndarray, cols: dict) -> None:
    """Every row of a unit, metadata first, in block-sized pieces (the writer's own order)."""
    meta = {k: v for k, v in cols.items() if k not in ("token_id", "doc_id", "position")
            and k not in layout.SCORE_META}
    w.write_meta(a, cols["token_id"], cols["doc_id"], cols["position"], **meta)
    scores = {k: v for k, v in cols.items() if k in layout.SCORE_META}
    if scores:
        w.write_scores(a, **scores)
    n = acts.shape[1]
    for r in range(0, n, w.block_rows):
        w.write(a + r, acts[:, r:r + w.block_rows])


def shuffle_store(src_url: str, dst_url: str, *, seed: int = 0, spill_url: "str | None" = None,
                  storage_options: "dict | None" = None, memory_bytes: int = DEFAULT_MEMORY,
                  points: "list[str] | None" = None,
                  progress: "Callable[[str], None] | None" = None) -> JsonObject:
    """Write a shuffled copy of the finished store at `src_url` to `dst_url` (see the module
    doc); rerun with the same arguments after a crash to finish it (a spill level written with
    another `memory_bytes`, hence other unit sizes, is refused by name). Returns a summary:
    rows, units, levels, units a scan feeds, scans (of the source and the levels), seconds of
    the scatter and the gather. `spill_url`: the scatter pass's store
    (default: `dst_url` + ".spill", deleted at the end). `points`: copy only these (an SAE
    trains on one layer: a copy of one point is 1/points of the bytes, and its scatter
    writers hold one point's blocks, so one scan of the source feeds ~points x more units)."""
    from .store import open_store

    say = progress or log.info
    src = open_store(src_url, storage_options=storage_options, read_only=True)
    if "source_row" in src.meta_columns:
        raise StoreError(f"shuffle: {src_url} is already a shuffled copy (it has a source_row "
                         "column); shuffle the store it was made from")
    v = src.verify()
    damage = [e for e in v.errors if "planned units are not committed" not in e]
    if damage:
        raise StoreError(f"shuffle: {src_url} fails verification: {'; '.join(damage[:3])} "
                         f"(`harvest verify {src_url}` lists all)")
    if not v.complete or v.committed_rows != src.n_rows:
        raise StoreError(f"shuffle: {src_url} is not a finished store ({v.committed_rows:,} of "
                         f"{src.n_rows:,} rows committed, {len(v.missing_units)} planned units "
                         "missing): finish its run first (harvest run resumes it)")
    n, U = src.n_rows, src.shard_rows
    if n == 0:
        raise StoreError(f"shuffle: {src_url} holds no rows")
    points = list(src.points) if points is None else list(points)
    unknown = [p for p in points if p not in src.points]
    if unknown or not points or len(set(points)) != len(points):
        raise StoreError(f"shuffle: points {points} must name each of some of {src_url}'s points "
                         f"once ({', '.join(src.points)}){'; not there: ' + ', '.join(unknown) if unknown else ''}")
    facts = {"source": src.url, "seed": int(seed), "rows": int(n), "order": "feistel-4",
             "key_tag": KEY_TAG, "points": points}
    spill_url = spill_url or dst_url.rstrip("/") + ".spill"
    dst = _open_or_create(dst_url, storage_options, src, n, U, facts, "copy", points)
    if dst.summary is not None:   # a crash after finalize may have left the spill behind
        _delete_store(spill_url, storage_options)
        say(f"shuffle: {dst_url} is already finished")
        return {"rows": n, "units": -(-n // U), "already_finished": True}
    order = _order(n, seed)
    K = -(-n // U)
    group = max(2, int(memory_bytes // max(1, _writer_bytes(dst))))
    L = _levels(K, group)
    out = {"rows": n, "units": K, "levels": L, "units_per_scan": group, "scans": 0,
           "scatter_s": 0.0, "gather_s": 0.0}
    todo = [b for b in range(K) if not dst.ledger.is_committed(b)]
    if todo:
        t = time.perf_counter()
        # level l (1..L) has units of U * group^(L - l) rows: unit c of level l holds the rows
        # bound for the copy's units [c * group^(L-l), (c+1) * group^(L-l)), in the order they
        # came; level L's units are the copy's. Level 1 is fed by one scan of the source, each
        # unit of level l by one scan of its parent in level l - 1.
        sizes = {level: U * group ** (L - level) for level in range(1, L + 1)}
        want = {level: sorted({b * U // sizes[level] for b in todo}) for level in sizes}

        def level_store(level: int, create: bool = True):
            return _open_or_create(f"{spill_url.rstrip('/')}/level-{level}", storage_options, src,
                                   n, sizes[level],
                                   {**facts, "level": level, "unit_rows": sizes[level]}, "spill",
                                   points, create)

        # a rerun starts below the deepest level that already holds every unit still needed
        # (the levels above it may be deleted already)
        first = 1
        for level in range(L, 0, -1):
            st = level_store(level, create=False)
            if st is not None and all(st.ledger.is_committed(c) for c in want[level]):
                first = level + 1
                break
        parent = src if first == 1 else level_store(first - 1)
        parent_rows = n if first == 1 else sizes[first - 1]
        for level in range(first, L + 1):
            size = sizes[level]
            st = level_store(level)
            by_parent: dict = {}
            for c in want[level]:
                if not st.ledger.is_committed(c):
                    by_parent.setdefault(c * size // parent_rows, []).append(c)
            for q, children in sorted(by_parent.items()):
                a = q * parent_rows
                _scatter(parent, a, min(n, a + parent_rows), st, order, size, children, say)
                out["scans"] += 1
            if parent is not src:   # its rows are all in this level now: free the space
                _delete_store(parent.url, storage_options)
            parent, parent_rows = st, size
        out["scatter_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        for b in todo:
            _gather(parent, dst, order, U, b)
            say(f"shuffle: unit {b + 1} of {K} written")
        out["gather_s"] = round(time.perf_counter() - t, 3)
    dst.finalize({"shuffled": facts})
    _delete_store(spill_url, storage_options)
    say(f"shuffle: {dst_url}: {n:,} rows in {K} units, finished")
    return out


def _levels(units: int, group: int) -> int:
    """Scatter levels for `units` of the copy when one scan feeds `group` writers: the
    smallest L with group^L >= units (at least 1)."""
    L, reach = 1, group
    while reach < units:
        L, reach = L + 1, reach * group
    return L


def _writer_bytes(st) -> int:
    """What one scatter writer holds at most: its open block and the one in flight, of every
    point (67.5 MiB a block at SmolLM2's 30 points, 128 MiB at an 8B model's 32)."""
    from .format import layout

    br = layout.block_rows(st.shard_rows, st.chunk_rows, len(st.points), st.row_bytes,
                           st.context_size)
    return 2 * br * st.row_set_bytes


def _scatter(inp, a: int, e: int, out, order, size: int, children: list, say) -> None:
    """One scan of rows [a, e) of `inp` (the source, or a spill level) feeding the writers of
    `out`'s units `children` (of `size` rows each): each gets, in the order they come, the rows
    whose place in the copy lies in its range."""
    n = out.n_rows
    writers = {c: out.region_writer(c, c * size, min(n, (c + 1) * size), upload_threads=1,
                                    max_open_shards=1, max_pending_shards=1)
               for c in children}   # rows reach each writer in order: one block open, one in flight
    cursor = {c: c * size for c in children}
    try:
        for s in range(a // inp.shard_rows, -(-e // inp.shard_rows)):
            s0, s1 = inp.shard_range(s)
            s0, s1 = max(a, s0), min(e, s1)
            acts, cols = _read_rows(inp, s0, s1, out)
            if "source_row" not in cols:   # the source itself
                cols["source_row"] = np.arange(s0, s1, dtype=np.int64)
            bucket = order(cols["source_row"]) // size
            for c in np.unique(bucket).tolist():
                if c not in writers:   # committed, or every copy unit it feeds is (a rerun)
                    continue
                idx = np.flatnonzero(bucket == c)
                _write_unit(writers[c], cursor[c], acts[:, idx], {k: v[idx] for k, v in cols.items()})
                cursor[c] += idx.size
        for w in writers.values():
            w.commit()
        say(f"shuffle: {len(children)} units of {out.url} scattered from rows [{a}, {e})")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def _gather(spill, dst, order, U: int, b: int) -> None:
    """The copy's unit b: the last spill level's unit b, each row at its place."""
    n = dst.n_rows
    a, e = b * U, min(n, (b + 1) * U)
    acts, cols = _read_rows(spill, a, e, dst)
    at = order(cols["source_row"]) - a
    if at.min() < 0 or at.max() >= e - a or np.unique(at).size != e - a:
        raise StoreError(f"shuffle: spill unit {b} of {spill.url} does not hold exactly the rows of "
                         "the copy's unit: run again with --spill at a new place")
    place = np.empty_like(at)
    place[at] = np.arange(e - a)
    for p in range(acts.shape[0]):   # point by point: the unit plus one point's rows in memory
        acts[p] = acts[p, place]
    w = dst.region_writer(b, a, e)
    try:
        _write_unit(w, a, acts, {k: v[place] for k, v in cols.items()})
        w.commit()
    except BaseException:
        w.abort()
        raise


def _delete_store(url: str, storage_options) -> None:
    from .storage.locate import locate

    loc = locate(url, storage_options)
    loc.delete_tree("")
    loc.remove_empty_dirs([], root=True)


__all__ = ["shuffle_store"]
