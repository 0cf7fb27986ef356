"""Shuffle quality and speed of the SAE reader, against an ideal uniform draw, in one run.

Quality, per batch of an epoch: distinct documents (higher is better) and the lag-1 same-document
rate (consecutive rows of the batch from the same document; lower is better), averaged over the
epoch's full batches. The ideal is a uniform draw without replacement from the kept rows (a
random permutation of them cut into batches), averaged over a few permutations. Rows are the
default training recipe's (BOS excluded); everything else is at the reader's defaults, with 1 and
2 DataLoader workers. Targets: distinct >= 0.9 x ideal, lag-1 <= 3 x ideal.

Speed, in one invocation: rows/s of a shuffled epoch at num_workers=0 against two raw decodes of
the same shards, each reading every shard once: `raw_decode` (our checked whole-shard decode,
Store.read_shard, 8 threads) and `zarr_decode` (zarr-python reading whole shards, the reference
issue 22 named); `vs_raw_decode` / `vs_zarr_decode` are medians of per-repeat ratios (each repeat
runs all of them back to back, target >= 0.9), `cpu_vs_raw_decode` the same for process
CPU-seconds (stable when other jobs share the cores; wall ratios then depend on how many threads
each side runs). Then 2 persistent DataLoader workers against num_workers=0 (`new/2w`,
`vs_no_workers`, target >= 1.7 on >= 4 cores; on fewer cores the scaling shows as
`decoded_rows` (each worker decodes about half) and `cpu_s_per_row` (the workers' CPU per row
delivered, against the no-worker figure), and `worker_rss_mb` after each of `--epochs` epochs
(target: within 10 % of epoch 1). Page cache warm for all (the store fits in RAM: this
measures the reader's own CPU). Each reader is one dataset whose first epoch is reported apart
(`first_epoch`): it pays the first touch of its buffers, about 2 s per GiB on these VMs, which a
training process pays once; the timed epochs are the steady state, as in bench_store.

`--baseline REV` loads store/read/dataset.py of that git revision (e.g. the commit before the
new sampler) as a second reader and measures it the same way in the same run, so before/after
ratios share the machine's load.

The store: one point of width 576 (SmolLM2), contexts of 128 tokens starting with BOS, documents
of lognormal lengths (median ~300 tokens) packed across context boundaries, like the default
run; `--rows` rows (default 2^19, 0.6 GB: a store that fits one default shuffle window, the
small-store case where a whole-shard split narrowed each worker's batches).

    .venv/bin/python -m harvest.benchmarks.bench_shuffle [--rows 524288] [--repeats 5] [--epochs 10]
        [--baseline REV] [--speed-only]
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
import torch

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


SHARD_ROWS = 16384


def build_store(path: str, n_rows: int, width: int = WIDTH, shard_rows: int = SHARD_ROWS):
    from ..store import create_store

    # 16,384-row shards (18 MiB at width 576), fixed: the figures in RESULTS.md (32 shards at 2^19
    # rows) and the window/worker split they describe stay comparable across layout policies
    # (the default policy now makes ~128 MiB shards: 4 of them here, too few to shuffle across)
    s = create_store(path, points=["resid_post.20"], width=width, n_rows=n_rows,
                     shard_rows=min(shard_rows, n_rows),
                     attrs={"config": {"packing": {"context_size": CTX}}}, overwrite=True)
    tok, doc, pos = _meta(n_rows)
    s.ledger.write_plan(s.ledger.default_plan(1))
    rng = np.random.default_rng(1)
    import ml_dtypes

    for u in s.ledger.plan():
        a, b = u["row_start"], u["row_end"]
        w = s.region_writer(u["unit_id"], a, b)
        w.write_meta(a, tok[a:b], doc[a:b], pos[a:b])
        w.write(a, rng.standard_normal((1, b - a, width), np.float32).astype(ml_dtypes.bfloat16))
        w.commit()
    return s, doc, tok


def load_reader(rev: str):
    """ActivationDataset of store/read/dataset.py at git revision `rev`, as a second module."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:store/read/dataset.py"], check=True,
                         capture_output=True, text=True).stdout
    f = Path(tempfile.mkdtemp()) / "reader_baseline.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("harvest.store._reader_baseline", f)
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


def timed(fn) -> tuple[float, float]:
    """(wall s, this process's CPU s, all threads) of fn()."""
    c, t = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def epoch_of(ds, epoch: int):
    def go():
        ds.set_epoch(epoch)
        go.rows = sum(b.shape[0] for b in ds)
    return go


def _note_pid(pids):
    def init(wid):
        pids[wid] = os.getpid()
    return init


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int([ln for ln in f if ln.startswith("VmRSS")][0].split()[1]) / 1024


def _uss_mb(pid: int) -> float:
    """Private memory of a process (MB): RSS less the pages it shares, e.g. with the parent it
    was forked from (RSS counts a forked worker's copy-on-write view of the parent's arenas)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(ln.split()[1]) for ln in f if ln.startswith(("Private_Clean", "Private_Dirty"))) / 1024


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loader_speed(ds, workers: int, epochs: int, first: int = 1) -> dict:
    """Per epoch through a persistent DataLoader: rows/s, each worker's RSS (MB) and CPU seconds
    per row delivered; the first epoch pays worker start and the first touch of the arenas."""
    import torch

    pids = torch.zeros(workers, dtype=torch.int64).share_memory_()
    dl = ds.loader(workers, persistent_workers=True, worker_init_fn=_note_pid(pids))
    rates, rss, uss, cpu = [], [], [], []
    before = None
    for e in range(first, first + epochs):
        ds.set_epoch(e)
        t = time.perf_counter()
        n = sum(b.shape[0] for b in dl)
        rates.append(n / (time.perf_counter() - t))
        now = [_cpu_s(int(p)) for p in pids]
        if before is not None:
            cpu.append(sum(now) - sum(before))
        before = now
        rss.append([_rss_mb(int(p)) for p in pids])
        uss.append([_uss_mb(int(p)) for p in pids])
    del dl
    return {"rates": rates, "rss": rss, "uss": uss, "cpu_s_per_row": float(np.median(cpu)) / n if cpu else None,
            "decoded_rows": ds.decoded_rows[:workers], "rows_per_epoch": n}


class _Batches(torch.utils.data.IterableDataset):
    """`n` batches of `k` x `width` bf16, gathered into the worker's recycled buffers (the
    reader's own path) and handed over through shared-memory slots (`handoff=True`, as
    ActivationLoader does) or torch's pickling (a plain DataLoader): the hand-off alone."""

    resume_point = 0

    def __init__(self, n: int, k: int, width: int):
        from ..store.format.dtypes import BF16, raw_dtype

        super().__init__()
        self.n, self.batch_size, self.width, self.points = n, k, width, ["p"]
        self.quantized, self.dequantize, self.norm_constants = False, True, None
        self.store_dtype, self.out_dtype = BF16, torch.bfloat16
        self.row_width, self.raw_dtype = width, raw_dtype(BF16)
        self.handoff_rings = None

    def __iter__(self):
        from ..store.read.feed import handoff
        from ..store.read.feed.batching import BatchBuffers

        hand = handoff.worker_side(self, torch.utils.data.get_worker_info())
        shape = (self.batch_size, 1, self.width)
        bufs = hand.buffers if hand is not None and hand.buffers is not None else \
            BatchBuffers(shape, self.raw_dtype, keep=6)
        for i in range(self.n):
            out = bufs.get()
            out[:, 0, :1] = i      # the gather writes every row; here one value per row
            t = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)[:, 0, :]
            yield t if hand is None else hand.pack(t)


def handoff_cost(width: int = WIDTH, batches: int = 200, repeats: int = 3) -> dict:
    """Hand-off alone, 1 persistent worker (started and warmed by one epoch first): us per row
    from worker to trainer, torch's path against the shared-memory slots, each less the same
    loop run in this process (the consumer reads one value of every row, so every page it
    receives is touched); all three side by side in each repeat, medians of the per-repeat
    differences. `us_per_row` is wall time, `cpu_us_per_row` the CPU of trainer + worker (the
    figure to trust when other jobs share the cores). GB/s = row bytes / wall time."""
    from ..store.read.feed.loader import ActivationLoader

    ds = _Batches(batches, BATCH, width)

    def consume(loader) -> None:
        for x in loader:
            float(x[:, 0].float().sum())

    def one(loader, pid=None) -> tuple[float, float]:
        c0, w0, t = time.process_time(), _cpu_s(pid) if pid else 0.0, time.perf_counter()
        consume(loader)
        wall, cpu = time.perf_counter() - t, time.process_time() - c0 + ((_cpu_s(pid) - w0) if pid else 0.0)
        return wall / (batches * BATCH), cpu / (batches * BATCH)

    loaders = {}
    for name in ("torch", "slots"):
        pids = torch.zeros(1, dtype=torch.int64).share_memory_()
        kw = {"num_workers": 1, "persistent_workers": True, "worker_init_fn": _note_pid(pids)}
        loaders[name] = (torch.utils.data.DataLoader(ds, batch_size=None, **kw) if name == "torch"
                         else ActivationLoader(ds, **kw), pids)
        consume(loaders[name][0])     # start the worker, warm its buffers
    per: dict = {"in_process": [], "torch": [], "slots": []}
    for _ in range(repeats):
        per["in_process"].append(one(ds))
        for name, (dl, pids) in loaders.items():
            per[name].append(one(dl, int(pids[0])))
    row_bytes = width * 2
    out: dict = {"width": width, "batch_rows": BATCH, "batches": batches,
                 "in_process_us_per_row": float(np.median([w for w, _ in per["in_process"]])) * 1e6}
    for k in ("torch", "slots"):   # hand-off = through a worker less the same loop in-process
        us = float(np.median([x[0] - y[0] for x, y in zip(per[k], per["in_process"])])) * 1e6
        cpu = float(np.median([x[1] - y[1] for x, y in zip(per[k], per["in_process"])])) * 1e6
        out[k] = {"us_per_row": us, "cpu_us_per_row": cpu, "gb_per_s": row_bytes / max(us, 1e-9) / 1e3,
                  "runs_us": [x[0] * 1e6 for x in per[k]]}
    out["speedup"] = out["torch"]["us_per_row"] / max(out["slots"]["us_per_row"], 1e-9)
    del loaders
    return out


def workers_paired(url: str, repeats: int) -> dict:
    """2 persistent workers through ActivationLoader (shared-memory slots) and through a plain
    DataLoader (torch's pickling) against no workers, epoch after epoch in turn (each repeat runs
    all three back to back); ratios are medians of per-repeat rate ratios. Load average noted."""
    from ..store.read.dataset import ActivationDataset

    ds0 = ActivationDataset(url, batch_size=BATCH, seed=0)
    dss = {k: ActivationDataset(url, batch_size=BATCH, seed=0) for k in ("slots", "torch")}
    loaders = {"slots": dss["slots"].loader(2, persistent_workers=True),
               "torch": torch.utils.data.DataLoader(dss["torch"], batch_size=None, num_workers=2,
                                                    persistent_workers=True)}

    def epoch(it, ds, e) -> float:
        ds.set_epoch(e)
        t = time.perf_counter()
        n = sum(b.shape[0] for b in it)
        return n / (time.perf_counter() - t)

    for k, dl in loaders.items():    # start the workers and warm their buffers
        epoch(dl, dss[k], 0)
    epoch(ds0, ds0, 0)
    load = [os.getloadavg()[0]]
    rates: dict = {"none": [], "slots": [], "torch": []}
    for r in range(repeats):
        rates["none"].append(epoch(ds0, ds0, r + 1))
        for k, dl in loaders.items():
            rates[k].append(epoch(dl, dss[k], r + 1))
    load.append(os.getloadavg()[0])
    del loaders
    return {"rows_per_s": {k: float(np.median(v)) for k, v in rates.items()}, "runs": rates,
            "slots_vs_none": float(np.median([a / b for a, b in zip(rates["slots"], rates["none"])])),
            "torch_vs_none": float(np.median([a / b for a, b in zip(rates["torch"], rates["none"])])),
            "cpus": os.cpu_count(), "load_average_1min": load}


def peak_rss_mb(rev: str | None, url: str, **kw) -> float:
    """Peak resident memory (MB) of a fresh process that reads one shuffled epoch, above what it
    had after its imports: what the reader holds while shuffling."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child of a big parent
    # starts with the parent's peak
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "def hwm():\n"
            "    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
            "from harvest.benchmarks.bench_shuffle import load_reader\n"
            "from harvest.store.read.dataset import ActivationDataset as D\n"
            + (f"D = load_reader({rev!r})\n" if rev else "")
            + "base = hwm()\n"
            + f"ds = D({url!r}, batch_size={BATCH}, seed=0, **{kw!r})\n"
            "n = sum(b.shape[0] for b in ds)\n"
            "print((hwm() - base) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def raw_decoder(store):
    """fn() reading, checking and decoding every shard once (Store.read_shard), 8 threads, into 8
    destination buffers made here, outside the timing (the reader's arenas are warm too)."""
    import concurrent.futures as cf

    outs = [np.ones((store.shard_rows, WIDTH), np.uint16) for _ in range(8)]

    def one(i):
        a, b = store.shard_range(i)
        store.read_shard("resid_post.20", i, out=outs[i % 8][:b - a])

    def run():
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(one, range(store.n_shards)))
    return run


def gatherer(store):
    """fn() doing the one pass a shuffling reader adds to the decode: every row copied once, in a
    random order, into batch-sized buffers (np.take from a warm arena, this thread). Raw decode
    plus this pass is the floor for any reader that yields uniformly mixed batches."""
    arena = np.ones((store.n_rows, WIDTH), np.uint16)
    perm = np.random.default_rng(0).permutation(store.n_rows)
    outs = [np.ones((BATCH, WIDTH), np.uint16) for _ in range(2)]

    def run():
        for j, i in enumerate(range(0, store.n_rows - BATCH + 1, BATCH)):
            np.take(arena, perm[i:i + BATCH], axis=0, out=outs[j % 2])
    return run


def zarr_decode(store) -> None:
    """Every shard read and decoded once by zarr-python (whole-shard slices, its own threads)."""
    arr = store.array("resid_post.20")
    for i in range(store.n_shards):
        a, b = store.shard_range(i)
        arr[a:b]


# Layouts whose mixing is measured from metadata (describe()): the SmolLM2 run's store (width 576,
# the default ~128 MiB shards) and an 8B model's (width 4096, 128 MiB shards), each 4 default
# windows long. Mixing depends on rows, shards, documents and batch only, so the store is built
# 8 wide with the real layout's shard_rows and the default buffer of the real width passed as
# shuffle_buffer_rows; memory is stated for the real width.
SHAPES = {"smollm2": (576, 116_480), "8b": (4096, 16_384)}
_BUFFER_BYTES = 1 << 30    # the reader's default shuffle buffer per process


def shape_quality(root: str, shape: str, windows: int = 4, batches: int = 32) -> dict:
    """Distinct documents per batch at the default options (window shuffle) and in global mode,
    by describe() (expected and simulated from the metadata), against the ideal uniform draw
    measured as above, with 1 and 2 DataLoader workers; memory at the real width. Also the
    default options on a shuffled copy of the store (store/shuffled_copy.py, `harvest shuffle`),
    and the copy's seconds at this 8-wide miniature (`shuffle_s`)."""
    from ..store.read.dataset import ActivationDataset

    width, shard_rows = SHAPES[shape]
    buf = _BUFFER_BYTES // (2 * width)
    win = -(-buf // shard_rows)
    rows = windows * win * shard_rows
    url = os.path.join(root, f"shape-{shape}.zarr")
    s, doc, tok = build_store(url, rows, width=8, shard_rows=shard_rows)
    ideal_q = ideal(doc, tok, perms=2)
    shard_bytes = shard_rows * width * 2
    out = {"width": width, "shard_rows": shard_rows, "shard_mib": shard_bytes / 2**20, "rows": rows,
           "shards": s.n_shards, "windows": windows, "buffer_rows": buf, "ideal": ideal_q,
           "memory_mib": {"window": 2 * win * shard_bytes / 2**20,
                          "global": (buf // BATCH * BATCH * width * 2 + 4 * shard_bytes) / 2**20}}
    for mode in (True, "global"):
        ds = ActivationDataset(url, batch_size=BATCH, seed=0, exclude_token_ids=[BOS], shuffle=mode,
                               shuffle_buffer_rows=buf)
        for w in (0, 2):
            d = ds.describe(num_workers=w, batches=batches)
            d["vs_ideal"] = d["simulated"]["distinct_docs"] / ideal_q["distinct_docs"]
            out[f"{'global' if mode == 'global' else 'default'}/{max(1, w)}w"] = d
    from ..store.shuffled_copy import shuffle_store

    t = time.perf_counter()
    shuffle_store(url, url + "-shuffled", seed=0)
    out["shuffle_s"] = time.perf_counter() - t
    copy = ActivationDataset(url + "-shuffled", batch_size=BATCH, seed=0, exclude_token_ids=[BOS],
                             shuffle_buffer_rows=buf)
    for w in (0, 2):
        d = copy.describe(num_workers=w, batches=batches)
        d["vs_ideal"] = d["simulated"]["distinct_docs"] / ideal_q["distinct_docs"]
        out[f"shuffled_copy/{max(1, w)}w"] = d
    return out


def _quality(out: dict, readers: dict, url: str, rows: int) -> None:
    # default settings (targets), then a window of a quarter of the store (no target: shows that
    # two workers streaming their own windows draw from as many shards as one worker does)
    from ..store.read.dataset import ActivationDataset

    variants = [(name, D, {}) for name, D in readers.items()] + [("global", ActivationDataset, {"shuffle": "global"})]
    for window, suffix in ((None, ""), (rows // 4, " window=1/4")):
        for name, D, extra in variants:
            for w in (0, 2):
                q = quality(D, url, w, **extra, **({"shuffle_buffer_rows": window} if window else {}))
                q["vs_ideal"] = {"distinct_docs": q["distinct_docs"] / out["ideal"]["distinct_docs"],
                                 "lag1_same_doc": q["lag1_same_doc"] / out["ideal"]["lag1_same_doc"]}
                out["quality"][f"{name}/{max(1, w)}w{suffix}"] = q


def _speed(s, url: str, readers: dict, repeats: int, epochs: int) -> dict:
    from ..store.read.dataset import ActivationDataset

    # two persistent DataLoader workers first, while this process holds no arenas that forked
    # workers would map (their RSS would count them); target 1.7x the no-worker rate on >= 4
    # cores, each worker decoding only its part: shown here on os.cpu_count()
    lw = loader_speed(ActivationDataset(url, batch_size=BATCH, seed=0), 2, epochs)

    datasets = {name: D(url, batch_size=BATCH, seed=0) for name, D in readers.items()}
    # global against the window shuffle, at a buffer of a quarter of the store (4 blocks, each
    # reading every shard) and at the default (one block: every shard read once)
    quarter = {"shuffle_buffer_rows": s.n_rows // 4}
    datasets.update({"window/4": ActivationDataset(url, batch_size=BATCH, seed=0, **quarter),
                     "global/4": ActivationDataset(url, batch_size=BATCH, seed=0, shuffle="global", **quarter),
                     "global": ActivationDataset(url, batch_size=BATCH, seed=0, shuffle="global")})
    first = {name: timed(epoch_of(ds, 0)) for name, ds in datasets.items()}
    fns = {"raw_decode": raw_decoder(s), "zarr_decode": lambda: zarr_decode(s), "gather_pass": gatherer(s)}
    times: dict = {k: [] for k in [*fns, *datasets]}
    for r in range(repeats):    # every side once per repeat, back to back: ratios share the load
        for k, f in fns.items():
            times[k].append(timed(f))
        for name, ds in datasets.items():
            times[name].append(timed(epoch_of(ds, r + 1)))
    n = s.n_rows
    sp = {k: {"rows_per_s": float(np.median([n / w for w, _ in v])), "runs": [n / w for w, _ in v],
              "cpu_s_per_row": float(np.median([c for _, c in v])) / n} for k, v in times.items()}

    def paired(a: str, b: str, i: int) -> float:   # median over repeats of time(b) / time(a)
        return float(np.median([y[i] / x[i] for x, y in zip(times[a], times[b])]))

    for name in datasets:
        sp[name]["first_epoch"] = n / first[name][0]
        sp[name]["vs_raw_decode"] = paired(name, "raw_decode", 0)
        sp[name]["vs_zarr_decode"] = paired(name, "zarr_decode", 0)
        sp[name]["cpu_vs_raw_decode"] = paired(name, "raw_decode", 1)
        sp[name]["cpu_vs_zarr_decode"] = paired(name, "zarr_decode", 1)
    # the floor: raw decode then one gather pass, in CPU-seconds (the two could overlap in wall)
    floor = [a[1] + g[1] for a, g in zip(times["raw_decode"], times["gather_pass"])]
    for name in datasets:
        sp[name]["cpu_vs_decode_plus_gather"] = float(np.median([f / x[1] for f, x in zip(floor, times[name])]))
    if "baseline" in datasets:
        sp["new"]["vs_baseline_paired"] = paired("new", "baseline", 0)
    for g, w in (("global", "new"), ("global/4", "window/4")):   # rate of global / rate of window
        sp[g]["vs_window"] = paired(g, w, 0)
        sp[g]["decoded_vs_window"] = datasets[g].decoded_rows[0] / max(1, datasets[w].decoded_rows[0])

    def growth(series):   # largest per-worker value over the epochs, relative to epoch 1's
        return max(max(r[w] / series[0][w] for w in range(len(r))) for r in series) - 1

    rate = float(np.median(lw["rates"][1:]))
    sp["new/2w"] = {"rows_per_s": rate, "runs": lw["rates"][1:], "first_epoch": lw["rates"][0],
                    "cpus": os.cpu_count(), "vs_no_workers": rate / sp["new"]["rows_per_s"],
                    "cpu_s_per_row": lw["cpu_s_per_row"],
                    "decoded_rows_per_worker_per_epoch": [d / epochs for d in lw["decoded_rows"]],
                    "rows_per_epoch": lw["rows_per_epoch"], "worker_rss_mb": lw["rss"],
                    "worker_private_mb": lw["uss"], "worker_rss_growth_vs_epoch1": growth(lw["rss"]),
                    "worker_private_growth_vs_epoch1": growth(lw["uss"])}
    return sp


def run(rows: int = 1 << 19, repeats: int = 5, baseline: str | None = None, root: str | None = None,
        epochs: int = 10, speed_only: bool = False, shapes: tuple = ()) -> dict:
    from ..store.read.dataset import ActivationDataset

    root = root or tempfile.mkdtemp(prefix="bench-shuffle-")
    url = os.path.join(root, "store.zarr")
    s, doc, tok = build_store(url, rows)
    readers = {"new": ActivationDataset}
    if baseline:
        readers["baseline"] = load_reader(baseline)
    out = {"rows": rows, "width": WIDTH, "context": CTX, "batch_size": BATCH, "shard_rows": s.shard_rows,
           "shards": s.n_shards, "docs": int(np.unique(doc[doc >= 0]).size), "ideal": ideal(doc, tok),
           "quality": {}, "speed": {}}
    if not speed_only:
        _quality(out, readers, url, rows)
        for window, label in ((None, "default"), (rows // 4, "window=1/4")):
            kw = {"shuffle_buffer_rows": window} if window else {}
            out.setdefault("peak_rss_mb", {})[label] = {
                "new": peak_rss_mb(None, url, **kw),
                **({"baseline": peak_rss_mb(baseline, url, **kw)} if baseline else {}),
                "store_mb": rows * WIDTH * 2 / 2**20}
    out["handoff"] = handoff_cost(WIDTH, batches=max(8, min(200, rows // BATCH)), repeats=repeats)
    out["workers_paired"] = workers_paired(url, repeats)
    out["shapes"] = {sh: shape_quality(root, sh) for sh in shapes}
    out["speed"] = _speed(s, url, readers, repeats, epochs)
    return out


def _mb(values) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def summary(res: dict) -> str:
    """The two targets side by side, one line each."""
    sp, w2 = res["speed"]["new"], res["speed"]["new/2w"]
    return "\n".join([
        f"reader, no workers: {sp['rows_per_s']:,.0f} rows/s = {sp['vs_raw_decode']:.2f}x raw decode "
        f"({res['speed']['raw_decode']['rows_per_s']:,.0f}), {sp['vs_zarr_decode']:.2f}x zarr-python "
        f"({res['speed']['zarr_decode']['rows_per_s']:,.0f}); CPU {sp['cpu_vs_raw_decode']:.2f}x / "
        f"{sp['cpu_vs_zarr_decode']:.2f}x, {sp['cpu_vs_decode_plus_gather']:.2f}x raw decode + one gather pass "
        f"(target >= 0.9x)",
        f"reader, 2 workers: {w2['rows_per_s']:,.0f} rows/s = {w2['vs_no_workers']:.2f}x no workers on "
        f"{w2['cpus']} cores (target >= 1.7x on >= 4); rows decoded per worker per epoch "
        f"{[int(d) for d in w2['decoded_rows_per_worker_per_epoch']]} of {w2['rows_per_epoch']:,}; "
        f"workers' CPU {w2['cpu_s_per_row'] * 1e6:.2f} us/row vs {sp['cpu_s_per_row'] * 1e6:.2f} with none",
        f"worker memory over {len(w2['worker_rss_mb'])} epochs: RSS {_mb(w2['worker_rss_mb'][0])} -> "
        f"{_mb(w2['worker_rss_mb'][-1])} MB (max {100 * w2['worker_rss_growth_vs_epoch1']:+.1f} % of epoch 1), "
        f"private {_mb(w2['worker_private_mb'][0])} -> {_mb(w2['worker_private_mb'][-1])} MB "
        f"(max {100 * w2['worker_private_growth_vs_epoch1']:+.1f} %; target within 10 %)",
        _handoff_line(res["handoff"]), _workers_line(res["workers_paired"]), *_global_lines(res),
        *_shape_lines(res)])


def _workers_line(w: dict) -> str:
    return (f"2 workers vs none, epochs in turn: {w['slots_vs_none']:.2f}x through shared-memory slots, "
            f"{w['torch_vs_none']:.2f}x through torch's pickling, on {w['cpus']} cores (target >= 0.95x "
            f"on 2 cores; load average {w['load_average_1min'][0]:.1f} -> {w['load_average_1min'][1]:.1f})")


def _global_lines(res: dict) -> list[str]:
    sp, q = res["speed"], res.get("quality", {})
    lines = [f"global shuffle: {sp['global/4']['rows_per_s']:,.0f} rows/s = {sp['global/4']['vs_window']:.2f}x "
             f"the window shuffle at a buffer of 1/4 of the store (decodes {sp['global/4']['decoded_vs_window']:.1f}x "
             f"the rows); at the default buffer {sp['global']['vs_window']:.2f}x "
             f"({sp['global']['decoded_vs_window']:.1f}x the rows)"]
    if "global/1w" in q:
        lines.append("documents per batch vs ideal: " + ", ".join(
            f"{k} {v['vs_ideal']['distinct_docs']:.2f}" for k, v in q.items()))
    return lines


def _shape_lines(res: dict) -> list[str]:
    out = []
    for sh, r in res.get("shapes", {}).items():
        out.append(f"{sh} layout (width {r['width']}, {r['shard_mib']:.0f} MiB shards, {r['shards']} shards = "
                   f"{r['windows']} default windows): documents per batch vs ideal "
                   + ", ".join(f"{k} {r[k]['vs_ideal']:.2f}" for k in ("default/1w", "default/2w", "global/1w",
                                                                        "global/2w", "shuffled_copy/1w",
                                                                        "shuffled_copy/2w") if k in r)
                   + f"; memory per process window {r['memory_mib']['window']:.0f} MiB, "
                   f"global {r['memory_mib']['global']:.0f} MiB")
    return out


def _handoff_line(h: dict) -> str:
    sl, tp = h["slots"], h["torch"]
    return (f"hand-off worker -> trainer at width {h['width']}: {sl['us_per_row']:.3f} us/row "
            f"({sl['gb_per_s']:.1f} GB/s; CPU {sl['cpu_us_per_row']:.3f} us/row) through shared-memory "
            f"slots against {tp['us_per_row']:.2f} us/row (CPU {tp['cpu_us_per_row']:.2f}) through "
            f"torch's pickling (target <= 0.3 us/row)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 19)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10, help="epochs of the 2-worker run (RSS per epoch)")
    ap.add_argument("--speed-only", action="store_true", help="skip the shuffle quality and peak RSS")
    ap.add_argument("--baseline", default=None, help="git revision of a reader to compare with")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES),
                    help="layouts whose mixing is measured from metadata (4 default windows each)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = run(a.rows, a.repeats, a.baseline, epochs=a.epochs, speed_only=a.speed_only, shapes=tuple(a.shapes))
    text = json.dumps(res, indent=1)
    print(text)
    print(summary(res))
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
