"""What the ledger's functions need of a store, declared: its data (`StoreData`) and its
bookkeeping (`Bookkeeping`, the part of the ledger's face they use), reached as `store.ledger`.

Finalize, verify, publish and the dataset card are given an object that has these, never the
`Store` class by name: nothing in store/commit/ (nor card.py) imports store.py, not even for an
annotation, so store.py -> ledger -> finalize/verify is a one-way street
(tests/house/test_import_graph.py holds it, annotation-only imports included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

from ..format.jsonattrs import JsonObject

if TYPE_CHECKING:
    import numpy as np
    import zarr

    from ..stats.files import PointStats
    from ..stats.moments import StreamingMerge
    from ..storage.locate import Location
    from .markers import MarkerName
    from .plan import PlanStore
    from .records import Marker, Unit
    from .tables import TableCache


class StoreData(Protocol):
    """A store's facts and arrays (what `Store` is without its bookkeeping)."""

    @property
    def url(self) -> str: ...

    @property
    def location(self) -> Location: ...

    @property
    def points(self) -> list[str]: ...

    @property
    def width(self) -> int: ...

    @property
    def widths(self) -> dict[str, int]: ...

    @property
    def mixed_widths(self) -> bool: ...

    @property
    def max_width(self) -> int: ...

    @property
    def n_rows(self) -> int: ...

    @property
    def shard_rows(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def np_dtype(self) -> np.dtype: ...

    @property
    def layout_version(self) -> int: ...

    @property
    def read_only(self) -> bool: ...

    @property
    def meta_columns(self) -> dict[str, str]: ...

    @property
    def summary(self) -> JsonObject | None: ...

    @property
    def attributes(self) -> JsonObject: ...

    @property
    def attrs(self) -> JsonObject: ...

    @property
    def harvest_attrs(self) -> JsonObject: ...

    @property
    def context_size(self) -> int | None: ...

    @property
    def tokenizer(self) -> str | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def special_token_ids(self) -> list[int]: ...

    @property
    def stats_skip_positions(self) -> int: ...

    @property
    def zarr_store(self) -> object: ...

    def point_row_width(self, point: str) -> int: ...

    def array(self, point: str) -> zarr.Array: ...

    def meta_array(self, name: str) -> zarr.Array: ...

    def shard_codec(self, point: str): ...

    def meta_codec(self, name: str): ...

    def read(self, point: str, start: int, stop: int) -> np.ndarray: ...

    def stats(self, points: "Sequence[str] | None" = None, subset: str = "all") -> "dict[str, PointStats]": ...

    def merge_stats(self, refs: list, batch: int = 256) -> StreamingMerge: ...

    def note_finalized(self, attrs_update: dict) -> None: ...

    def note_resized(self, n_rows: int) -> None: ...

    def note_unfinalized(self, dropped, harvest: dict) -> None: ...


class Bookkeeping(Protocol):
    """The plan, the markers and the object caches, as the ledger keeps them."""

    @property
    def plans(self) -> PlanStore: ...

    # the caches that readers of committed objects share (tables.py, objects.py)
    @property
    def table_cache(self) -> TableCache: ...

    @property
    def meta_chunk_cache(self) -> dict[tuple[str, int, int], np.ndarray]: ...

    def plan_units(self) -> list[Unit]: ...

    def marker_names(self) -> list[MarkerName]: ...

    def iter_committed(self, names: "list | None" = None, planned: bool = False) -> Iterator[Marker]: ...

    def uncommit(self, unit_id: int) -> None: ...


class StoreView(StoreData, Protocol):
    """A store as finalize, verify and publish use it: its data, and its bookkeeping as
    `store.ledger`."""

    @property
    def ledger(self) -> Bookkeeping: ...


__all__ = ["StoreData", "Bookkeeping", "StoreView"]
