"""Where a store lives: `locate` parses a local path or fsspec URL into the `Storage` of its
backend (interface.py: the interface; local.py, objectstore.py: one class per backend).

`Location` is the name the rest of the package uses for a located `Storage`.
"""

from __future__ import annotations

import os

import fsspec

from .credentials import scrub, userinfo
from harvest.store.errors import StoreAccessError
from .local import LocalStorage
from .objectstore import ObjectStorage, S3Storage, s3_options
from .interface import Storage

Location = Storage

_S3 = ("s3", "s3a")


def locate(url: str, storage_options: dict | None = None) -> Storage:
    """Parse a local path or fsspec URL into its backend's Storage (filesystem built, nothing
    contacted)."""
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise ValueError(f"store url must be a local path or fsspec URL, got {url!r}")
    url = os.fspath(url)
    display = scrub(url, storage_options)
    if userinfo(url):
        raise StoreAccessError(
            f"store url {display} carries credentials (user:secret@ before the bucket): they "
            "would end up in logs and error messages; pass them in AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY or storage_options key/secret instead")
    if "://" not in url or url.startswith("file://"):
        root = os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
        return LocalStorage(url=root, protocol="file", root=root, storage_options={},
                            fs=fsspec.filesystem("file"))
    protocol = url.split("://", 1)[0].lower()
    so = s3_options(storage_options) if protocol in _S3 else dict(storage_options or {})
    budget = so.pop("retry_budget_s", None)  # ours (StoreConfig.fs_options), not fsspec's
    try:
        fs, root = fsspec.url_to_fs(url, **so)
    except Exception as e:  # noqa: BLE001 -- reported without secrets
        raise StoreAccessError(f"cannot open filesystem for {display}: "
                               f"{scrub(f'{type(e).__name__}: {e}', so)}") from None
    if budget is not None and protocol in _S3:
        # s3fs retries timeouts 5 times itself, outside any budget: with_retries does it
        fs.retries = 1
    cls = S3Storage if protocol in _S3 else ObjectStorage
    return cls(url=display, protocol=protocol, root=root.rstrip("/"), storage_options=so, fs=fs,
               budget_s=budget)


__all__ = ["Location", "locate"]
