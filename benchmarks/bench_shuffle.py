"""Shuffle quality and speed of the SAE reader, against an ideal uniform draw, in one run.

Quality, per batch of an epoch: distinct documents (higher is better) and the lag-1 same-document
rate (consecutive rows of the batch from the same document; lower is better), averaged over the
epoch's full batches. The ideal is a uniform draw without replacement from the kept rows (a
random permutation of them cut into batches), averaged over a few permutations. Rows are the
default training recipe's (BOS excluded); everything else is at the reader's defaults, with 1 and
2 DataLoader workers. Targets: distinct >= 0.9 x ideal, lag-1 <= 3 x ideal.

Speed: rows/s of a shuffled epoch at num_workers=0 against the raw decode of the same shards
(`vs_raw_decode`, target >= 0.9; every shard read and decoded once, 8 threads), and with 2
persistent DataLoader workers against num_workers=0 (`new/2w` `vs_no_workers`, target >= 1.7 on
>= 4 cores; `worker_rss_mb` after each epoch), alternated over repeats, with the page cache warm
for both (the store fits in RAM: this measures the reader's own CPU, the part a change to
sampling could slow down). Each reader is one dataset whose first epoch is reported apart
(`first_epoch`): it pays the first touch of its buffers, about 2 s per GiB on these VMs, which a
training process pays once; the timed epochs are the steady state, as in bench_store.

`--baseline REV` loads pipeline/store/reader.py of that git revision (e.g. the commit before the
new sampler) as a second reader and measures it the same way in the same run, so before/after
ratios share the machine's load.

The store: one point of width 576 (SmolLM2), contexts of 128 tokens starting with BOS, documents
of lognormal lengths (median ~300 tokens) packed across context boundaries, like the default
run; `--rows` rows (default 2^19, 0.6 GB: a store that fits one default shuffle window, the
small-store case where a whole-shard split narrowed each worker's batches).

    .venv/bin/python -m harvest.benchmarks.bench_shuffle [--rows 524288] [--repeats 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BOS, CTX, WIDTH, BATCH = 1, 128, 576, 4096


def _meta(n_rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(300), 1.0, n_rows // 50 + 10).astype(np.int64))
    doc_of_token = np.repeat(np.arange(lengths.size), lengths)
    body = n_rows // CTX * (CTX - 1)
    doc = np.full(n_rows, -2, np.int64)
    mask = np.arange(n_rows) % CTX != 0
    doc[mask] = doc_of_token[:body]
    tok = rng.integers(2, 49152, n_rows).astype(np.int32)
    tok[~mask] = BOS
    return tok, doc, np.where(mask, 0, -2).astype(np.int32)


def build_store(path: str, n_rows: int):
    from harvest.pipeline.store import create_store

    s = create_store(path, points=["resid_post.20"], width=WIDTH, n_rows=n_rows,
                     attrs={"config": {"packing": {"context_size": CTX}}}, overwrite=True)
    tok, doc, pos = _meta(n_rows)
    s.write_plan(s.default_plan(1))
    rng = np.random.default_rng(1)
    import ml_dtypes

    for u in s.plan():
        a, b = u["row_start"], u["row_end"]
        w = s.region_writer(u["unit_id"], a, b)
        w.write_meta(a, tok[a:b], doc[a:b], pos[a:b])
        w.write(a, rng.standard_normal((1, b - a, WIDTH), np.float32).astype(ml_dtypes.bfloat16))
        w.commit()
    return s, doc, tok


def load_reader(rev: str):
    """ActivationDataset of pipeline/store/reader.py at git revision `rev`, as a second module."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:pipeline/store/reader.py"], check=True,
                         capture_output=True, text=True).stdout
    f = Path(tempfile.mkdtemp()) / "reader_baseline.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("harvest.pipeline.store._reader_baseline", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.ActivationDataset


def _batch_stats(docs: list[np.ndarray]) -> dict:
    full = [d for d in docs if d.shape[0] == BATCH]
    return {"distinct_docs": float(np.mean([np.unique(d).size for d in full])),
            "lag1_same_doc": float(np.mean([(d[1:] == d[:-1]).mean() for d in full])), "batches": len(full)}


def ideal(doc: np.ndarray, tok: np.ndarray, perms: int = 3) -> dict:
    kept = doc[tok != BOS]
    rng = np.random.default_rng(7)
    runs = [_batch_stats([p[i:i + BATCH] for i in range(0, p.size, BATCH)])
            for p in (kept[rng.permutation(kept.size)] for _ in range(perms))]
    return {k: float(np.mean([r[k] for r in runs])) for k in ("distinct_docs", "lag1_same_doc")}


def quality(Dataset, url: str, workers: int, **kw) -> dict:
    import torch

    ds = Dataset(url, batch_size=BATCH, seed=0, exclude_token_ids=[BOS], return_meta=True, **kw)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return _batch_stats([b["doc_id"].numpy() for b in dl])


def speed(ds, epoch: int) -> float:
    ds.set_epoch(epoch)
    t = time.perf_counter()
    n = sum(b.shape[0] for b in ds)
    return n / (time.perf_counter() - t)


def _note_pid(pids):
    def init(wid):
        pids[wid] = os.getpid()
    return init


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int([ln for ln in f if ln.startswith("VmRSS")][0].split()[1]) / 1024


def loader_speed(ds, workers: int, epochs: int, first: int = 1):
    """rows/s of each epoch through a persistent DataLoader, and each worker's RSS (MB) after
    each epoch: the first epoch pays worker start and the first touch of the arenas."""
    import torch

    pids = torch.zeros(workers, dtype=torch.int64).share_memory_()
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True,
                                     worker_init_fn=_note_pid(pids))
    rates, rss = [], []
    for e in range(first, first + epochs):
        ds.set_epoch(e)
        t = time.perf_counter()
        n = sum(b.shape[0] for b in dl)
        rates.append(n / (time.perf_counter() - t))
        rss.append([_rss_mb(int(p)) for p in pids])
    del dl
    return rates, rss


def peak_rss_mb(rev: str | None, url: str, **kw) -> float:
    """Peak resident memory (MB) of a fresh process that reads one shuffled epoch, above what it
    had after its imports: what the reader holds while shuffling."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child of a big parent
    # starts with the parent's peak
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "def hwm():\n"
            "    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
            "from harvest.benchmarks.bench_shuffle import load_reader\n"
            "from harvest.pipeline.store.reader import ActivationDataset as D\n"
            + (f"D = load_reader({rev!r})\n" if rev else "")
            + "base = hwm()\n"
            + f"ds = D({url!r}, batch_size={BATCH}, seed=0, **{kw!r})\n"
            "n = sum(b.shape[0] for b in ds)\n"
            "print((hwm() - base) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def raw_decode(store) -> float:
    import concurrent.futures as cf

    out = np.empty((store.shard_rows, WIDTH), np.uint16)
    outs = [out.copy() for _ in range(8)]
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: store.read_shard("resid_post.20", i, out=outs[i % 8][:store.shard_range(i)[1]
                                                                                  - store.shard_range(i)[0]]),
                    range(store.n_shards)))
    return store.n_rows / (time.perf_counter() - t)


def run(rows: int = 1 << 19, repeats: int = 3, baseline: str | None = None, root: str | None = None) -> dict:
    from harvest.pipeline.store.reader import ActivationDataset

    root = root or tempfile.mkdtemp(prefix="bench-shuffle-")
    url = os.path.join(root, "store.zarr")
    s, doc, tok = build_store(url, rows)
    readers = {"new": ActivationDataset}
    if baseline:
        readers["baseline"] = load_reader(baseline)
    out = {"rows": rows, "width": WIDTH, "context": CTX, "batch_size": BATCH, "shard_rows": s.shard_rows,
           "shards": s.n_shards, "docs": int(np.unique(doc[doc >= 0]).size), "ideal": ideal(doc, tok),
           "quality": {}, "speed": {}}
    # default settings (targets), then a window of a quarter of the store (no target: shows that
    # two workers streaming their own windows draw from as many shards as one worker does)
    for window, suffix in ((None, ""), (rows // 4, " window=1/4")):
        for name, D in readers.items():
            for w in (0, 2):
                q = quality(D, url, w, **({"shuffle_buffer_rows": window} if window else {}))
                q["vs_ideal"] = {"distinct_docs": q["distinct_docs"] / out["ideal"]["distinct_docs"],
                                 "lag1_same_doc": q["lag1_same_doc"] / out["ideal"]["lag1_same_doc"]}
                out["quality"][f"{name}/{max(1, w)}w{suffix}"] = q
    for window, label in ((None, "default"), (rows // 4, "window=1/4")):
        kw = {"shuffle_buffer_rows": window} if window else {}
        out.setdefault("peak_rss_mb", {})[label] = {
            "new": peak_rss_mb(None, url, **kw), **({"baseline": peak_rss_mb(baseline, url, **kw)} if baseline else {}),
            "store_mb": rows * WIDTH * 2 / 2**20}
    # two DataLoader workers against the no-worker rate of the same reader, both in this run
    # (target 1.7x on >= 4 cores: each worker decodes only its part; shown here on os.cpu_count())
    rates, rss = loader_speed(ActivationDataset(url, batch_size=BATCH, seed=0), 2, repeats + 1)
    datasets = {name: D(url, batch_size=BATCH, seed=0) for name, D in readers.items()}
    first = {name: speed(ds, 0) for name, ds in datasets.items()}
    speeds = {name: [] for name in readers}
    speeds["raw_decode"] = []
    for r in range(repeats):
        speeds["raw_decode"].append(raw_decode(s))
        for name, ds in datasets.items():
            speeds[name].append(speed(ds, r + 1))
    out["speed"] = {k: {"rows_per_s": float(np.median(v)), "runs": v} for k, v in speeds.items()}
    for name, v in first.items():
        out["speed"][name]["first_epoch"] = v
    for name in readers:
        out["speed"][name]["vs_raw_decode"] = out["speed"][name]["rows_per_s"] / out["speed"]["raw_decode"]["rows_per_s"]
    out["speed"]["new/2w"] = {"rows_per_s": float(np.median(rates[1:])), "runs": rates[1:],
                              "first_epoch": rates[0], "cpus": os.cpu_count(), "worker_rss_mb": rss}
    out["speed"]["new/2w"]["vs_no_workers"] = out["speed"]["new/2w"]["rows_per_s"] / out["speed"]["new"]["rows_per_s"]
    if baseline:  # each repeat ran both back to back: the median of their ratios shares the load
        out["speed"]["new"]["vs_baseline_paired"] = float(np.median(
            [a / b for a, b in zip(speeds["new"], speeds["baseline"])]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 19)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="git revision of a reader to compare with")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = run(a.rows, a.repeats, a.baseline)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
