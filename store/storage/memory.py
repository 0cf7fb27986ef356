"""A store in this process's memory (`memory://`, fsspec's MemoryFileSystem): for tests, examples
and `harvest plan` on a URL that touches no disk or server.

Its objects live in one process, so it is not `shared`: capture actors and reader workers are
other processes and would each see an empty store of their own; a run refuses it
(`Storage.require`). Within the process every operation is a dict access, so create-once is
made exact with a lock (the filesystem's own exclusive create checks, then sets, unlocked).
Moves are copy-then-delete, as on any object store.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

from .objectstore import ObjectStorage

# One lock for the process: fsspec's memory filesystem is one dict per process.
_CREATE_LOCK = threading.Lock()


@dataclass
class MemoryStorage(ObjectStorage):
    """fsspec's in-memory filesystem; objects last as long as the process."""

    protocols: ClassVar[tuple[str, ...]] = ("memory",)
    supports_conditional_create: ClassVar[bool] = True
    shared: ClassVar[bool] = False

    def create_once(self, rel: str, data: bytes) -> bool:
        """Exclusive create under the process's lock: exactly one racing writer wins."""
        path = self.key(rel)
        with _CREATE_LOCK:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
        return True


__all__ = ["MemoryStorage"]
