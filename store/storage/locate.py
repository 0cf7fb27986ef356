"""Where a store lives: `locate` parses a local path or fsspec URL into the `Storage` of its
backend, chosen from a registry by URL protocol (interface.py: the interface; local.py,
objectstore.py, s3.py, memory.py: one class per backend; `register_backend` adds one).

`Location` is the name the rest of the package uses for a located `Storage`.
"""

from __future__ import annotations

import os

from .credentials import scrub, userinfo
from ..errors import StoreAccessError
from .interface import Storage
from .local import LocalStorage
from .memory import MemoryStorage
from .objectstore import ObjectStorage
from .s3 import S3Storage

Location = Storage

# URL protocol -> backend class; a protocol not named here is served by ObjectStorage (fsspec).
BACKENDS: dict[str, type[Storage]] = {}


def register_backend(cls: type[Storage]) -> type[Storage]:
    """Serve `cls.protocols` with `cls` (a class decorator too); a later registration of a
    protocol replaces the earlier one."""
    if not cls.protocols:
        raise ValueError(f"{cls.__name__} names no protocols to serve")
    for p in cls.protocols:
        BACKENDS[p.lower()] = cls
    return cls


for _cls in (LocalStorage, S3Storage, MemoryStorage):
    register_backend(_cls)


def protocol_of(url: str) -> str:
    """"file" for a local path, else the URL's scheme, lowercased."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_for(url: str) -> type[Storage]:
    """The backend class that serves `url`, a local path or URL ("s3://" names S3's)."""
    return BACKENDS.get(protocol_of(url), ObjectStorage)


def locate(url: "str | Storage", storage_options: dict | None = None) -> Storage:
    """Parse a local path or fsspec URL into its backend's Storage (filesystem built, nothing
    contacted). A Storage is its own location, returned as it is (its options are its own):
    whoever located a store once hands that on instead of a URL to parse again."""
    if isinstance(url, Storage):
        return url
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise ValueError(f"store url must be a local path or fsspec URL, got {url!r}")
    url = os.fspath(url)
    display = scrub(url, storage_options)
    if userinfo(url):
        raise StoreAccessError(
            f"store url {display} carries credentials (user:secret@ before the bucket): they "
            "would end up in logs and error messages; pass them in AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY or storage_options key/secret instead")
    return backend_for(url).open(url, display, dict(storage_options or {}))


__all__ = ["BACKENDS", "Location", "backend_for", "locate", "protocol_of", "register_backend"]
