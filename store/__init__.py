"""Activation store: chunked, sharded Zarr v3 on local disk or object storage, plus its reader.

This package is the store's one face: `__all__` is everything the pipeline, the CLI, the examples
and the light install (`harvest-store`) may import from the store, and they import it from here
(`from harvest.store import open_store`), never from a submodule; tests/house/test_store_face.py
holds pipeline/ and examples/ to that, with its few exceptions and their reasons. The names
fall in two groups: what everyone uses (open, create, read, verify, train), and what the capture
side shares with the store it writes (where a store lives and what may be printed of it, the
layout's facts, commit bookkeeping, the writer's pieces).

Import-light: no torch, Ray or engine imports here. The names whose modules import torch (the
reader's dataset, adapters and normalisation) are loaded on first use (PEP 562), so an SAE
training job, or the light install without torch, can `from harvest.store import open_store` on a
machine without the engine. See FORMAT.md for the layout.
"""

from .. import lazy_name

from .format import dtypes as _dtypes  # noqa: F401 -- registers the zarr "bfloat16" data type

from .. import __version__ as __version__  # noqa: E402 -- the one version (created_by.harvest)

# ---- for everyone: open, create, read, verify, train -------------------------------------------
from .errors import (  # noqa: E402
    DataIntegrityError,
    NotAHarvestStore,
    RegionConflict,
    RegionWriteFailed,
    StoreAccessError,
    StoreError,
    UnknownLayoutVersion,
)
from .write.create import create_store  # noqa: E402
from .commit.records import Marker, ShardRecord, Unit  # noqa: E402
from .store import Store, open_store  # noqa: E402
from .format.spec import StoreSpec  # noqa: E402
from .commit.verify import VerifyReport  # noqa: E402
from .read.config import ReaderConfig  # noqa: E402
from .read.filters import SINK_POSITIONS, RowFilter, sink_positions  # noqa: E402
from .inspect import inspect  # noqa: E402
from .shuffled_copy import shuffle_store  # noqa: E402
from .card import CARD, card_facts, write_card  # noqa: E402

# ---- for the capture side: what the pipeline shares with the store it writes --------------------
# where a store lives, and what may be printed of it (secrets masked)
from .storage.locate import backend_for, locate, register_backend  # noqa: E402
from .storage.interface import Storage  # noqa: E402
from .storage.credentials import (REDACTED, mask_text, redact_attrs, redact_options,  # noqa: E402
                                  redact_url, scrub, url_identity, url_origin)
from .storage.retries import THROTTLE, THROTTLE_BUDGET_S  # noqa: E402
from .escape import html_text, plot_text, terminal, terminal_data  # noqa: E402
# the layout's facts (FORMAT.md in code); role codes, fp8 rows and codecs as namespaces
from .format.layout import (BASE_META, CAPACITY_ROWS, GEN_DROPPED, GEN_HAS_ACTS,  # noqa: E402
                            GEN_LAST, GEN_PAD, GEN_PROMPT, GEN_SAMPLED, META_INSERTED, META_PAD,
                            ROW_META, block_rows, check_sizes, choose_sizes)
from .format.markersize import marker_size, table_size  # noqa: E402
from .format.dtypes import (FP8_NAME, is_quantized, raw_dtype, resolve_dtype,  # noqa: E402
                            row_width, torch_dtype, torch_view)
from .format import compression, fp8, roles  # noqa: E402
from .format.shardcodec import codec_pool, name_native_thread  # noqa: E402
from .stats.moments import crc32c  # noqa: E402
# commit bookkeeping: the index, publishing, finalize, the driver's lease records
from .commit.markers import IndexBuilder, index_batch  # noqa: E402
from .commit.objects import writes_per_object  # noqa: E402
from .commit.published import SettleReport, settle_text, unpublished  # noqa: E402
from .commit.finalize import plan_gap, unfinalize  # noqa: E402
from .commit.alignment import StoresNotAligned, check_aligned  # noqa: E402
from .format.layout import LEASE_DIR, lease_generation, lease_key  # noqa: E402
from .commit.records import LeaseRecord, process_id, read_lease  # noqa: E402
from .commit.tables import shard_ids  # noqa: E402
# the writer's and reader's pieces the actors run
from .write.block_buffers import to_numpy, use_allocator  # noqa: E402
from .read.checked_rows import read_meta_checked  # noqa: E402

# Names whose modules import torch: loaded on first use (PEP 562).
_LAZY = {"ActivationDataset": "read.dataset", "NormConstants": "read.normalize",
         "crosscoder_data": "read.adapters", "dictionary_learning_data": "read.adapters",
         "heldout_fvu": "read.adapters", "on_device": "read.adapters",
         "saelens_data_provider": "read.adapters", "saelens_multi_data_provider": "read.adapters",
         "transcoder_batches": "read.adapters"}


def __getattr__(name: str):
    return lazy_name(__name__, _LAZY, name)


__all__ = [
    # for everyone
    "Store", "StoreSpec", "Unit", "Marker", "ShardRecord", "create_store", "open_store", "StoreError", "NotAHarvestStore",
    "UnknownLayoutVersion", "StoreAccessError", "RegionWriteFailed", "RegionConflict",
    "DataIntegrityError", "VerifyReport", "ReaderConfig", "RowFilter", "SINK_POSITIONS",
    "sink_positions", "inspect", "shuffle_store", "CARD", "card_facts", "write_card",
    "ActivationDataset", "NormConstants", "crosscoder_data", "dictionary_learning_data",
    "heldout_fvu", "on_device", "saelens_data_provider", "saelens_multi_data_provider",
    "transcoder_batches",
    # for the capture side
    "Storage", "backend_for", "locate", "register_backend", "REDACTED", "mask_text", "redact_attrs", "redact_options",
    "redact_url", "scrub", "url_identity", "url_origin", "THROTTLE", "THROTTLE_BUDGET_S",
    "html_text", "plot_text", "terminal", "terminal_data",
    "BASE_META", "CAPACITY_ROWS", "GEN_DROPPED", "GEN_HAS_ACTS", "GEN_LAST", "GEN_PAD",
    "GEN_PROMPT", "GEN_SAMPLED", "META_INSERTED", "META_PAD", "ROW_META", "block_rows",
    "check_sizes", "choose_sizes", "marker_size", "table_size", "FP8_NAME", "is_quantized",
    "raw_dtype", "resolve_dtype", "row_width", "torch_dtype", "torch_view", "compression", "fp8",
    "roles", "codec_pool", "name_native_thread", "crc32c",
    "IndexBuilder", "index_batch", "writes_per_object", "SettleReport", "settle_text", "unpublished", "plan_gap",
    "unfinalize", "StoresNotAligned", "check_aligned", "LEASE_DIR", "lease_generation",
    "lease_key", "LeaseRecord", "read_lease", "process_id", "shard_ids", "to_numpy", "use_allocator", "read_meta_checked",
]
