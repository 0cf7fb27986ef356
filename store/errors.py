"""Exceptions a store raises, one per thing a caller can act on differently."""

from __future__ import annotations


class StoreError(Exception):
    """Base class: anything wrong with a store, its input, or the storage under it."""


class NotAHarvestStore(StoreError):
    """The URL holds nothing, or a Zarr group that this package did not create."""


class UnknownLayoutVersion(StoreError):
    """The store is ours but written by a layout this code cannot read safely."""


class StoreAccessError(StoreError):
    """Storage refused or could not be reached (credentials, endpoint, bucket). Never carries a secret."""


class RegionWriteFailed(StoreError):
    """A region's upload failed for good; the region stays uncommitted and can be rewritten."""


class RegionConflict(StoreError):
    """Another writer committed the same unit while this one was writing."""


class DataIntegrityError(StoreError):
    """Committed data is missing or differs from what its writer recorded in the commit marker
    (deleted, truncated, overwritten or corrupt objects, edited metadata). Never read as data."""


class RecordError(DataIntegrityError):
    """A record in the store is not one its layout allows (hostile or corrupt: a name that would
    leave the store, a size past the layout's bounds, a field of the wrong kind). Names the
    object and the field; nothing is read, written or moved through it."""


class CorruptGzip(RecordError):
    """Bytes that should be gzip and are not (damaged in storage): for a cache such as the
    index, a miss."""
