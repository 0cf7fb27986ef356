"""Streamed vs stored, side by side in one run (issue 49): rows/s to the trainer and host
core-seconds per GB of rows, capture -> stream -> trainer against capture -> store -> reader.

Both paths run the same driver, tokenisers and capture actors on the same corpus and config,
on one local Ray cluster; the engine is a stub (`PoolEngine`) that hands out rows from a pool
with one copy per request (as an engine's device-to-host copy would), so the CPU measured is
the data plane's, which is what a stream replaces: on the stream path the actors' hand-off,
Ray's object store and the trainer's receiver and batches; on the store path the writer
(buffers, codec, CRCs, statistics, local disk) and then one epoch of the shuffled reader.
CPU is every process of the cluster and this one (psutil: user + system, reaped children
included), from the first call to the last batch; the trainer only touches each batch.

Shapes: SmolLM2-135M (30 points x 576, real rows captured once from the model, eager) and an
8B model's row (32 points x 4096: 256 KiB a token, synthetic heavy-tailed rows).

    python -m harvest.benchmarks.bench_stream [--shapes smollm2 8b] [--tokens N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from .bench_scale import StubEngine

SHAPES = {
    # name: (layers, width, tokens, context, batch, window rows, send rows, take rows)
    "smollm2": (30, 576, 131072, 512, 4096, 16384, 4096, 2048),
    "8b": (32, 4096, 16384, 512, 1024, 2048, 512, 256),
}
POOL_ROWS = {"smollm2": 2048, "8b": 256}


class PoolEngine(StubEngine):
    """The stub engine with rows: each request gets a fresh copy of `pool.npy`'s rows (beside
    the model's config), cycling through the pool."""

    def __init__(self, spec):
        super().__init__(spec)
        self.pool = np.load(Path(spec.model_path) / "pool.npy", mmap_mode="r")
        self.at = 0

    def describe(self) -> dict:
        return {**super().describe(), "mode": "pool"}

    def _capture(self, batches, points):
        import torch

        from ..engine.addresses import parse_addresses
        from ..engine.capture.captured import CapturedRequest
        from ..store.format.dtypes import BF16

        pts = tuple(parse_addresses(list(points), self.n_layers))
        P, R = len(pts), self.pool.shape[1]
        i = 0
        for batch in batches:
            for toks in batch:
                ids = np.asarray(toks, np.int32)
                n = len(ids)
                rows = (self.at + np.arange(n)) % R
                self.at = (self.at + n) % R
                acts = np.ascontiguousarray(self.pool[:P][:, rows]).view(BF16)
                self.scheduled_tokens += n
                yield CapturedRequest(i, ids, np.arange(n, dtype=np.int32), pts,
                                      torch.from_numpy(acts.view(np.int16)).view(torch.bfloat16))
                i += 1


def _cache() -> Path:
    from ..engine.models import cache_dir

    d = Path(cache_dir()) / "bench-stream"
    d.mkdir(parents=True, exist_ok=True)
    return d


def shape_model(shape: str) -> str:
    """A model folder for the stub: SmolLM2's tokenizer, a config of the shape, and the pool
    of rows ([layers, pool rows, width] bf16 bits)."""
    from ..engine.models import smollm2_path

    layers, width = SHAPES[shape][:2]
    out = _cache() / f"model-{shape}"
    if (out / "pool.npy").exists():
        return str(out)
    src = Path(smollm2_path())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    heads = max(1, width // 64)
    cfg.update(hidden_size=width, num_hidden_layers=layers, intermediate_size=4 * width,
               num_attention_heads=heads, num_key_value_heads=heads, head_dim=64)
    (out / "config.json").write_text(json.dumps(cfg))
    np.save(out / "pool.npy", pool_rows(shape, str(src)))
    return str(out)


def pool_rows(shape: str, smollm2: str) -> np.ndarray:
    """[layers, POOL_ROWS, width] uint16 (bf16 bits): SmolLM2's own rows at its shape (every
    layer's resid_post over Python's documentation), synthetic heavy-tailed rows at the 8B one."""
    layers, width = SHAPES[shape][:2]
    n = POOL_ROWS[shape]
    if shape != "smollm2":
        from ..testing.synthetic import activations

        return activations((layers, n, width), seed=0).view(np.uint16)
    import torch
    from pydoc_data.topics import topics

    from ..engine import load_model, to_numpy

    m = load_model(smollm2, backend="eager")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"][:n]
    ctx = [ids[i:i + 256] for i in range(0, n, 256)]
    out = np.zeros((layers, n, width), np.uint16)
    with torch.inference_mode():
        for req in m.capture([ctx], [f"resid_post.{i}" for i in range(layers)]):
            a = to_numpy(req.acts).view(np.uint16)
            out[:, req.index * 256:req.index * 256 + a.shape[1]] = a
    m.close()
    return out


def corpus() -> Path:
    """Python's documentation topics as json-lines (the default corpus's text), enough tokens."""
    from pydoc_data.topics import topics

    p = _cache() / "topics.jsonl"
    if not p.exists():
        rows = [{"text": topics[k]} for k in sorted(topics)] * 2
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


class TreeCpu:
    """CPU seconds of this process and every descendant (the local Ray cluster: its raylet,
    workers, actors) over a phase, per process kind: each process's user + system time sampled
    every `every` seconds (a process that exits counts up to its last sample: at most `every`
    seconds of it are lost), and its peak RSS."""

    def __init__(self, every: float = 0.2, mark=None):
        """`mark()`: once it is true, the CPU so far is kept apart (`at_mark`, `mark_t`): the
        start-up (engines loading, tokenisers), so `steady()` is the data plane alone."""
        import psutil

        self.every, self.psutil = every, psutil
        self.mark = mark
        self.at_mark: "float | None" = None
        self.mark_t: "float | None" = None
        self.marked: dict[int, float] = {}
        self.t0 = time.perf_counter()
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self._sample(first=True)

    def _kind(self, p) -> str:
        if p.pid == os.getpid():
            return "trainer"
        try:
            title = " ".join(p.cmdline())[:200]
        except self.psutil.Error:
            return "other"
        for k in ("HarvestActor", "StreamCoordinator", "Tokeniz", "raylet", "gcs_server",
                  "default_worker"):
            if k in title:
                return "ray worker" if k == "default_worker" else k
        return "ray:" + p.name()[:24]

    def _sample(self, first: bool = False) -> None:
        me = self.psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
                rss = p.memory_info().rss
            except self.psutil.Error:
                continue
            if p.pid not in self.kind:
                self.kind[p.pid] = self._kind(p)
                self.base[p.pid] = cpu if first else 0.0
            self.last[p.pid] = cpu
            k = self.kind[p.pid]
            self.peak[k] = max(self.peak.get(k, 0), rss)

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            self._sample()
            if self.at_mark is None and self.mark is not None and self.mark():
                self.at_mark, self.mark_t = self.total(), time.perf_counter() - self.t0
                self.marked = dict(self.last)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.t.join()
        self._sample()

    def total(self) -> float:
        return sum(self.last[p] - self.base[p] for p in self.last)

    def steady(self) -> float:
        """CPU after the mark (all of it without one)."""
        return self.total() - (self.at_mark or 0.0)

    def by_kind(self, steady: bool = False) -> dict:
        """CPU per process kind (`steady`: after the mark)."""
        out: dict[str, float] = {}
        for p in self.last:
            start = self.marked.get(p, self.base[p]) if steady else self.base[p]
            out[self.kind[p]] = out.get(self.kind[p], 0.0) + self.last[p] - start
        return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


TOKENS: dict[str, int] = {}   # --tokens: a shape's token count instead of its default


def _config(shape: str, store: str, name: str):
    from ..pipeline.config.run import load_config

    layers, width, tokens, C, batch, window, send, take = SHAPES[shape]
    tokens = TOKENS.get(shape, tokens)
    return load_config(data={
        "name": name, "progress": False,
        "model": {"path": shape_model(shape), "backend": "eager"},
        "data": {"source": str(corpus())},
        "packing": {"context_size": C, "max_tokens": tokens, "bos": "context"},
        "capture": {"points": ["resid_post.*"], "check_model": False},
        "store": {"url": store},
        "ray": {"num_actors": 2, "threads_per_actor": 1},
        "stream": {"name": name, "send_buffer_rows": send, "take_rows": take, "linger_s": 10},
    })


def _touch(b) -> None:
    float(b.view(-1)[0])


def stream_path(shape: str, work: Path) -> dict:
    from .. import stream

    _, _, tokens, _, batch, window, _, _ = SHAPES[shape]
    cfg = _config(shape, str(work / "unused"), f"bench-{shape}-{uuid.uuid4().hex[:6]}")
    t0 = time.perf_counter()
    ds = stream(cfg, batch_size=batch, rank=0, world_size=1, shuffle_buffer_rows=window,
                        engine_factory="harvest.benchmarks.bench_stream:PoolEngine")
    # the data plane starts with the first row the trainer receives
    with TreeCpu(mark=lambda: ds.receiver is not None and ds.receiver.rows > 0) as cpu:
        rows, first = 0, None
        for b in ds:
            _touch(b)
            rows += b.shape[0]
            first = first or time.perf_counter() - t0
        wall = time.perf_counter() - t0
        st = ds.receiver.last_status.summary if ds.receiver.last_status else None
    return _row(shape, "stream", rows, wall, cpu, first_batch_s=round(first or 0, 2),
                capture_tok_s=(st or {}).get("tokens_per_second"), trainer=ds.figures())


def store_path(shape: str, work: Path) -> dict:
    from ..pipeline.driver.run import run
    from ..store import open_store
    from ..store.read.dataset import ActivationDataset

    _, _, tokens, _, batch, window, _, _ = SHAPES[shape]
    url = str(work / f"store-{shape}")
    cfg = _config(shape, url, f"bench-{shape}-store")
    t0 = time.perf_counter()
    planned = threading.Event()   # the store exists and the first unit goes out: data plane on
    with TreeCpu(mark=planned.is_set) as cap:
        def on_event(e: dict) -> None:
            if e["event"] == "plan":
                planned.set()
        s = run(cfg, engine_factory="harvest.benchmarks.bench_stream:PoolEngine", on_event=on_event)
    t_cap = time.perf_counter() - t0
    with TreeCpu() as read:
        ds = ActivationDataset(open_store(url), batch_size=batch, shuffle_buffer_rows=window,
                               seed=0)
        rows = 0
        for b in ds:
            _touch(b)
            rows += b.shape[0]
    wall = time.perf_counter() - t0
    return _row(shape, "store", rows, wall, None, cpu_total=cap.total() + read.total(),
                steady=(cap.steady() + read.total(), wall - (cap.mark_t or 0.0)),
                capture_s=round(t_cap, 2), capture_core_s=round(cap.total(), 2),
                capture_by_kind=cap.by_kind(), steady_capture_by_kind=cap.by_kind(steady=True),
                capture_tok_s=s["tokens_per_second"],
                read_s=round(wall - t_cap, 2), read_core_s=round(read.total(), 2),
                read_by_kind=read.by_kind(), peak_rss_mb={
                    k: max(cap.peak.get(k, 0), read.peak.get(k, 0)) >> 20
                    for k in {*cap.peak, *read.peak}},
                bytes_stored=s["bytes_stored"], compression=s["compression_ratio"])


def _row(shape: str, path: str, rows: int, wall: float, cpu: "TreeCpu | None",
         cpu_total: "float | None" = None, steady: "tuple[float, float] | None" = None,
         **extra) -> dict:
    """One path's figures: everything from the first call (start-up included), and `steady`
    (core-s, seconds) from the mark on: the data plane with the engines already up."""
    layers, width = SHAPES[shape][:2]
    gb = rows * layers * width * 2 / 1e9
    core_s = cpu.total() if cpu is not None else float(cpu_total or 0.0)
    if cpu is not None:
        steady = (cpu.steady(), wall - (cpu.mark_t or 0.0))
        extra.update(by_kind=cpu.by_kind(), steady_by_kind=cpu.by_kind(steady=True),
                     peak_rss_mb={k: v >> 20 for k, v in cpu.peak.items()})
    sc, st = steady if steady is not None else (core_s, wall)
    return {"shape": shape, "path": path, "rows": rows, "gb": round(gb, 3),
            "wall_s": round(wall, 2), "rows_per_s": round(rows / wall, 1),
            "core_s": round(core_s, 2), "core_s_per_gb": round(core_s / gb, 3),
            "steady_s": round(st, 2), "steady_rows_per_s": round(rows / st, 1),
            "steady_core_s": round(sc, 2), "steady_core_s_per_gb": round(sc / gb, 3), **extra}


def run(shapes=("smollm2", "8b"), work: "str | None" = None, paths=("stream", "store")) -> dict:
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for s in shapes:
        shape_model(s)   # before timing: the pool capture is not the benchmark
    tmp = Path(work or tempfile.mkdtemp(prefix="bench-stream-", dir="/tmp"))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=3 << 30,
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    rows = []
    try:
        for s in shapes:
            for path in [{"stream": stream_path, "store": store_path}[p] for p in paths]:
                r = path(s, tmp)
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "load_average": os.getloadavg(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def table(res: dict) -> str:
    out = ["| shape | path | rows | GB of rows | wall s (after start-up) | rows/s to the trainer "
           "(after start-up) | core-s (after start-up) | core-s/GB (after start-up) "
           "| peak RSS trainer / largest worker MB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        rss = r.get("peak_rss_mb") or {}
        worker = max([v for k, v in rss.items() if k != "trainer"] or [0])
        out.append(f"| {r['shape']} | {r['path']} | {r['rows']:,} | {r['gb']:.2f} "
                   f"| {r['wall_s']:.1f} ({r['steady_s']:.1f}) "
                   f"| {r['rows_per_s']:,.0f} ({r['steady_rows_per_s']:,.0f}) "
                   f"| {r['core_s']:.1f} ({r['steady_core_s']:.1f}) "
                   f"| {r['core_s_per_gb']:.2f} ({r['steady_core_s_per_gb']:.2f}) "
                   f"| {rss.get('trainer', 0):,} / {worker:,} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per shape (default: its own)")
    ap.add_argument("--paths", nargs="*", default=["stream", "store"], choices=["stream", "store"])
    a = ap.parse_args(argv)
    if a.tokens:
        TOKENS.update({s: a.tokens for s in a.shapes})
    res = run(tuple(a.shapes), paths=tuple(a.paths))
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
