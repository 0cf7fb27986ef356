"""The row-for-row comparison the pipeline tests rely on (tests/support/pipeline.py) does catch
a difference: one flipped bit when bit-exact, two swapped rows within a relative tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.pipeline import assert_store_matches


class _FakeStore:
    def __init__(self, arrays):
        self.arrays = arrays
        self.points = list(arrays)
        self.n_rows = len(next(iter(arrays.values())))

    def read(self, p, a, b):
        return self.arrays[p][a:b]


def test_row_comparison_catches_one_flipped_bit():
    import ml_dtypes

    ref = {"resid_post.0": np.arange(64, dtype=np.float32).reshape(8, 8).astype(ml_dtypes.bfloat16)}
    assert_store_matches(_FakeStore({k: v.copy() for k, v in ref.items()}), ref)
    bad = ref["resid_post.0"].copy()
    bad.view(np.uint16)[5, 3] ^= 1
    with pytest.raises(AssertionError, match="1 rows differ"):
        assert_store_matches(_FakeStore({"resid_post.0": bad}), ref)
    assert_store_matches(_FakeStore({"resid_post.0": bad}), ref, rel_tol=0.03)
    swapped = ref["resid_post.0"][[1, 0, 2, 3, 4, 5, 6, 7]]
    with pytest.raises(AssertionError, match="2 rows beyond 3% relative error"):
        assert_store_matches(_FakeStore({"resid_post.0": swapped}), ref, rel_tol=0.03)
