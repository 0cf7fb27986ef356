"""Work-unit sizes: fixed runs of contexts, aligned to store shards, sized for the engine and
commits (and the shard and chunk sizes of a run).

Unit k is global contexts [k * U, (k + 1) * U) of the packed corpus (the last one may be short):
its rows are known as soon as the contexts before it are counted, whatever the block sizes, so
units are dense (no holes in the row space), all the same size, and start on shard boundaries
(`unit_rows` is a multiple of `shard_rows`, itself a multiple of the context size). Units never
share a shard, so two actors never write the same object, and a retried unit rewrites exactly the
objects it owns.

Sizes: shards and chunks follow the store's one policy (`harvest.store.format.layout.choose_sizes`);
a unit is about `store.unit_tokens` rows (10^5-10^6: one engine call streams many steps of it and
a commit covers many shards), fewer when the run is bounded and small, so every actor gets
several units.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.corpus import PackingConfig
from ..config.sections import StoreConfig
from ...store import CAPACITY_ROWS, choose_sizes

UNITS_PER_ACTOR = 4

__all__ = ["Layout", "choose_layout", "UNITS_PER_ACTOR"]


@dataclass(frozen=True)
class Layout:
    shard_rows: int
    chunk_rows: int
    unit_rows: int
    capacity_rows: int  # rows the arrays are created with (exact when max_tokens bounds the run)
    context_size: int = 1

    @property
    def unit_contexts(self) -> int:
        return self.unit_rows // self.context_size


def choose_layout(st: StoreConfig, packing: PackingConfig, num_actors: int, width: int,
                  itemsize: int, n_points: int,
                  stored: "tuple[int, int, int] | None" = None) -> Layout:
    """Shard/chunk/unit rows for this run from the `store` and `packing` sections and
    ray.num_actors; `stored` (shard, chunk, unit rows) of a resumed store wins. Explicit config
    values are kept, missing ones derived."""
    C = packing.context_size
    capacity = CAPACITY_ROWS if packing.max_tokens is None else packing.max_tokens // C * C
    if stored is not None:
        return Layout(*stored, capacity, C)
    target = st.unit_tokens
    if packing.max_tokens is not None:
        # enough units that every actor gets several (a straggler then costs one small unit)
        target = min(target, max(C, capacity // (UNITS_PER_ACTOR * num_actors)))
    shard_rows = st.shard_rows
    if shard_rows is None and st.unit_shards is None:
        shard_rows = choose_sizes(width, itemsize, n_points, multiple=C)[0]
        shard_rows = min(shard_rows, max(C, target // C * C))
    # explicit sizes were checked with the config (run.check_store_sizes)
    shard_rows, chunk_rows = choose_sizes(width, itemsize, n_points, multiple=C,
                                          shard_rows=shard_rows, chunk_rows=st.chunk_rows)
    unit_shards = st.unit_shards or max(1, target // shard_rows)
    return Layout(shard_rows, chunk_rows, shard_rows * unit_shards, capacity, C)
