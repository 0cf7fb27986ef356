"""Each trainer example runs on a small store and trains: SAELens, dictionary_learning, sparsify
(in .venv-trainers, which .ci/install builds beside the engine's venv, since their pins replace
the engine's torch/transformers) and plain PyTorch (in this venv).

The store holds sparse codes: every row is 4 of 256 unit atoms in 64 dimensions with positive
weights, plus small noise, so a TopK SAE can reach a low held-out FVU in a few hundred steps and
a broken data path (misaligned rows, wrong normalisation, a split that leaks) shows up as a high
one. The light package is checked there too: installed without vLLM or Ray, it reads the store.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from tests.support.reader_stores import make_store
from tests.support.trainers import run_example, trainers_python

# SAE trainers in their own venv: not in `pytest -m 'not slow'`; no vLLM engine, no Ray
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]

D, ATOMS, K, N = 64, 256, 4, 1 << 15


@pytest.fixture(scope="module")
def sparse_store(tmp_path_factory):
    rng = np.random.default_rng(0)
    atoms = rng.normal(size=(ATOMS, D))
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    idx = np.stack([rng.choice(ATOMS, K, replace=False) for _ in range(N)])
    x = (rng.uniform(0.5, 2.0, (N, K, 1)) * atoms[idx]).sum(1) + 0.02 * rng.normal(size=(N, D))
    attrs = {"special_token_ids": [1], "bos_token_id": 1, "context_size": 64, "tokenizer": "toy",
             "model": {"model": "toy-sparse-codes"}}
    s = make_store(tmp_path_factory.mktemp("sparse") / "s.zarr", N, 4096, D, ["resid_post.3"], context=64,
                   attrs=attrs, data=x[None].astype(ml_dtypes.bfloat16), mean_doc=40)[0]
    return s.url


ARGS = ("--steps", "200", "--batch-size", "256", "--k", "8", "--lr", "1e-2")   # ~0.17 FVU for all four


@pytest.fixture(scope="module")
def paired_sparse_stores(tmp_path_factory):
    """Two row-aligned stores, as from two models over one corpus: every row's code (which 4 of
    256 latents, with what weights) is the same in both, seen through two different dictionaries,
    and 32 latents exist in one model only (zero atoms in the other): a crosscoder's case."""
    rng = np.random.default_rng(1)
    idx = np.stack([rng.choice(ATOMS, K, replace=False) for _ in range(N)])
    w = rng.uniform(0.5, 2.0, (N, K, 1))
    attrs = {"special_token_ids": [1], "bos_token_id": 1, "context_size": 64, "tokenizer": "toy"}
    root = tmp_path_factory.mktemp("paired-sparse")
    urls = []
    for m in range(2):
        atoms = rng.normal(size=(ATOMS, D))
        atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
        atoms[m * 32:(m + 1) * 32] = 0          # latents 0-31 only in model 1, 32-63 only in model 0
        x = (w * atoms[idx]).sum(1) + 0.02 * rng.normal(size=(N, D))
        s = make_store(root / f"model{m}.zarr", N, 4096, D, ["resid_post.3"], context=64, attrs=attrs,
                       data=x[None].astype(ml_dtypes.bfloat16), mean_doc=40)[0]
        urls.append(s.url)
    return urls


def test_crosscoder_example_trains_on_a_paired_dataset(paired_sparse_stores):
    """dictionary_learning's TopK over the paired reader's concatenated rows (no installed
    trainer has a crosscoder mode: adapters.py says what is missing)."""
    base, tuned = paired_sparse_stores
    r = run_example(trainers_python(), "train_crosscoder.py", base, "--with-store", tuned, *ARGS)
    assert r["steps"] == 200 and r["stores"] == ["model0.zarr", "model1.zarr"], r
    assert r["heldout_fvu"] < 0.3 and max(r["heldout_fvu_per_model"]) < 0.35, r


def test_plain_torch_topk_example_trains(sparse_store):
    r = run_example(sys.executable, "train_topk.py", sparse_store, *ARGS)
    assert r["steps"] == 200 and r["norm_source"] == "sample"
    assert r["last_loss"] < 0.5 * r["first_loss"]
    assert r["heldout_fvu"] < 0.3, r


def test_saelens_example_trains(sparse_store):
    r = run_example(trainers_python(), "train_saelens.py", sparse_store, *ARGS)
    assert r["steps"] == 200 and r["last_loss"] < 0.5 * r["first_loss"]
    assert r["heldout_fvu"] < 0.3, r


def test_dictionary_learning_example_trains(sparse_store):
    r = run_example(trainers_python(), "train_dictionary_learning.py", sparse_store, *ARGS)
    assert r["heldout_fvu"] < 0.3, r


def test_sparsify_example_trains(sparse_store):
    r = run_example(trainers_python(), "train_sparsify.py", sparse_store, *ARGS)
    assert r["last_loss"] < 0.5 * r["first_loss"]
    assert r["heldout_fvu"] < 0.3, r


def test_light_package_reads_the_store_without_vllm_or_ray(sparse_store):
    """In .venv-trainers the store and reader come from the installed harvest-store package
    (no checkout on the path), and neither vLLM nor Ray is installed there."""
    py = trainers_python()
    code = ("import importlib.util as u, sys, numpy as np, harvest.store as ps\n"
            "from harvest.store.read.dataset import ActivationDataset\n"
            "assert u.find_spec('vllm') is None and u.find_spec('ray') is None\n"
            "assert 'site-packages' in ps.__file__, ps.__file__\n"
            # the test server and data generator live in harvest.testing, which it does not ship
            "assert not any(u.find_spec(m) for m in ('harvest.testing', 'harvest.store.seaweed', "
            "'harvest.store.synthetic'))\n"
            f"ds = ActivationDataset({sparse_store!r}, batch_size=1000, exclude_special=True, return_meta=True)\n"
            "rows = np.concatenate([b['row'].numpy() for b in ds])\n"
            "print(len(rows), len(np.unique(rows)), ds.count_rows())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    n, uniq, kept = map(int, p.stdout.split())
    assert n == uniq == kept == N - 2 * (N // 64)   # the kept rows: the BOS and position-1 sinks out


# ---- transcoders and points of several widths (issue 35) ----------------------------------------
# One sparse code per row drives three points: mlp_in = codes x atoms_in, mlp_act = the codes
# spread over 2 x D hidden units (codes x atoms_act, wider than the stream), mlp_out = codes x
# atoms_out.
# A transcoder mlp_in -> mlp_out can then reach a low held-out FVU of mlp_out in a few hundred
# steps; rows of one point paired with another token's rows of the other could not.
TC_N = 1 << 14


@pytest.fixture(scope="module")
def transcoder_store(tmp_path_factory):
    from harvest.store import create_store
    from harvest.testing import synthetic
    from tests.support.reader_stores import packed_meta

    rng = np.random.default_rng(1)
    a_in, a_out = (rng.normal(size=(ATOMS, D)) for _ in range(2))
    a_in /= np.linalg.norm(a_in, axis=1, keepdims=True)
    a_out /= np.linalg.norm(a_out, axis=1, keepdims=True)
    a_act = rng.normal(size=(ATOMS, 2 * D))
    a_act /= np.linalg.norm(a_act, axis=1, keepdims=True)
    idx = np.stack([rng.choice(ATOMS, K, replace=False) for _ in range(TC_N)])
    w = rng.uniform(0.5, 2.0, (TC_N, K, 1))
    noise = lambda d: 0.02 * rng.normal(size=(TC_N, d))  # noqa: E731
    rows = {"mlp_in.3": (w * a_in[idx]).sum(1) + noise(D),
            "mlp_act.3": (w * a_act[idx]).sum(1) + noise(2 * D),
            "mlp_out.3": (w * a_out[idx]).sum(1) + noise(D)}
    data = np.zeros((3, TC_N, 2 * D), ml_dtypes.bfloat16)
    for i, x in enumerate(rows.values()):
        data[i, :, :x.shape[1]] = x
    s = create_store(str(tmp_path_factory.mktemp("tc") / "s.zarr"), points=list(rows), width=D,
                     widths={p: x.shape[1] for p, x in rows.items()}, n_rows=TC_N,
                     shard_rows=4096, chunk_rows=128, special_token_ids=[1], bos_token_id=1,
                     context_size=64, tokenizer="toy")
    s.ledger.write_plan(s.ledger.default_plan(1))
    tok, doc, pos = packed_meta(TC_N, 64, 40, 0)
    synthetic.fill(s, data, token_id=tok, doc_id=doc, position=pos)
    return s.url


def test_sparsify_transcoder_trains_from_mlp_in_to_mlp_out(transcoder_store):
    """sparsify's transcoder mode (`TranscoderConfig`, `sae(x, y)`) fed by transcoder_batches."""
    r = run_example(trainers_python(), "train_transcoder_sparsify.py", transcoder_store, *ARGS)
    assert r["steps"] == 200 and r["point"] == "mlp_in.3->mlp_out.3"
    assert r["last_loss"] < 0.5 * r["first_loss"]
    assert r["heldout_fvu"] < 0.3 and r["heldout_rows"] > 500, r


def test_saelens_multi_trainer_trains_points_of_two_widths(transcoder_store):
    """SAELens' MultiSAETrainer on mlp_in (64) and mlp_act (128) from one row-aligned stream."""
    r = run_example(trainers_python(), "train_saelens_multi.py", transcoder_store, *ARGS,
                    "--points", "mlp_in.3", "mlp_act.3")
    assert r["widths"] == {"mlp_in.3": D, "mlp_act.3": 2 * D} and r["steps"] == 200
    for p in ("mlp_in.3", "mlp_act.3"):
        assert r["last_loss"][p] < 0.5 * r["first_loss"][p], r
        assert r["heldout_fvu"][p] < 0.3, r
