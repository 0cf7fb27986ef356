"""Check the light install on another Python / zarr: deep-verify a store and print a digest of
its first rows, to compare with the same command run in the project's own venv.

    python3.13 -m venv /tmp/py313
    /tmp/py313/bin/pip install numpy "zarr>=3.1" numcodecs google-crc32c fsspec ml_dtypes
    /tmp/py313/bin/pip install --no-deps packages/harvest-store
    /tmp/py313/bin/python packages/harvest-store/check_light.py .harvest/stores/default
    PYTHONPATH=. .venv/bin/python packages/harvest-store/check_light.py .harvest/stores/default

The two last lines must print the same digest with no errors. `--no-deps` keeps torch out: PyPI's
torch for other Pythons is a multi-GB CUDA build, and the store API must not need it (the line
says whether torch got imported).
"""

import hashlib
import sys

import numpy as np

from harvest.store import open_store


def main(url: str, rows: int = 4096) -> int:
    s = open_store(url, read_only=True)
    v = s.verify(deep=True)
    h = hashlib.sha256()
    for p in s.points[:4]:
        h.update(np.ascontiguousarray(s.read(p, 0, min(rows, s.n_rows))).view(np.uint16).tobytes())
    print(f"python {sys.version.split()[0]}, torch imported: {'torch' in sys.modules}, "
          f"errors: {v.errors}, deep: {v.deep_checked}, digest {h.hexdigest()[:16]}")
    return 0 if not v.errors else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
