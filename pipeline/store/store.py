"""The store object: create/open, driver-side metadata, commit bookkeeping, finalize and verify.

Division of labour that keeps many writers safe without locks: the driver creates every array
pre-sized and is the only process that ever writes a `zarr.json`; writers only put whole shard
objects inside their own shard-aligned region and then one create-once commit marker. Anything
not covered by a commit marker is, by definition, not data.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import zarr

from . import compression as _compression
from . import layout
from . import stats as _stats
from .backend import Location, locate, with_retries
from .credentials import redact_attrs
from .dtypes import dtype_name, resolve_dtype, zarr_dtype
from .errors import NotAHarvestStore, StoreError, UnknownLayoutVersion

log = logging.getLogger(__name__)

_MARKER_NAME = re.compile(r"^unit-(\d{8})\.json$")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _json_default(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "__fspath__"):
        return str(o)
    raise TypeError(f"attribute value of type {type(o).__name__} is not JSON serialisable: {o!r}")


def _jsonable(obj: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(obj, default=_json_default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable: {e}") from None


def _versions() -> dict:
    import ml_dtypes
    import numcodecs

    return {"zarr": zarr.__version__, "numcodecs": numcodecs.__version__,
            "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__}


@dataclass(frozen=True)
class Unit:
    unit_id: int
    row_start: int
    row_end: int

    def as_dict(self) -> dict:
        return {"unit_id": self.unit_id, "row_start": self.row_start, "row_end": self.row_end}


class Store:
    """An opened harvest activation store. Build with create_store / open_store."""

    def __init__(self, loc: Location, meta: dict, read_only: bool = False):
        self._loc = loc
        self._meta = meta
        h = meta["attributes"]["harvest"]
        self._h = h
        self.points: list[str] = list(h["points"])
        self.width: int = int(h["width"])
        self.n_rows: int = int(h["n_rows"])
        self.shard_rows: int = int(h["shard_rows"])
        self.chunk_rows: int = int(h["chunk_rows"])
        self.dtype: str = h["dtype"]
        self.np_dtype: np.dtype = resolve_dtype(self.dtype)
        self.compression: dict = h["compression"]
        self.layout_version: int = int(h["layout_version"])
        self.read_only = read_only
        self._zstore_obj = None
        self._arrays: dict[str, zarr.Array] = {}
        self._markers: dict[int, dict] = {}   # create-once objects never change: safe to cache

    @property
    def _zstore(self):
        """zarr's store object, made on first use: the writer and reader move whole shards
        themselves, and an idle async S3 client only adds a loop-bound session to clean up."""
        if self._zstore_obj is None:
            self._zstore_obj = self._loc.zarr_store(read_only=self.read_only)
        return self._zstore_obj

    # ---- description -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._loc.url

    @property
    def location(self) -> Location:
        return self._loc

    @property
    def attrs(self) -> dict:
        """The run attributes given to create_store (model, dataset, tokenizer, config...)."""
        return self._meta["attributes"].get("run", {})

    @property
    def summary(self) -> dict | None:
        return self._meta["attributes"].get("summary")

    @property
    def n_shards(self) -> int:
        return -(-self.n_rows // self.shard_rows)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of one point, uncompressed."""
        return self.width * self.np_dtype.itemsize

    def shard_range(self, shard: int) -> tuple[int, int]:
        s = shard * self.shard_rows
        return s, min(self.n_rows, s + self.shard_rows)

    def __repr__(self) -> str:
        return (f"Store({self.url!r}, points={len(self.points)}, width={self.width}, "
                f"n_rows={self.n_rows}, dtype={self.dtype})")

    def info(self) -> dict:
        """What a user inspecting a store wants: shape, progress, stats, attrs."""
        committed = self.committed_units()
        rows = sum(m["row_end"] - m["row_start"] for m in committed.values())
        return {
            "url": self.url, "layout_version": self.layout_version, "points": self.points,
            "width": self.width, "n_rows": self.n_rows, "dtype": self.dtype,
            "shard_rows": self.shard_rows, "chunk_rows": self.chunk_rows,
            "compression": self.compression, "committed_units": len(committed),
            "committed_rows": rows, "committed_fraction": rows / self.n_rows if self.n_rows else 0.0,
            "planned_units": len(self.plan()), "finalized": self.summary is not None,
            "stats": self._meta["attributes"].get("stats"),
            "compression_ratio": self._meta["attributes"].get("compression_ratio"),
            "attrs": self.attrs,
        }

    # ---- arrays ------------------------------------------------------------------------------
    def array(self, point: str) -> zarr.Array:
        if point not in self.points:
            raise KeyError(f"point {point!r} is not in this store: it holds {', '.join(self.points)}")
        arr = self._arrays.get(point)
        if arr is None:
            arr = self._open_array(layout.point_path(point))
            self._arrays[point] = arr
        return arr

    def _open_array(self, path: str) -> zarr.Array:
        try:
            return zarr.open_array(store=self._zstore, path=path,
                                   mode="r" if self.read_only else "r+", zarr_format=3)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 -- translated without secrets
            raise self._loc.error(f"opening array {path}", e) from None

    def shard_codec(self, point: str):
        """Our direct whole-shard codec for `point`, or None where zarr must do the work."""
        from .shardio import ShardCodec, Unsupported

        key = ("codec", point)
        if key not in self._arrays:
            raw = self._loc.read_bytes(f"{layout.point_path(point)}/zarr.json")
            try:
                self._arrays[key] = ShardCodec(json.loads(raw), self.np_dtype) if raw else None
            except Unsupported as e:
                log.info("%s: zarr does the (de)coding (%s)", point, e)
                self._arrays[key] = None
        return self._arrays[key]

    def shard_key(self, point: str, shard: int) -> str:
        return f"{layout.point_path(point)}/c/{int(shard)}/0"

    def read_shard(self, point: str, shard: int, out: np.ndarray | None = None) -> np.ndarray:
        """All rows of one shard of one point: one GET and a direct decode when possible.

        `out`: optional destination rows (see ShardCodec.decode); the result is then `out`.
        """
        codec = self.shard_codec(point)
        if codec is None:
            rows = self.array(point)[slice(*self.shard_range(shard))]
            if out is None:
                return rows
            out[...] = rows.view(out.dtype)
            return out
        blob = self._loc.read_bytes(self.shard_key(point, shard))
        if blob is None:
            if out is None:
                return np.zeros((codec.shard_len(shard), self.width), self.np_dtype)
            out[...] = 0
            return out
        return codec.decode(blob, shard, out=out)

    def read(self, point: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one point, as stored (no commit check: see reader for that)."""
        return self.array(point)[start:stop]

    # ---- row metadata (driver) ----------------------------------------------------------------
    def write_row_meta(self, start: int, token_id, doc_id, position) -> None:
        cols = {"token_id": token_id, "doc_id": doc_id, "position": position}
        arrs = {}
        n = None
        for name, v in cols.items():
            a = np.asarray(v)
            if a.ndim != 1:
                raise ValueError(f"write_row_meta: {name} must be 1-D, got shape {a.shape}")
            if a.dtype.kind not in "iu":
                raise ValueError(f"write_row_meta: {name} must hold integers, got dtype {a.dtype}")
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ValueError(f"write_row_meta: token_id, doc_id and position must have the same "
                                 f"length, got {n} and {a.shape[0]} for {name}")
            arrs[name] = a.astype(layout.ROW_META[name])
        if not (0 <= start and start + n <= self.n_rows):
            raise ValueError(f"write_row_meta: rows [{start}, {start + n}) fall outside the store's "
                             f"0..{self.n_rows}")
        for name, a in arrs.items():
            arr = self._meta_array(name)
            with_retries(lambda arr=arr, a=a: arr.__setitem__(slice(start, start + n), a),
                         f"write {name}")

    def _meta_array(self, name: str) -> zarr.Array:
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = self._open_array(name)
        return arr

    def read_row_meta(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not 0 <= start <= stop <= self.n_rows:
            raise ValueError(f"read_row_meta: [{start}, {stop}) is outside 0..{self.n_rows}")
        return tuple(self._meta_array(n)[start:stop] for n in ("token_id", "doc_id", "position"))

    # ---- plan (driver) ----------------------------------------------------------------------
    def default_plan(self, shards_per_unit: int = 1) -> list[dict]:
        """Units of `shards_per_unit` consecutive shards covering every row."""
        if shards_per_unit < 1:
            raise ValueError("shards_per_unit must be >= 1")
        step = shards_per_unit * self.shard_rows
        return [{"unit_id": i, "row_start": s, "row_end": min(self.n_rows, s + step)}
                for i, s in enumerate(range(0, self.n_rows, step))]

    def _check_region(self, row_start: int, row_end: int, what: str) -> None:
        if not (0 <= row_start < row_end <= self.n_rows):
            raise ValueError(f"{what}: rows [{row_start}, {row_end}) must satisfy "
                             f"0 <= row_start < row_end <= n_rows={self.n_rows}")
        if row_start % self.shard_rows or (row_end % self.shard_rows and row_end != self.n_rows):
            raise ValueError(
                f"{what}: rows [{row_start}, {row_end}) are not shard-aligned: row_start and row_end "
                f"must be multiples of shard_rows={self.shard_rows} (row_end may be n_rows="
                f"{self.n_rows}); two writers sharing a shard would overwrite each other")

    def write_plan(self, units: Iterable) -> list[dict]:
        """Record the work units (driver, before work starts). Returns the normalized plan."""
        if self.read_only:
            raise StoreError("write_plan: store was opened read-only")
        out: list[Unit] = []
        for u in units:
            if isinstance(u, dict):
                try:
                    u = Unit(int(u["unit_id"]), int(u["row_start"]), int(u["row_end"]))
                except KeyError as e:
                    raise ValueError(f"write_plan: unit {u!r} lacks field {e}; "
                                     "give unit_id, row_start, row_end") from None
            elif not isinstance(u, Unit):
                u = Unit(*(int(x) for x in u))
            self._check_region(u.row_start, u.row_end, f"write_plan unit {u.unit_id}")
            out.append(u)
        ids = [u.unit_id for u in out]
        if len(set(ids)) != len(ids):
            raise ValueError("write_plan: unit_id values must be unique")
        ordered = sorted(out, key=lambda u: u.row_start)
        for a, b in zip(ordered, ordered[1:]):
            if b.row_start < a.row_end:
                raise ValueError(f"write_plan: units {a.unit_id} and {b.unit_id} overlap "
                                 f"([{a.row_start},{a.row_end}) and [{b.row_start},{b.row_end}))")
        plan = [u.as_dict() for u in sorted(out, key=lambda u: u.unit_id)]
        self._loc.write_bytes(layout.PLAN_KEY, json.dumps({"units": plan}).encode())
        return plan

    def plan(self) -> list[dict]:
        raw = self._loc.read_bytes(layout.PLAN_KEY)
        return json.loads(raw)["units"] if raw else []

    # ---- writers and commits ----------------------------------------------------------------
    def region_writer(self, unit_id: int, row_start: int, row_end: int, **kwargs):
        """A streaming writer for one shard-aligned region; see writer.RegionWriter for knobs."""
        from .writer import RegionWriter

        if self.read_only:
            raise StoreError("region_writer: store was opened read-only")
        self._check_region(row_start, row_end, f"region_writer unit {unit_id}")
        for u in self.plan():
            if u["unit_id"] == unit_id and (u["row_start"], u["row_end"]) != (row_start, row_end):
                raise ValueError(f"region_writer: unit {unit_id} is planned as rows "
                                 f"[{u['row_start']}, {u['row_end']}), not [{row_start}, {row_end})")
        return RegionWriter(self, int(unit_id), int(row_start), int(row_end), **kwargs)

    def commit_manifest(self, unit_id: int, fresh: bool = False) -> dict | None:
        unit_id = int(unit_id)
        if unit_id in self._markers and not fresh:
            return self._markers[unit_id]
        key = layout.commit_key(unit_id)
        if fresh and not self._loc.is_local:
            self._loc.fs.invalidate_cache(self._loc.key(key))
        raw = self._loc.read_bytes(key)
        if raw is None:
            return None
        m = json.loads(raw)
        self._markers[unit_id] = m
        return m

    def is_committed(self, unit_id: int) -> bool:
        return self.commit_manifest(unit_id, fresh=True) is not None

    def committed_units(self) -> dict[int, dict]:
        """unit_id -> commit manifest, for every unit whose marker exists now."""
        ids = []
        for name in self._loc.list_dir(layout.COMMITS_DIR):
            m = _MARKER_NAME.match(name)
            if m:
                ids.append(int(m.group(1)))
        missing = [i for i in ids if i not in self._markers]
        if missing:
            paths = [self._loc.key(layout.commit_key(i)) for i in missing]
            if self._loc.is_local:
                blobs = {}
                for p in paths:
                    with open(p, "rb") as f:
                        blobs[p] = f.read()
            else:
                blobs = with_retries(lambda: self._loc.fs.cat(paths, on_error="return"), "read markers")
            for i, p in zip(missing, paths):
                b = blobs.get(p)
                if isinstance(b, (bytes, bytearray)):
                    try:
                        self._markers[i] = json.loads(b)
                    except ValueError:
                        log.warning("commit marker of unit %d is not valid JSON; ignored", i)
        return {i: self._markers[i] for i in sorted(ids) if i in self._markers}

    def uncommit(self, unit_id: int) -> None:
        """Driver repair only: drop a unit's marker so it can be rewritten (e.g. after a conflict)."""
        self._loc.delete(layout.commit_key(unit_id))
        self._markers.pop(int(unit_id), None)

    def _unit_moments(self, manifest: dict) -> list[_stats.Moments]:
        s = manifest["stats"]
        raw = self._loc.read_bytes(s["key"])
        if raw is None or hashlib.sha256(raw).hexdigest() != s["sha256"]:
            raise StoreError(f"stats partial of unit {manifest['unit_id']} is missing or does not "
                             f"match its commit marker ({s['key']}); rewrite the unit")
        return _stats.loads(raw)

    def stats(self, points: Sequence[str] | None = None) -> dict[str, dict]:
        """Per-point stats: from finalize if present, else merged now from the commit manifests.

        Each value: count, mean [width] float64, var [width] float64, mean_sq_norm, nonfinite_rows
        (rows with inf/NaN, left out of the moments).
        """
        points = list(points or self.points)
        if self._meta["attributes"].get("stats"):
            out = {}
            for p in points:
                g = self._stats_group(p)
                out[p] = {"count": int(g.attrs["count"]), "mean": g["mean"][:], "var": g["var"][:],
                          "mean_sq_norm": float(g.attrs["mean_sq_norm"]),
                          "nonfinite_rows": int(g.attrs.get("nonfinite_rows", 0))}
            return out
        merged = self._merge_stats()
        return {p: {"count": merged[i].count, "mean": merged[i].mean, "var": merged[i].var,
                    "mean_sq_norm": merged[i].mean_sq_norm, "nonfinite_rows": merged[i].nonfinite}
                for i, p in enumerate(self.points) if p in points}

    def _stats_group(self, point: str) -> zarr.Group:
        return zarr.open_group(store=self._zstore, path=f"{layout.STATS_GROUP}/{layout.point_path(point)}",
                               mode="r", zarr_format=3)

    def _merge_stats(self) -> list[_stats.Moments]:
        committed = self.committed_units()
        with cf.ThreadPoolExecutor(8) as ex:
            parts = list(ex.map(self._unit_moments, [committed[i] for i in sorted(committed)]))
        return _stats.merge_all(parts, len(self.points), self.width)

    # ---- finalize and verify (driver) ---------------------------------------------------------
    def stored_bytes(self, point: str, shards: set[int] | None = None) -> int:
        """Bytes on storage of a point's shard objects (only `shards` if given)."""
        base = self._loc.key(f"{layout.point_path(point)}/c")
        try:
            found = with_retries(lambda: self._loc.fs.find(base, detail=True), f"list {point}")
        except FileNotFoundError:
            return 0
        total = 0
        for path, info in found.items():
            parts = path[len(base):].strip("/").split("/")
            if shards is not None and not (parts and parts[0].isdigit() and int(parts[0]) in shards):
                continue
            total += int(info.get("size") or 0)
        return total

    def finalize(self, summary: dict | None = None) -> dict:
        """Merge committed stats into the store, record compression and the run summary."""
        if self.read_only:
            raise StoreError("finalize: store was opened read-only")
        committed = self.committed_units()
        merged = self._merge_stats()
        for i, p in enumerate(self.points):
            path = f"{layout.STATS_GROUP}/{layout.point_path(p)}"
            g = zarr.open_group(store=self._zstore, path=path, mode="a", zarr_format=3)
            for name, v in (("mean", merged[i].mean), ("var", merged[i].var)):
                a = g.create_array(name, shape=(self.width,), dtype="float64", chunks=(self.width,),
                                   compressors=None, fill_value=np.nan, overwrite=True)
                a[:] = v
            g.attrs.update({"count": merged[i].count, "mean_sq_norm": merged[i].mean_sq_norm,
                            "nonfinite_rows": merged[i].nonfinite})
        shards = {s for m in committed.values() for s in (sh["index"] for sh in m["shards"])}
        rows = sum(m["row_end"] - m["row_start"] for m in committed.values())
        logical = rows * self.row_bytes
        ratios = {}
        stored_total = 0
        recorded = all(sh.get("nbytes") is not None and None not in sh["nbytes"]
                       for m in committed.values() for sh in m["shards"])
        for pi, p in enumerate(self.points):
            if recorded:  # sizes the writers recorded: no listing of millions of objects
                b = sum(sh["nbytes"][pi] for m in committed.values() for sh in m["shards"])
            else:
                b = self.stored_bytes(p, shards)
            stored_total += b
            ratios[p] = round(logical / b, 4) if b else None
        ratio = {"overall": round(logical * len(self.points) / stored_total, 4) if stored_total else None,
                 "per_point": ratios, "logical_bytes": logical * len(self.points),
                 "stored_bytes": stored_total}
        index = {str(i): {"row_start": m["row_start"], "row_end": m["row_end"], "attempt": m["attempt"]}
                 for i, m in committed.items()}
        self._loc.write_bytes(layout.COMMITTED_INDEX_KEY, json.dumps(index).encode())
        attrs_update = {
            "summary": redact_attrs(_jsonable(summary or {}, "finalize summary"), self._loc.storage_options),
            "stats": {p: merged[i].summary() for i, p in enumerate(self.points)},
            "compression_ratio": ratio,
            "finalized_at": _now(),
            "committed_rows": rows,
        }
        g = zarr.open_group(store=self._zstore, mode="r+", zarr_format=3)
        g.attrs.update(attrs_update)
        self._meta["attributes"].update(attrs_update)
        return {"committed_units": len(committed), "committed_rows": rows, "compression_ratio": ratio,
                "stats": attrs_update["stats"]}

    def verify(self, deep: bool = False) -> dict:
        """Check every planned row is committed exactly once and metadata agrees.

        deep=True also reads every committed shard back and compares its CRC32 with the one the
        writer recorded: the check that catches a second writer having overwritten a committed
        region, or storage corruption.
        """
        errors: list[str] = []
        plan = {u["unit_id"]: u for u in self.plan()}
        committed = self.committed_units()
        if not plan:
            errors.append("no plan recorded (write_plan was never called)")
        for uid, m in committed.items():
            u = plan.get(uid)
            if u is None:
                errors.append(f"unit {uid} is committed but not in the plan")
            elif (m["row_start"], m["row_end"]) != (u["row_start"], u["row_end"]):
                errors.append(f"unit {uid} committed rows [{m['row_start']},{m['row_end']}) but the plan "
                              f"says [{u['row_start']},{u['row_end']})")
            if m.get("points") != self.points:
                errors.append(f"unit {uid} was written with points {m.get('points')}, store has "
                              f"{self.points}")
            if m.get("layout_version") != self.layout_version:
                errors.append(f"unit {uid} marker has layout_version {m.get('layout_version')}")
            want = {s for s in range(m["row_start"] // self.shard_rows,
                                     -(-m["row_end"] // self.shard_rows))}
            got = {sh["index"] for sh in m.get("shards", [])}
            if want != got:
                errors.append(f"unit {uid} marker lists shards {sorted(got)}, expected {sorted(want)}")
        cover = np.zeros(self.n_shards, np.int32)
        for m in committed.values():
            for sh in m.get("shards", []):
                cover[sh["index"]] += 1
        if (cover > 1).any():
            errors.append(f"shards committed more than once: {np.flatnonzero(cover > 1)[:20].tolist()}")
        missing_units = sorted(set(plan) - set(committed))
        if missing_units:
            errors.append(f"{len(missing_units)} planned units are not committed (e.g. "
                          f"{missing_units[:10]}); run the harvest again to resume them")
        planned_rows = sum(u["row_end"] - u["row_start"] for u in plan.values())
        committed_rows = sum(m["row_end"] - m["row_start"] for uid, m in committed.items() if uid in plan)
        # metadata arrays and point arrays agree with the group attributes
        for name, dt in layout.ROW_META.items():
            a = self._meta_array(name)
            if a.shape != (self.n_rows,) or a.dtype != np.dtype(dt):
                errors.append(f"row metadata {name} has shape {a.shape} dtype {a.dtype}, expected "
                              f"({self.n_rows},) {dt}")
        for p in self.points:
            a = self.array(p)
            if a.shape != (self.n_rows, self.width) or a.dtype != self.np_dtype:
                errors.append(f"array {p} has shape {a.shape} dtype {a.dtype}, expected "
                              f"({self.n_rows}, {self.width}) {self.dtype}")
            if tuple(a.shards or a.chunks) != (self.shard_rows, self.width):
                errors.append(f"array {p} shards {a.shards} do not match shard_rows={self.shard_rows}")
        # every committed shard object exists
        keys_missing = self._missing_shard_objects(committed)
        errors += keys_missing[:20]
        # metadata written for committed rows (fill value -1 means never written)
        unset = 0
        for m in committed.values():
            tok = self._meta_array("token_id")[m["row_start"]:m["row_end"]]
            unset += int((tok < 0).sum())
        if unset:
            errors.append(f"{unset} committed rows have no token_id (write_row_meta not called for them)")
        crc_bad = []
        if deep:
            crc_bad = self._deep_check(committed)
            errors += crc_bad[:20]
        return {"ok": not errors, "errors": errors, "n_rows": self.n_rows,
                "planned_units": len(plan), "committed_units": len(committed),
                "missing_units": missing_units, "planned_rows": planned_rows,
                "committed_rows": committed_rows,
                "committed_fraction": committed_rows / planned_rows if planned_rows else 0.0,
                "deep_checked": deep}

    def _missing_shard_objects(self, committed: dict[int, dict]) -> list[str]:
        out = []
        want = {sh["index"] for m in committed.values() for sh in m.get("shards", [])}
        for p in self.points:
            base = self._loc.key(f"{layout.point_path(p)}/c")
            try:
                found = with_retries(lambda: self._loc.fs.find(base), f"list {p}")
            except FileNotFoundError:
                found = []
            have = set()
            for path in found:
                parts = path[len(base):].strip("/").split("/")
                if parts and parts[0].isdigit():
                    have.add(int(parts[0]))
            for s in sorted(want - have):
                out.append(f"array {p}: shard {s} is committed but its object is missing")
        return out

    def _deep_check(self, committed: dict[int, dict]) -> list[str]:
        bad = []
        for uid, m in committed.items():
            for sh in m.get("shards", []):
                s, e = self.shard_range(sh["index"])
                algo, want = ("crc32c", sh["crc32c"]) if "crc32c" in sh else ("crc32", sh["crc32"])
                for pi, p in enumerate(self.points):
                    if getattr(_stats, algo)(self.array(p)[s:e]) != want[pi]:
                        bad.append(f"unit {uid} shard {sh['index']} of {p}: data differs from what its "
                                   "writer committed (overwritten or corrupt); uncommit and rewrite")
        return bad


# ---- construction --------------------------------------------------------------------------

def create_store(url, points: Sequence[str], width: int, n_rows: int, shard_rows: int | None = None,
                 chunk_rows: int | None = None, dtype: str = "bfloat16", compression=None,
                 attrs: dict | None = None, storage_options: dict | None = None,
                 overwrite: bool = False) -> Store:
    """Create the group and every array pre-sized (driver only). See FORMAT.md for the layout."""
    points = [str(p) for p in points]
    if not points:
        raise ValueError("create_store: points must name at least one capture point, e.g. ['resid_post.0']")
    if len(set(points)) != len(points):
        raise ValueError(f"create_store: points contain duplicates: {points}")
    paths = [layout.point_path(p) for p in points]
    if not isinstance(width, (int, np.integer)) or width <= 0:
        raise ValueError(f"create_store: width must be a positive int, got {width!r}")
    if not isinstance(n_rows, (int, np.integer)) or n_rows <= 0:
        raise ValueError(f"create_store: n_rows must be a positive int, got {n_rows!r}")
    np_dtype = resolve_dtype(dtype)
    for name, v in (("shard_rows", shard_rows), ("chunk_rows", chunk_rows)):
        if v is not None and (not isinstance(v, (int, np.integer)) or v <= 0):
            raise ValueError(f"create_store: {name} must be a positive int or None, got {v!r}")
    shard_rows, chunk_rows = layout.default_sizes(int(width), np_dtype.itemsize, len(points), int(n_rows),
                                                  shard_rows, chunk_rows)
    if shard_rows % chunk_rows:
        raise ValueError(f"create_store: shard_rows={shard_rows} must be a multiple of "
                         f"chunk_rows={chunk_rows} (a shard holds whole inner chunks)")
    comp = _compression.normalize(compression)
    loc = locate(url, storage_options)
    run_attrs = redact_attrs(_jsonable(attrs or {}, "create_store attrs"), loc.storage_options)
    from . import __version__

    harvest = {
        "layout": layout.LAYOUT_NAME, "layout_version": layout.LAYOUT_VERSION,
        "points": points, "arrays": dict(zip(points, paths)), "width": int(width),
        "n_rows": int(n_rows), "shard_rows": shard_rows, "chunk_rows": chunk_rows,
        "dtype": dtype_name(np_dtype), "compression": comp,
        "row_meta": dict(layout.ROW_META), "created_at": _now(),
        "created_by": {"harvest": __version__, **_versions()},
    }
    try:
        existing = loc.read_bytes("zarr.json")
    except Exception as e:  # noqa: BLE001
        raise loc.error("create_store", e) from None
    if existing is not None and not overwrite:
        raise StoreError(f"create_store: {loc.url} already holds a zarr node; open it with open_store, "
                         "choose a new URL, or pass overwrite=True")
    if not loc.is_local and loc.protocol in ("s3", "s3a"):
        _ensure_bucket(loc)
    zstore = loc.zarr_store()
    try:
        g = zarr.create_group(store=zstore, overwrite=overwrite, zarr_format=3,
                              attributes={"harvest": harvest, "run": run_attrs})
        itemsize = np_dtype.itemsize
        for p, path in zip(points, paths):
            g.create_array(path, shape=(int(n_rows), int(width)), dtype=zarr_dtype(np_dtype),
                           chunks=(chunk_rows, int(width)), shards=(shard_rows, int(width)),
                           compressors=_compression.compressors(comp, itemsize), fill_value=0,
                           dimension_names=["row", "dim"], config={"write_empty_chunks": True})
        for name, dt in layout.ROW_META.items():
            isz = np.dtype(dt).itemsize
            g.create_array(name, shape=(int(n_rows),), dtype=dt, chunks=(shard_rows,),
                           compressors=_compression.compressors(
                               {"codec": "blosc", "cname": "zstd", "clevel": 3, "shuffle": "shuffle"}, isz),
                           fill_value=-1, dimension_names=["row"], config={"write_empty_chunks": True})
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 -- translated without secrets
        raise loc.error("create_store", e) from None
    return open_store(loc.url if loc.is_local else loc.url_with_protocol(),
                      storage_options=loc.storage_options)


def _ensure_bucket(loc: Location) -> None:
    bucket = loc.root.split("/", 1)[0]
    try:
        if with_retries(lambda: loc.fs.exists(bucket), "stat bucket"):
            return
        loc.fs.mkdir(bucket)
    except FileExistsError:
        return
    except Exception as e:  # noqa: BLE001
        raise loc.error(f"bucket {bucket!r} does not exist and could not be created", e) from None


def open_store(url, storage_options: dict | None = None, read_only: bool = False) -> Store:
    """Open an existing store; refuses anything that is not a harvest store of a known layout."""
    loc = locate(url, storage_options)
    try:
        # two attempts only: a wrong endpoint should fail in seconds, not after a minute of backoff
        raw = loc.read_bytes("zarr.json", attempts=2)
    except Exception as e:  # noqa: BLE001 -- translated without secrets
        raise loc.error("open_store", e) from None
    if raw is None:
        raise NotAHarvestStore(f"open_store: no store at {loc.url} (zarr.json not found); check the "
                               "URL, or create one with create_store")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise NotAHarvestStore(f"open_store: {loc.url}/zarr.json is not JSON; not a harvest store") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
        raise NotAHarvestStore(f"open_store: {loc.url} is not a zarr v3 group (zarr_format="
                               f"{meta.get('zarr_format') if isinstance(meta, dict) else None}); "
                               "not a harvest store")
    h = (meta.get("attributes") or {}).get("harvest")
    if not isinstance(h, dict) or h.get("layout") != layout.LAYOUT_NAME:
        raise NotAHarvestStore(f"open_store: {loc.url} is a zarr group but not a harvest activation "
                               f"store (attributes.harvest.layout != {layout.LAYOUT_NAME!r})")
    v = h.get("layout_version")
    if v not in layout.SUPPORTED_LAYOUT_VERSIONS:
        raise UnknownLayoutVersion(
            f"open_store: {loc.url} has layout_version={v!r}; this harvest reads versions "
            f"{list(layout.SUPPORTED_LAYOUT_VERSIONS)}. Upgrade harvest to read it.")
    missing = [k for k in ("points", "width", "n_rows", "shard_rows", "chunk_rows", "dtype", "compression")
               if k not in h]
    if missing:
        raise NotAHarvestStore(f"open_store: {loc.url} harvest attributes lack {', '.join(missing)}")
    return Store(loc, meta, read_only=read_only)


__all__ = ["Store", "create_store", "open_store"]
