"""Are several stores row-aligned (the same token in the same row of each)? Checked, not trusted.

Stores captured from one corpus, packing and tokenizer with different models (the checkpoints of
`harvest schedule checkpoints`, a base model and its fine-tune) hold the same token in every row,
so a crosscoder can read row i of each as one example. Nothing but the data says so, and reading
a misaligned pair trains on mismatched rows without a word. So the pair is checked here from what
the writers committed:

- the row count, the shard size and the unit plan (each unit's row range) must be equal, and the
  same units committed in each (a unit committed in one store only has no partner rows);
- every committed unit's row-metadata digests must be equal: each commit marker carries the
  CRC32C of its unit's `token_id`, `doc_id` and `position` columns (and `role`, `gen`, `sample`
  where the store has them; `row_meta.crc32c`, FORMAT.md "Work units and commits"), computed by
  the writer from the rows it wrote. Comparing them costs no read beyond the markers a reader
  lists anyway. Where a marker lacks a column's digest (a marker written without it), that
  unit's column is read from both stores (checked against its marker's per-chunk digest) and
  compared: 4 bytes a row for `token_id`, 8 for `doc_id`, 4 for `position`, per store.

A mismatch is a `StoresNotAligned` naming the stores, the unit, the column and (read only then)
the first differing row with both values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..format import layout
from .objects import read_meta
from .records import Marker, Unit
from .tables import shard_record

# compared in every pair: what makes a row "the same token" (what `harvest schedule checkpoints`
# checks too); the optional columns are compared where both stores have them
ALIGN_COLUMNS = ("token_id", "doc_id", "position")
OPTIONAL_COLUMNS = ("role", "gen", "sample")


class StoresNotAligned(ValueError):
    """Stores given as a pair (paired reading) do not hold the same rows."""


@dataclass
class AlignmentReport:
    """What `check_aligned` compared: units by their markers' digests, units read (no digest)."""

    units: int = 0
    columns: tuple[str, ...] = ()
    by_digest: int = 0
    read_units: int = 0
    bytes_read: int = 0
    notes: list[str] = field(default_factory=list)


def _fail(names, i: int, what: str, fix: str) -> StoresNotAligned:
    return StoresNotAligned(f"stores {names[0]!r} and {names[i]!r} are not row-aligned: {what}; {fix}")


SAME_CAPTURE = ("capture them from one corpus with one packing config and tokenizer (`harvest "
                "schedule checkpoints` does), or pair stores that were")


def check_aligned(stores, names=None, markers=None) -> AlignmentReport:
    """Refuse (StoresNotAligned) unless every store holds the same rows as the first.

    `names`: how errors call the stores (default: their URLs). `markers`: per store, its
    committed units {unit_id: marker} when the caller has them (default: read here).
    """
    names = list(names or [s.url for s in stores])
    ref = stores[0]
    for i, s in enumerate(stores[1:], 1):
        for fld in ("n_rows", "shard_rows"):
            a, b = getattr(ref, fld), getattr(s, fld)
            if a != b:
                fix = SAME_CAPTURE if fld == "n_rows" else (
                    "the paired reader reads every store in one order of shards: capture them "
                    "with the same store.shard_mb (or shard_rows)")
                raise _fail(names, i, f"{fld} is {a} in the first and {b} in the second", fix)
        _same_plan(names, i, ref.ledger.plan_units(), s.ledger.plan_units())
    units = markers or [s.ledger.committed_units() for s in stores]
    first = units[0]
    for i, got in enumerate(units[1:], 1):
        for uid in sorted(set(first) ^ set(got)):
            have, lack = (0, i) if uid in first else (i, 0)
            m = units[have][uid]
            raise _fail(names, i, f"unit {uid} (rows [{m.row_start}, {m.row_end})) is "
                        f"committed in {names[have]!r} but not in {names[lack]!r}",
                        "read the stores once both runs have committed it (`harvest status`), or "
                        "finish the unfinished run")
    cols = [c for c in ALIGN_COLUMNS + OPTIONAL_COLUMNS if all(c in s.meta_columns for s in stores)]
    for c in OPTIONAL_COLUMNS:
        if any(c in s.meta_columns for s in stores) and c not in cols:
            has = [n for s, n in zip(stores, names) if c in s.meta_columns]
            raise StoresNotAligned(f"the `{c}` row column is in {has} but not in every store: "
                                   f"they are different kinds of capture; {SAME_CAPTURE}")
    rep = AlignmentReport(units=len(first), columns=tuple(cols))
    for uid in sorted(first):
        ms = [u[uid] for u in units]
        for i, m in enumerate(ms[1:], 1):
            if m.rows != ms[0].rows:
                raise _fail(names, i, f"unit {uid} is rows [{ms[0].row_start}, "
                            f"{ms[0].row_end}) in the first and [{m.row_start}, "
                            f"{m.row_end}) in the second", SAME_CAPTURE)
        digests = [m.meta_crc32c or {} for m in ms]
        read = False
        for c in cols:
            ds = [d.get(c) for d in digests]
            if all(d is not None for d in ds):
                bad = next((i for i, d in enumerate(ds) if d != ds[0]), None)
                if bad is not None:
                    _report_diff(stores, names, ms, bad, c)
                continue
            read = True   # a marker without this column's digest: compare the rows themselves
            col0 = _unit_column(stores[0], ms[0], c)
            rep.bytes_read += col0.nbytes * len(stores)
            for i in range(1, len(stores)):
                coli = _unit_column(stores[i], ms[i], c)
                if not np.array_equal(col0, coli):
                    raise _diff(names, ms[0], i, c, col0, coli)
        rep.by_digest += not read
        rep.read_units += read
    if rep.read_units:
        rep.notes.append(f"{rep.read_units} of {rep.units} units had no row-metadata digest in "
                         f"a marker and were compared by reading {rep.bytes_read} bytes")
    return rep


def _same_plan(names, i: int, a: list[Unit], b: list[Unit]) -> None:
    pa = {u.unit_id: u.rows for u in a}
    pb = {u.unit_id: u.rows for u in b}
    for uid in sorted(set(pa) | set(pb)):
        if pa.get(uid) != pb.get(uid):
            def show(r):
                return "not planned" if r is None else f"rows [{r[0]}, {r[1]})"
            raise _fail(names, i, f"the unit plans differ at unit {uid}: {show(pa.get(uid))} in "
                        f"the first, {show(pb.get(uid))} in the second", SAME_CAPTURE)


def _unit_column(st, m: Marker, name: str) -> np.ndarray:
    """Column `name` of a committed unit's rows, each chunk checked against its marker."""
    a, b = m.rows
    parts = []
    for s in range(a // st.shard_rows, -(-b // st.shard_rows)):
        parts.append(read_meta(st, m, shard_record(st, m, s), name))
    return np.concatenate(parts) if parts else np.empty(0, layout.ROW_META[name])


def _report_diff(stores, names, ms, i: int, c: str) -> None:
    """The digests differ: read the unit's column from both to name the first differing row."""
    x, y = _unit_column(stores[0], ms[0], c), _unit_column(stores[i], ms[i], c)
    if np.array_equal(x, y):
        raise StoresNotAligned(
            f"unit {ms[0]['unit_id']}'s `{c}` digest differs between {names[0]!r} and "
            f"{names[i]!r} but the rows read equal: a marker disagrees with its data; run "
            "`harvest verify --deep` on both")
    raise _diff(names, ms[0], i, c, x, y)


def _diff(names, m: Marker, i: int, c: str, x: np.ndarray, y: np.ndarray) -> StoresNotAligned:
    n = min(len(x), len(y))
    d = np.flatnonzero(x[:n] != y[:n])
    k = int(d[0]) if len(d) else n
    at = (f"first at row {m.row_start + k}: {x[k]} vs {y[k]}" if k < n else
          f"{len(x)} vs {len(y)} rows")
    return _fail(names, i, f"unit {m.unit_id} (rows [{m.row_start}, {m.row_end})) holds "
                 f"different `{c}` ({at}; {len(d)} rows differ)", SAME_CAPTURE)


__all__ = ["ALIGN_COLUMNS", "AlignmentReport", "OPTIONAL_COLUMNS", "StoresNotAligned", "check_aligned"]
