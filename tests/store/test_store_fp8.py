"""fp8 stores (dtype float8_e4m3fn): the quantiser against a numpy/ml_dtypes reference bit for
bit, the stored bytes, FORMAT.md's decoder on the raw zarr array, statistics of the dequantised
rows, verify --deep, the reader's dequantised and GPU-handoff batches, and the light package
reading fp8 without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from harvest.engine.capture.quantize import quantize_points, quantize_rows
from harvest.store import create_store, open_store
from harvest.store.format import fp8
from harvest.store.format.dtypes import BF16
from harvest.store.read.dataset import ActivationDataset
from harvest.testing import synthetic

P, W, N = 2, 64, 1300
SHARD, CHUNK = 512, 128
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reference(x: np.ndarray) -> np.ndarray:
    """The quantiser written out independently: per row absmax/448, RNE to e4m3fn via
    ml_dtypes, saturating, zero rows all zero with scale 0; float32 scale appended LE."""
    out = []
    for row in np.asarray(x).astype(np.float32).reshape(-1, x.shape[-1]):
        amax = np.float32(np.max(np.abs(row)))
        s = np.float32(amax / np.float32(448.0))
        with np.errstate(invalid="ignore"):
            y = row / (s if s > 0 else np.float32(1.0))
        q = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        out.append(np.concatenate([q.view(np.uint8), np.array([s], "<f4").view(np.uint8)]))
    return np.stack(out).reshape(x.shape[:-1] + (x.shape[-1] + 4,))


def _rows(seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((40, W)) * np.exp(3 * rng.standard_normal((40, 1)))).astype(np.float32)
    x[1] = 0                        # zero row: scale 0, all zeros
    x[2, :] = 0
    x[2, 3] = -0.0
    x[3] = rng.standard_normal(W).astype(np.float32) * 1e-40   # subnormal inputs
    x[4, 5] = np.inf                # non-finite row stays non-finite
    x[5, :4] = [448.0 * 7, -448.0 * 7, 1e-3, 0.5]
    x[6] = np.linspace(-1, 1, W) * 448 * (1 + 2 ** -12)   # ties and the saturation edge
    return x


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_quantiser_matches_numpy_reference_bit_for_bit(dt):
    x = _rows()
    if dt == "bfloat16":
        src = x.astype(BF16)
        t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    else:
        src = x.astype(dt)
        t = torch.from_numpy(src)
    ref = _reference(src)
    assert np.array_equal(fp8.quantize(src), ref)
    assert np.array_equal(quantize_rows(t).numpy(), ref)
    out = torch.zeros(2, 40, W + 4, dtype=torch.uint8)
    quantize_points(torch.stack([t, t.flip(0)]), [1, 0], 40, out)   # the engine's per-point form
    assert np.array_equal(out[0].numpy(), ref[::-1]) and np.array_equal(out[1].numpy(), ref)
    deq = fp8.dequantize(ref)
    assert (deq[1] == 0).all() and fp8.split(ref)[1][1] == 0
    assert not np.isfinite(deq[4]).all()
    assert np.isfinite(deq[[0, 5, 6]]).all()
    assert np.abs(deq[5, 0]) == np.float32(448 * 7)   # the row's absmax survives exactly


def _format_md_decoder():
    """The numpy decoder FORMAT.md gives under "fp8 stores", executed as written there."""
    text = open(os.path.join(ROOT, "store", "FORMAT.md")).read()
    block = text.split("## fp8 stores", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert len([ln for ln in block.strip().splitlines() if ln.strip()]) <= 10
    env: dict = {}
    exec(compile(block, "FORMAT.md", "exec"), env)   # noqa: S102 -- the documented snippet
    return env["read_fp8_rows"]


def _make(url, dtype, data):
    s = create_store(url, points=[f"resid_post.{i}" for i in range(P)], width=W, n_rows=N,
                     shard_rows=SHARD, chunk_rows=CHUNK, dtype=dtype, context_size=128)
    s.ledger.write_plan(s.ledger.default_plan(1))
    tok = (np.arange(N) * 31 % 1000).astype(np.int32)
    synthetic.fill(s, data, order="shuffled", token_id=tok)
    s.finalize({"tokens": N})
    return open_store(url)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    x = synthetic.activations((P, N, W), seed=4)
    x[:, 7] = 0
    bf = _make(str(d / "bf16.zarr"), "bfloat16", x)
    q = _make(str(d / "fp8.zarr"), "fp8", x)
    return x, bf, q, str(d / "fp8.zarr")


def test_fp8_store_bytes_decoder_stats_and_verify(stores):
    x, bf, q, url = stores
    assert q.dtype == "float8_e4m3fn" and q.width == W and q.row_width == W + 4
    for i, p in enumerate(q.points):
        raw = q.read(p, 0, N)
        assert raw.dtype == np.uint8 and raw.shape == (N, W + 4)
        assert np.array_equal(raw, _reference(x[i]))            # the writer quantised bit-exactly
        # zarr-python opens the raw array as plain uint8; FORMAT.md's decoder, run as written
        import zarr
        a = zarr.open_array(os.path.join(url, "resid_post", str(i)), mode="r")
        assert a.dtype == np.uint8 and a.shape == (N, W + 4)
        r = a[:]
        vals = _format_md_decoder()(url, p, 0, N)
        ts = pytest.importorskip("tensorstore")
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                     "path": os.path.join(url, "resid_post", str(i))}}).result()
        assert np.array_equal(t.read().result(), r)
        assert vals.dtype == np.float32 and vals.shape == (N, W)
        ref = x[i].astype(np.float32)
        err = fp8.relative_error(ref, r)
        assert np.percentile(err, 99) < 0.04 and np.array_equal(vals, fp8.dequantize(r))
        # statistics are of the dequantised rows
        st = q.stats()[p]
        d64 = vals.astype(np.float64)
        np.testing.assert_allclose(st["mean"], d64.mean(0), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(st["var"], d64.var(0), rtol=1e-9, atol=1e-10)
    v = q.verify(deep=True)
    assert v.ok and v.deep_checked, v.errors
    assert q.info()["dtype"] == "float8_e4m3fn" and q.info()["row_width"] == W + 4
    # inspect and report show values (dequantised), not the packed bytes
    from harvest.pipeline.cli.report import collect
    from harvest.store.inspect import inspect

    got = inspect(url, rows=(0, 10))["rows"]["norms"]["resid_post.0"]
    want = np.linalg.norm(fp8.dequantize(q.read("resid_post.0", 0, 10)), axis=1)
    np.testing.assert_allclose(got, np.round(want, 3))
    rep = collect(q, sample_shards=2, top=3)
    assert rep["dtype"] == "float8_e4m3fn"
    top = rep["top_rows"]["resid_post.0"][0]
    assert np.isclose(top["norm"], np.linalg.norm(q.read_values("resid_post.0", top["row"],
                                                                top["row"] + 1)), rtol=1e-5)
    ratio_bf = bf.info()["compression_ratio"]["overall"]
    ratio_q = q.info()["compression_ratio"]["overall"]
    # stored bytes: fp8 rows are (W + 4) / (2 W) of bf16's logical bytes before compression
    stored_bf = N * W * 2 * P / ratio_bf
    stored_q = N * (W + 4) * P / ratio_q
    assert stored_q <= 0.65 * stored_bf, (stored_q, stored_bf)


def test_reader_dequantised_and_gpu_handoff_batches(stores):
    x, _, q, url = stores
    want = np.stack([fp8.dequantize(fp8.quantize(x[i])) for i in range(P)], axis=1)  # [N, P, W]
    ds = ActivationDataset(url, points=list(q.points), batch_size=256, shuffle=False)
    got = torch.cat(list(ds)).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    ds = ActivationDataset(url, points="resid_post.1", batch_size=256, shuffle=False,
                           dequantize=False, return_meta=True)
    parts = list(ds)
    acts = torch.cat([b["acts"] for b in parts])
    scale = torch.cat([b["scale"] for b in parts])
    assert acts.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert acts.shape == (N, W) and scale.shape == (N,)
    rows = torch.cat([b["row"] for b in parts]).numpy()
    assert np.array_equal((acts.float() * scale[:, None]).numpy(), want[rows, 1])
    # the (acts, scale) form through 2 workers' shared-memory slots (store/read/feed/handoff.py):
    # the same pairs, still a tuple (torch's own hand-over would make it a list)
    from harvest.store.read.feed import handoff
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(handoff, "BY_VALUE", 0)
        pairs = list(ActivationDataset(url, points="resid_post.1", batch_size=256, shuffle=False,
                                       dequantize=False).loader(2))
    assert all(isinstance(p, tuple) and p[0].dtype == torch.float8_e4m3fn for p in pairs)
    vals = torch.cat([a.float() * sc[:, None] for a, sc in pairs]).numpy()
    assert np.array_equal(np.sort(vals, axis=0), np.sort(want[:, 1], axis=0))
    with pytest.raises(ValueError, match="dequantize=False"):
        ActivationDataset(url, points="resid_post.0", batch_size=8, dequantize=False,
                          normalize="norm_scale")
    # normalising an fp8 store: constants from its (dequantised) statistics, or from a sample
    for ratio in (None, 50.0):
        b = next(iter(ActivationDataset(url, points="resid_post.0", batch_size=64, shuffle=False,
                                        normalize="norm_scale", max_norm_ratio=ratio)))
        assert b.dtype == torch.float32 and torch.isfinite(b).all()


def test_light_package_reads_fp8_without_torch(stores):
    x, _, q, url = stores
    code = (
        "import sys, json, numpy as np\n"
        "sys.modules['torch'] = None\n"   # any torch import fails
        "from harvest.store import open_store\nfrom harvest.store.format import fp8\n"
        "from harvest.store.commit.verify import verify\n"
        f"s = open_store({url!r}, read_only=True)\n"
        "v = verify(s, deep=True)\n"
        "x = fp8.dequantize(s.read('resid_post.0', 0, s.n_rows))\n"
        "print(json.dumps({'ok': v.ok, 'sum': float(np.float64(x).sum()), 'shape': list(x.shape)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = fp8.dequantize(q.read("resid_post.0", 0, N)).astype(np.float64).sum()
    assert got["ok"] and got["shape"] == [N, W] and got["sum"] == float(want)
