"""gpu_torch_check parts 3 and 4: the store writer's host cost per captured GB, and the reader
feeding a TopK SAE trained on the GPU.

Both need zarr (the GPU host has none: it travels as wheels, see docs/benchmarks.md); without it
each part reports "skipped: no zarr" instead of failing or passing.

Writer: `RegionWriter` units (shards, stats, CRC32C per shard and point, codec, fsync'd local
files, commit markers) over synthetic heavy-tailed bf16 rows of the 8B capture shape (32 points
x 4,096), upload threads = cores. Host cost = process CPU seconds (all threads) per logical GB;
the rate the node's cores sustain = cores / that cost, set against the GB/s the transport
delivers (part 2) by the orchestrator. The codec alone and CRC32C alone are measured beside it
on one shard's bytes, so the total splits into its parts.

Reader: `ActivationDataset` (one point, shuffled) through its DataLoader with `pin_memory=True`,
batches moved with `non_blocking=True` (`adapters.on_device`), into a TopK SAE (16x latents,
k=32, batch 4,096) trained with Adam on the GPU. Three figures side by side: the SAE step's own
demand (rows/s on a device-resident batch), the reader alone (rows/s landed on the device) and
the two together; `fed_share` = together / demand (1.0: the reader never starves the SAE).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import torch

NEEDS_CUDA = "skipped: needs CUDA"
NO_ZARR = "skipped: no zarr (install the wheels of .gpu-wheels: docs/benchmarks.md)"


def have_zarr() -> bool:
    try:
        import zarr  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (the writer's upload and codec threads included)."""
    return time.process_time()


def _write_store(url: str, P: int, W: int, rows: int, piece: int, threads: int, seed: int = 0):
    """A store of `rows` rows, written by RegionWriter units; returns (store, wall s, cpu s)."""
    from ...store import create_store
    from ...testing.synthetic import activations

    s = create_store(url, points=[f"resid_post.{i}" for i in range(P)], width=W, n_rows=rows,
                     context_size=1024)
    block = activations((P, piece, W), seed=seed)           # reused: generation is not the cost
    plan = s.ledger.write_plan(s.ledger.default_plan(1))
    c0, t0 = _cpu_s(), time.perf_counter()
    for u in plan:
        a, b = u["row_start"], u["row_end"]
        w = s.region_writer(u["unit_id"], a, b, upload_threads=threads)
        r = np.arange(a, b)
        w.write_meta(a, (r * 31 % 50000 + 3).astype(np.int32), r // 1024, r % 1024)
        for x in range(a, b, piece):
            w.write(x, block[:, : min(piece, b - x)])
        w.commit()
    return s, time.perf_counter() - t0, _cpu_s() - c0


def _core_s_per_gb(fn, nbytes: int, repeat: int = 5) -> float:
    c = _cpu_s()
    for _ in range(repeat):
        fn()
    return (_cpu_s() - c) / (repeat * nbytes / 1e9)


def writer(dry: bool) -> dict:
    if not have_zarr():
        return {"status": NO_ZARR}
    import google_crc32c

    P, W, rows, piece = (4, 64, 8192, 512) if dry else (32, 4096, 16384, 1024)
    cores = os.cpu_count() or 1
    tmp = tempfile.mkdtemp(prefix="harvest-gtc-writer-")
    try:
        s, wall, cpu = _write_store(os.path.join(tmp, "store"), P, W, rows, piece, threads=cores)
        gb = P * rows * W * 2 / 1e9
        codec = s.shard_codec(s.points[0])
        shard = s.read_shard(s.points[0], 0).view(s.np_dtype)
        out = {"points": P, "width": W, "rows": rows, "logical_gb": round(gb, 3), "cores": cores,
               "compression": s.compression, "wall_s": round(wall, 2),
               "wall_gbs": round(gb / wall, 3), "cpu_s": round(cpu, 2),
               "core_s_per_gb": round(cpu / gb, 3),
               "sustained_gbs_at_all_cores": round(cores * gb / cpu, 3),
               "codec_core_s_per_gb": round(_core_s_per_gb(lambda: codec.encode(shard, 0),
                                                           shard.nbytes), 3) if codec else None,
               "crc32c_core_s_per_gb": round(_core_s_per_gb(
                   lambda: google_crc32c.value(shard.tobytes()), shard.nbytes), 3)}
        from ...store.commit.verify import verify
        rep = verify(s, deep=True)
        out["verify_deep"] = "OK" if rep.ok else f"FAILED: {rep.errors[:5]}"
        out["ok"] = out["verify_deep"] == "OK"
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class TopKSAE(torch.nn.Module):
    """Gao et al. 2024, as in examples/train_topk.py (kept here: examples/ is not a package)."""

    def __init__(self, d: int, m: int, k: int):
        super().__init__()
        self.k = k
        w = torch.randn(m, d)
        w /= w.norm(dim=1, keepdim=True)
        self.W_dec = torch.nn.Parameter(w)
        self.W_enc = torch.nn.Parameter(w.t().clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(m))
        self.b_dec = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        top = pre.topk(self.k, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        return z @ self.W_dec + self.b_dec


def _train(sae, opt, batches, device) -> tuple[int, float]:
    """Steps over `batches` ([B, d] tensors already on `device`); (rows, seconds)."""
    rows, t = 0, time.perf_counter()
    for x in batches:
        x = x.float()
        loss = ((sae(x) - x) ** 2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rows += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return rows, time.perf_counter() - t


def reader(dry: bool) -> dict:
    if not have_zarr():
        return {"status": NO_ZARR}
    from ...store.read.adapters import on_device
    from ...store.read.dataset import ActivationDataset

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    W, rows, B, mult, k, steps, workers = ((64, 16384, 256, 4, 8, 30, 0) if not cuda else
                                           (4096, 262144, 4096, 16, 32, 120, 4))
    torch.backends.cuda.matmul.allow_tf32 = True
    tmp = tempfile.mkdtemp(prefix="harvest-gtc-reader-")
    try:
        s, _, _ = _write_store(os.path.join(tmp, "store"), 1, W, rows, 1024 if cuda else 512,
                               threads=os.cpu_count() or 1, seed=1)
        torch.manual_seed(0)
        sae = TopKSAE(W, mult * W, k).to(device)
        opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
        fixed = torch.randn(B, W, device=device)
        _train(sae, opt, [fixed] * 3, device)                      # warm-up (kernels, Adam state)
        n, dt = _train(sae, opt, [fixed] * (steps // 4), device)
        demand = n / dt

        def source():
            ds = ActivationDataset(s, "resid_post.0", batch_size=B, steps=steps, seed=2)
            return on_device(ds.loader(num_workers=workers, pin_memory=cuda), device,
                             dtype=torch.bfloat16)

        rows_alone, t = 0, time.perf_counter()
        for x in source():
            rows_alone += x.shape[0]
        if cuda:
            torch.cuda.synchronize()
        alone = rows_alone / (time.perf_counter() - t)
        n2, dt2 = _train(sae, opt, source(), device)
        fed = n2 / dt2
        row_bytes = W * 2
        out = {"width": W, "sae_latents": mult * W, "k": k, "batch": B, "workers": workers,
               "pin_memory": True if cuda else NEEDS_CUDA, "store_rows": rows,
               "sae_demand_rows_s": round(demand), "sae_demand_gbs": round(demand * row_bytes / 1e9, 3),
               "reader_alone_rows_s": round(alone),
               "reader_alone_gbs": round(alone * row_bytes / 1e9, 3),
               "together_rows_s": round(fed), "together_gbs": round(fed * row_bytes / 1e9, 3),
               "fed_share": round(fed / demand, 3),
               "rows_trained": n2, "ok": n2 == steps * B}
        if not cuda:
            out["note"] = "CPU dry run: SAE on CPU, no pinned memory; not a GPU figure"
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
