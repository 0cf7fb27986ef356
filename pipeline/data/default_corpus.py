"""The offline default corpus: Python's own documentation topics, written once as jsonl.

This machine (and CI) has no route to the Hugging Face hub, so the default run needs English prose
that is always present: `pydoc_data.topics.topics` ships with every CPython. It is written to a
file under the cache (not read from memory each time) so that the default run goes through the same
`datasets` file loader as any user corpus, and the file name carries the Python version because the
topics text changes between releases (a resumed store must see the same tokens).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..config.paths import cache_dir


def pydoc_corpus_path(root: "str | Path | None" = None) -> Path:
    """Write (once) and return the jsonl file: one document per topic, sorted by topic name."""
    root = Path(root) if root is not None else cache_dir() / "corpus"
    v = sys.version_info
    path = root / f"pydoc-topics-py{v.major}.{v.minor}.{v.micro}.jsonl"
    if path.is_file():
        return path
    from pydoc_data.topics import topics

    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for key in sorted(topics):
            f.write(json.dumps({"id": key, "text": topics[key]}, ensure_ascii=False) + "\n")
    # rename is atomic: two actors or drivers racing here both end with the same complete file
    os.replace(tmp, path)
    return path
