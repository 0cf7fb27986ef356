"""CRC32C of the bulk bytes the writer checksums (raw rows, stored objects), by the fastest
implementation installed: the `crc32c` package (hardware CRC32C with carry-less multiplication
folding, the GIL released on large buffers) where present, else google-crc32c. Both compute the
same CRC32C (Castagnoli), so a store's recorded checksums do not depend on which one ran.

Measured here (1 MiB buffers, one thread, 2-core Xeon with SSE4.2 and PCLMULQDQ): `crc32c`
0.031-0.035 core-s per GB, google-crc32c 0.05-0.15 depending on the bytes; the writer checksums
every raw row and every stored byte, about 1.7 GB per GB of bf16 input
(benchmarks/results/RESULTS.md, "Whole write path"). Small buffers (indexes, markers) keep
google-crc32c, a dependency of zarr anyway.
"""

from __future__ import annotations

import google_crc32c

try:  # optional: LGPL-2.1+, so not a dependency of the light store install
    import crc32c as _fast
except ImportError:  # pragma: no cover -- depends on the install
    _fast = None

FAST = _fast is not None


def extend(crc: int, data) -> int:
    """CRC32C of the bytes checksummed so far (`crc`) followed by `data` (any contiguous
    buffer: bytes, memoryview, a numpy array's bytes)."""
    if _fast is not None:
        return _fast.crc32c(data, value=crc)
    return google_crc32c.extend(crc, data)


def value(data) -> int:
    """CRC32C of `data` (any contiguous buffer)."""
    return extend(0, data)


__all__ = ["FAST", "extend", "value"]
