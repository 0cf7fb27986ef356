"""Points of 32-bit values (FORMAT.md "Points of 32-bit values"): expert_indices (int32) and
expert_weights (float32), their bits in a bfloat16 store's elements, written and read back bit
for bit (NaN-looking halves included), no statistics of their bits, layout 5, refused in an fp8
store and by the training reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.store import create_store

C, K = 16, 2
POINTS = ["resid_post.0", "expert_indices.0", "expert_weights.0"]


def _store(tmp_path, **kw):
    return create_store(str(tmp_path / "s.zarr"), points=POINTS, width=8, n_rows=128,
                        widths={"expert_indices.0": 2 * K, "expert_weights.0": 2 * K},
                        values={"expert_indices.0": "int32", "expert_weights.0": "float32"},
                        shard_rows=128, context_size=C, **kw)


def _routing(n):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(64, generator=g)[:K] for _ in range(n)]).to(torch.int32)
    ids[0] = torch.tensor([0x7FC0_7FC0, 0xFF81], dtype=torch.int32)   # halves that read as NaN
    w = torch.rand(n, K, generator=g).sort(-1, descending=True).values
    w[1] = torch.tensor([float.fromhex("0x1.ff81p-1"), 2.0 ** -140])   # a NaN-pattern low half
    return ids, w


def test_routing_points_round_trip_bit_for_bit(tmp_path):
    from harvest.engine.capture.packed import pack
    from harvest.store.read.routing import stored_routing

    st = _store(tmp_path)
    assert st.layout_version == 5 and st.point_values == {"expert_indices.0": "int32",
                                                           "expert_weights.0": "float32"}
    st.ledger.write_plan(st.ledger.default_plan(1))
    n = st.n_rows
    ids, w = _routing(n)
    acts = torch.zeros(3, n, 8, dtype=torch.bfloat16)
    acts[0] = torch.randn(n, 8)
    acts[1, :, :2 * K] = pack(ids, torch.bfloat16)
    acts[2, :, :2 * K] = pack(w, torch.bfloat16)
    wr = st.region_writer(0, 0, n)
    z = np.zeros(n, np.int32)
    wr.write_meta(0, z, z.astype(np.int64), np.arange(n, dtype=np.int32) % C)
    import ml_dtypes

    wr.write(0, acts.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    wr.commit()
    st.finalize({"status": "complete"})
    report = st.verify(deep=True)
    assert report.ok, report.errors
    got = st.read_values("expert_indices.0", 0, n)
    assert got.dtype == np.int32 and np.array_equal(got, ids.numpy())
    gw = st.read_values("expert_weights.0", 0, n)
    assert gw.dtype == np.float32 and np.array_equal(gw.view(np.int32), w.numpy().view(np.int32))
    ri, rw = stored_routing(st, 0, 10, 20)
    assert torch.equal(ri, ids[10:20].long()) and torch.equal(rw, w[10:20])
    stats = st.stats(["expert_indices.0", "resid_post.0"])
    assert stats["expert_indices.0"]["count"] == 0   # no statistics of their bits
    assert stats["resid_post.0"]["count"] == n
    from harvest.store.read.dataset import ActivationDataset

    with pytest.raises(ValueError, match="int32 values .* not activations"):
        ActivationDataset(st, ["resid_post.0", "expert_indices.0"], batch_size=8)
    assert ActivationDataset(st, None, batch_size=8).points == ["resid_post.0"]
    with pytest.raises(ValueError, match="neither"):
        stored_routing(st, 1, 0, 4)


def test_fp8_store_refuses_routing_points(tmp_path):
    with pytest.raises(ValueError, match="fp8 would destroy them"):
        _store(tmp_path, dtype="float8_e4m3fn")


def test_a_store_of_activations_stays_at_its_layout(tmp_path):
    st = create_store(str(tmp_path / "a.zarr"), points=["resid_post.0"], width=8, n_rows=128,
                      shard_rows=128)
    assert st.layout_version == 3 and st.point_values == {}
