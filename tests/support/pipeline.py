"""Helpers shared by the pipeline tests: the corpus, configs, the single-process reference and
the row-for-row comparison against it (tests/store/test_store_matches.py checks that it does catch a
difference). Not a test module: test modules import from here, never from each other."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harvest.pipeline.config.run import HarvestConfig, load_config

CONTEXT = 32
SHARD_ROWS = 256  # 8 contexts per shard/unit
MAX_TOKENS = 24 * SHARD_ROWS  # 24 units


def write_corpus(path: Path) -> Path:
    """A local jsonl corpus with rows the pipeline must skip (empty, null, not text)."""
    from pydoc_data.topics import topics

    rows = []
    for i, k in enumerate(sorted(topics)):
        rows.append({"text": topics[k], "topic": k})
        if i % 10 == 3:
            rows.append({"text": "", "topic": "empty"})
        if i % 10 == 7:
            rows.append({"text": None, "topic": "null"})
    rows.insert(5, {"text": 12345, "topic": "number"})
    # one of each near the start too: runs stop reading at packing.max_tokens
    rows[1:1] = [{"text": "", "topic": "empty"}, {"text": None, "topic": "null"},
                 {"text": ["a"], "topic": "list"}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# An override for pipeline runs whose subject is not the compiled graph (exactly-once through a
# kill, generation slots, a comparison run): vLLM's torch.compile off in the actors' engines (the
# taps stay frozen in, run eagerly; engine.model_check.NO_COMPILE). Each compiled engine start
# costs ~8 s more on 2 cores; the compiled pipeline path keeps its own runs
# (test_pipeline_vllm.py, the TP=2 run in test_pipeline_tp.py).
EAGER_VLLM = "model.engine_args={compilation_config: {mode: 0}}"


def make_cfg(model_path: str, store_url: str, data_path: "str | Path", *overrides: str,
             storage_options: dict | None = None, **sections) -> HarvestConfig:
    data = {
        "name": "test",
        "progress": False,
        "model": {"path": model_path, "backend": "eager"},
        "data": {"source": str(data_path)},
        "packing": {"context_size": CONTEXT, "max_tokens": MAX_TOKENS, "bos": "context"},
        "capture": {"points": ["resid_post.*"], "batch_contexts": 4},
        "store": {"url": store_url, "shard_rows": SHARD_ROWS, "unit_shards": 1,
                  "storage_options": storage_options},
        "ray": {"num_actors": 2, "max_in_flight": 2, "max_restarts": 2, "max_task_retries": 2,
                "threads_per_actor": 1},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return load_config(data=data, overrides=list(overrides))


def reference_capture(model_path: str, token_ids: np.ndarray, context_size: int,
                      unit_rows: int, batch_contexts: int, points: list[str]) -> dict[str, np.ndarray]:
    """Single-process eager capture of the same tokens, unit by unit, in the actors' batching and
    with one thread, like the actors (so the same backend must give identical bits)."""
    import torch

    from harvest.engine import load_model, to_numpy

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = load_model(model_path, backend="eager")
        n = len(token_ids)
        out = {p: None for p in points}
        for rs in range(0, n, unit_rows):
            ctx = token_ids[rs : rs + unit_rows].reshape(-1, context_size).tolist()
            batches = [ctx[i : i + batch_contexts] for i in range(0, len(ctx), batch_contexts)]
            for req in m.capture(batches, points):
                row = rs + req.index * context_size
                for p in points:
                    a = to_numpy(req.point(p))   # at the point's own width
                    if out[p] is None:
                        out[p] = np.zeros((n, a.shape[1]), a.dtype)
                    out[p][row : row + len(a)] = a
        m.close()
        return out
    finally:
        torch.set_num_threads(old)


def assert_store_matches(store, ref: dict[str, np.ndarray], rel_tol: float | None = None):
    """Every row of every point equals the reference: bit-exact, or within `rel_tol` relative
    error per row (bf16 across backends: ~1%; a row of another token or layer is > 30%)."""
    assert set(store.points) == set(ref)
    for p in store.points:
        got = np.asarray(store.read(p, 0, store.n_rows))
        want = ref[p]
        assert got.shape == want.shape, p
        if rel_tol is None:
            same = got.view(np.uint16) == want.view(np.uint16)
            bad = np.flatnonzero(~same.all(axis=1))
            assert bad.size == 0, f"{p}: {bad.size} rows differ from the reference, first {bad[:5]}"
        else:
            g, w = got.astype(np.float32), want.astype(np.float32)
            err = np.linalg.norm(g - w, axis=1) / (np.linalg.norm(w, axis=1) + 1e-12)
            bad = np.flatnonzero(err >= rel_tol)
            assert bad.size == 0, (f"{p}: {bad.size} rows beyond {rel_tol:.0%} relative error, "
                                   f"worst {err.max():.3f} at row {int(err.argmax())}")


@dataclass
class Reference:
    """What a run of make_cfg's settings must produce, computed without the pipeline's data plane:
    documents through `datasets` (iter_texts), packed as one block by the packing function, and
    activations from a single-process eager capture."""

    packed: object
    points: list
    unit_rows: int

    @property
    def n_units(self) -> int:
        return -(-self.packed.n_rows // self.unit_rows)

    @property
    def unit_ids(self) -> list[int]:
        return list(range(self.n_units))


def reference_rows(cfg) -> object:
    """The packed rows of a config whose corpus is one block (data.block_bytes >= its size)."""
    from transformers import AutoTokenizer

    from harvest.pipeline.data.documents import iter_texts
    from harvest.pipeline.data.packing import pack_texts
    from harvest.pipeline.driver.prepare import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
    return pack_texts(iter_texts(cfg.data), tok, cfg.packing)


def reference_block_rows(cfg, path: Path) -> object:
    """The packed rows of a one-file json-lines corpus cut into byte-range blocks: documents
    through `datasets` (iter_texts), assigned to the block their line starts in (computed here
    from the file), each block packed on its own, contexts cut at max_tokens in block order."""
    import dataclasses

    from transformers import AutoTokenizer

    from harvest.pipeline.data.documents import iter_texts
    from harvest.pipeline.data.packing import Packed, pack_texts
    from harvest.pipeline.driver.prepare import resolve_model_path

    starts, off = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            starts.append(off)
        off += len(line)
    B = cfg.data.block_bytes
    by_block: dict[int, list] = {}
    for row, text in iter_texts(dataclasses.replace(cfg.data, block_bytes=B)):
        by_block.setdefault(starts[row] // B, []).append((row, text))
    tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
    nolimit = dataclasses.replace(cfg.packing, max_tokens=None)
    parts = [pack_texts(by_block[b], tok, nolimit) for b in sorted(by_block)]
    n = cfg.packing.max_tokens or sum(p.n_rows for p in parts)
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])[:n]  # noqa: E731
    return Packed(cat("token_ids"), cat("doc_ids"), cat("positions"), cfg.packing.context_size)


_REFERENCES: dict = {}


def shared_reference(model_path: str, corpus: Path, scratch: Path):
    """(Reference, acts) for make_cfg's settings, computed once per session."""
    from harvest.pipeline.driver.prepare import model_facts, resolve_points

    key = (model_path, str(corpus))
    if key not in _REFERENCES:
        cfg = make_cfg(model_path, str(scratch / "unused"), corpus)
        packed = reference_rows(cfg)
        points = [str(a) for a in resolve_points(cfg.capture, model_facts(cfg.model)[1].n_layers)]
        acts = reference_capture(model_path, packed.token_ids, cfg.packing.context_size,
                                 SHARD_ROWS, cfg.capture.batch_contexts, points)
        _REFERENCES[key] = (Reference(packed, points, SHARD_ROWS), acts)
    return _REFERENCES[key]


_CORPORA: dict = {}


def shared_corpus(scratch: Path) -> Path:
    if "c" not in _CORPORA:
        _CORPORA["c"] = write_corpus(scratch / "docs.jsonl")
    return _CORPORA["c"]


def check_store(store, reference, rel_tol: float | None = None):
    """Complete, verified, metadata = packing, activations = the single-process reference."""
    ref, acts = reference
    v = store.verify(deep=True)
    assert v.ok, v.errors
    assert v.committed_rows == ref.packed.n_rows and not v.missing_units
    assert store.n_rows == ref.packed.n_rows  # finalize shrank the arrays to the rows committed
    tok, doc, pos = store.read_row_meta(0, store.n_rows)
    assert np.array_equal(tok, ref.packed.token_ids)
    assert np.array_equal(doc, ref.packed.doc_ids)
    assert np.array_equal(pos, ref.packed.positions)
    assert_store_matches(store, acts, rel_tol)  # None: same backend, bit-exact
