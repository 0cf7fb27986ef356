"""Points of 32-bit values in the engine dtype (engine/capture/packed.py, engine/points.py): ids
and weights go through pack/unpack bit for bit in bfloat16, float16 and float32 rows (an int32
whose halves read as a bfloat16 NaN included); the router's choice is sorted by weight before it
is packed (taps.routing_rows); the `topk` width kind and the per-slot widths come from the
config."""

from __future__ import annotations

import pytest
import torch

from harvest.engine.capture.packed import pack, slot_width, unpack
from harvest.engine.capture.taps import routing_rows
from harvest.engine.points import config_width, point_width, values_per_slot

MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 8,
           "num_experts_per_tok": 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_values_go_through_the_engine_dtype_bit_for_bit(dtype):
    ids = torch.tensor([[0x7FC0_7FC0, 3], [0xFF81, -1], [255, 1024]], dtype=torch.int32)
    w = torch.tensor([[float("nan"), 2.0 ** -140], [0.75, 0.25], [1e-30, -0.0]])
    for v, kind in ((ids, "int32"), (w, "float32")):
        rows = pack(v, dtype)
        assert rows.dtype == dtype and rows.shape == (3, 2 * slot_width(dtype))
        buf = torch.zeros(3, 16, dtype=dtype)
        buf[:, :rows.shape[1]].copy_(rows)   # as the tap op writes a slot
        back = unpack(buf[:, :rows.shape[1]], kind)
        assert back.dtype == v.dtype and torch.equal(back.view(torch.int32), v.view(torch.int32))


def test_routing_rows_are_sorted_by_weight_and_keep_the_pairs():
    w = torch.tensor([[0.2, 0.8], [0.6, 0.4]])
    ids = torch.tensor([[5, 1], [2, 7]], dtype=torch.int64)
    w_rows, i_rows = routing_rows(w, ids, torch.bfloat16)
    assert torch.equal(unpack(w_rows, "float32"), torch.tensor([[0.8, 0.2], [0.6, 0.4]]))
    assert torch.equal(unpack(i_rows, "int32"), torch.tensor([[1, 5], [2, 7]], dtype=torch.int32))


def test_topk_width_and_slots_from_the_config():
    assert config_width(MIXTRAL, "topk") == 2 and point_width(MIXTRAL, "expert_indices") == 2
    assert config_width({"hidden_size": 64, "num_experts_per_tok": 2}, "topk") is None  # dense
    assert values_per_slot("expert_weights", torch.bfloat16) == 2
    assert values_per_slot("expert_weights", "float32") == 1
    assert values_per_slot("resid_post", torch.bfloat16) == 1
    with pytest.raises(ValueError, match="expert_indices needs a MoE model"):
        point_width({"hidden_size": 64}, "expert_indices")
