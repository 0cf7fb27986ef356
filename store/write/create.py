"""Creating a store: the group, every array pre-sized, the format facts in the group attributes.

The driver creates a store once; arrays are sized to the rows the run may reach (exactly, when
packing.max_tokens bounds it; layout.CAPACITY_ROWS otherwise, which costs nothing because zarr
stores no object for an unwritten shard) and `finalize` shrinks them to the rows committed.
"""

from __future__ import annotations

from typing import Sequence, cast

import numpy as np
import zarr

from ... import __version__   # the one version: harvest's own (the store package imports this module)

from ..format import compression as _compression
from ..format import layout
from ..storage.locate import Location, locate
from ..storage.credentials import redact_attrs
from ..format.dtypes import resolve_dtype, row_width, zarr_dtype
from ..errors import StoreError
from ..format.jsonattrs import jsonable as _jsonable, now as _now
from ..store import Store, open_store
from ..format.spec import StoreSpec


def _versions() -> dict[str, str]:
    import ml_dtypes
    import numcodecs

    return {"zarr": zarr.__version__, "numcodecs": numcodecs.__version__,
            "ml_dtypes": ml_dtypes.__version__, "numpy": np.__version__}


def create_store(url, points: Sequence[str] | None = None, width: int | None = None,
                 n_rows: int | None = None, *, spec: StoreSpec | None = None, attrs: dict | None = None,
                 storage_options: dict | None = None, overwrite: bool = False,
                 create_bucket: bool = False, **spec_fields) -> Store:
    """Create the group and every array pre-sized (driver only). See FORMAT.md for the layout.

    What the store is: `spec=StoreSpec(...)` (store/format/spec.py documents each field), or the same
    fields as keywords (`points=..., width=..., n_rows=..., shard_rows=..., roles=True`), which
    build it. `attrs` are the run's free-form attributes. A missing S3 bucket is an error unless
    `create_bucket` (a typo in the URL would otherwise create a bucket).
    """
    try:
        spec = StoreSpec.build(spec, points=points, width=width, n_rows=n_rows, **spec_fields)
    except ValueError as e:
        raise ValueError(f"create_store: {e}") from None
    np_dtype = resolve_dtype(spec.dtype)
    paths = [layout.point_path(p) for p in spec.points]
    row_meta = {k: layout.ROW_META[k] for k in spec.columns}
    loc = locate(url, storage_options)
    run_attrs = redact_attrs(_jsonable(attrs or {}, "create_store attrs"), loc.storage_options)
    harvest = {
        "layout": layout.LAYOUT_NAME,
        "layout_version": layout.layout_version(dict(spec.widths or {}), spec.width, spec.values),
        "points": list(spec.points), "arrays": dict(zip(spec.points, paths)), "width": spec.width,
        "widths": dict(spec.widths or {}),
        **({"values": dict(spec.values)} if spec.values else {}),
        "n_rows": spec.n_rows, "shard_rows": spec.shard_rows, "chunk_rows": spec.chunk_rows,
        "dtype": spec.dtype, "compression": spec.compression,
        "row_meta": row_meta,
        "row_meta_values": {"unwritten": layout.META_UNWRITTEN, "inserted": layout.META_INSERTED,
                            **({"pad": layout.META_PAD} if spec.generated else {})},
        "context_size": spec.context_size,
        "special_token_ids": list(spec.special_token_ids),
        "bos_token_id": spec.bos_token_id,
        "tokenizer": spec.tokenizer, "stats_skip_positions": spec.stats_skip_positions,
        "created_at": _now(), "created_by": {"harvest": __version__, **_versions()},
    }
    try:
        existing = loc.read_bytes("zarr.json")
    except Exception as e:  # noqa: BLE001
        raise loc.error("create_store", e) from None
    if existing is not None and not overwrite:
        raise StoreError(f"create_store: {loc.url} already holds a zarr node; open it with open_store, "
                         "choose a new URL, or pass overwrite=True")
    loc.ensure_container(create_bucket)
    if overwrite and existing is not None:
        _clear_control(loc)
    zstore = loc.zarr_store()
    try:
        g = zarr.create_group(store=zstore, overwrite=overwrite, zarr_format=3,
                              attributes={"harvest": harvest, "run": run_attrs})
        n = spec.n_rows
        for point, path in zip(spec.points, paths):
            w = row_width(spec.dtype, (spec.widths or {})[point])   # fp8: + a float32 scale per row
            g.create_array(path, shape=(n, w), dtype=zarr_dtype(np_dtype),
                           chunks=(spec.chunk_rows, w), shards=(spec.shard_rows, w),
                           compressors=_compression.compressors(cast(dict, spec.compression),  # normalized by StoreSpec
                                                                 np_dtype.itemsize),
                           fill_value=0,
                           dimension_names=["row", "dim"], config={"write_empty_chunks": True})
        for name, dt in row_meta.items():
            isz = np.dtype(dt).itemsize
            g.create_array(name, shape=(n,), dtype=dt, chunks=(spec.meta_chunk_rows,),
                           compressors=_compression.compressors(
                               {"codec": "blosc", "cname": "zstd", "clevel": 3, "shuffle": "shuffle"}, isz),
                           fill_value=layout.META_UNWRITTEN, dimension_names=["row"],
                           config={"write_empty_chunks": True})
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 -- translated without secrets
        raise loc.error("create_store", e) from None
    return open_store(loc.reopen_url(), storage_options=loc.storage_options)


def _clear_control(loc: Location) -> None:
    """overwrite=True starts a new store: the old plan and markers must not count for it."""
    loc.delete_tree(layout.CONTROL_DIR)


__all__ = ["create_store"]
