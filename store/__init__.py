"""Activation store: chunked, sharded Zarr v3 on local disk or object storage, plus its reader.

Import-light: no torch, Ray or engine imports here (the reader imports torch lazily), so an SAE
training job can `from harvest.store import open_store` on a machine without the engine.
See FORMAT.md for the layout.
"""

from .format import dtypes as _dtypes  # noqa: F401 -- registers the zarr "bfloat16" data type

from harvest import __version__ as __version__  # noqa: E402 -- the one version (created_by.harvest)

from .errors import (  # noqa: E402
    DataIntegrityError,
    NotAHarvestStore,
    RegionConflict,
    RegionWriteFailed,
    StoreAccessError,
    StoreError,
    UnknownLayoutVersion,
)
from harvest.store.write.create import create_store  # noqa: E402
from harvest.store.commit.plan import Unit  # noqa: E402
from .store import Store, open_store  # noqa: E402
from harvest.store.format.spec import StoreSpec  # noqa: E402

__all__ = [
    "Store", "StoreSpec", "Unit", "create_store", "open_store", "StoreError", "NotAHarvestStore", "UnknownLayoutVersion",
    "StoreAccessError", "RegionWriteFailed", "RegionConflict", "DataIntegrityError",
]
