"""Hooked mode (enforce_eager + Python hooks) serves any point; the eager HF backend is the reference.

The hooks read the same probed block semantics as the freeze taps, so the families whose blocks
break naive rules are checked here too: Cohere (a `residual` argument it does not add), Granite
(`layer(positions, hidden_states)`), GPT-NeoX (Transformers backend, `[1, tokens, width]`) and
Mixtral (`block_sparse_moe`). Their references come from a subprocess (engine.model_check), since
loading GPT-NeoX through vLLM's Transformers backend patches its HF classes in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.engine import Address, load_model, run_with_cache
from harvest.engine.model_check import reference_many, row_errors
from tests.fixtures.models import tiny_model_path
from tests.support import runners
from tests.support import hf_points
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, prompts, rel_err

pytestmark = pytest.mark.slow  # vLLM engines (hooked mode): not in `pytest -m 'not slow'`

POINTS = ["resid_pre.0", "resid_pre.2", "attn_out.1", "mlp_out.1", "resid_post.3", "attn_out.3"]
FAMILIES = ("cohere", "granite", "gpt_neox", "mixtral")
# q/k/v hooked as well: GPT-NeoX's attention kernel is called by vLLM's Transformers backend as
# `kernel.forward(...)`, which runs no hooks (engine/capture/taps.py wraps it instead); Cohere's
# rotary is interleaved. The reference is the eager backend's (transformers' AttentionInterface).
QKV = ["q.1", "k.2", "v.3"]
FAMILY_TOKENS = prompts(12, (9, 70, 130))


@pytest.fixture(scope="module")
def family_refs():
    jobs = [{"path": tiny_model_path(a), "tokens": FAMILY_TOKENS, "points": POINTS + QKV}
            for a in FAMILIES]
    return dict(zip(FAMILIES, reference_many(jobs)))


@pytest.fixture(scope="module", params=("llama",) + FAMILIES)
def hooked(request):
    """One hooked engine at a time (the engine's state slot is per process); llama also on
    Model Runner V2 (tests/support/runners.py)."""
    arch, _, runner = request.param.partition("-")
    path = tiny_model_path(arch)
    with runners.model_runner(runner or "v1"):
        m = load_model(path, backend="vllm", enforce_eager=True, max_num_batched_tokens=64)
        assert m.mode == "hooked"
        yield arch, path, m
        m.close()


@pytest.mark.parametrize("hooked", FAMILIES, indirect=True)
def test_hooked_families_equal_hf(hooked, family_refs):
    arch, _, m = hooked
    got = run_with_cache(m, FAMILY_TOKENS, POINTS + QKV)
    for p in POINTS + QKV:
        errs = np.concatenate([row_errors(g[Address.parse(p)], r[p])
                               for g, r in zip(got, family_refs[arch])])
        assert np.percentile(errs, 99) <= BF16_REL_TOL, (arch, p, np.percentile(errs, [50, 99]))


def test_eager_reference_hooks_equal_output_hidden_states():
    path = tiny_model_path("qwen3")
    toks = prompts(7, (9, 33))
    ref = load_model(path, backend="eager", dtype="float32")
    got = run_with_cache(ref, toks, [f"resid_post.{L}" for L in range(ref.n_layers - 1)] + ["resid_pre.0"])
    hs, _ = hf_hidden_states(path, toks)
    for g, h in zip(got, hs):
        for L in range(ref.n_layers - 1):
            torch.testing.assert_close(g[Address("resid_post", L)][0] if g[Address("resid_post", L)].dim() == 3 else g[Address("resid_post", L)], h[L + 1])
        torch.testing.assert_close(g[Address("resid_pre", 0)], h[0])  # embeddings


@pytest.mark.parametrize("hooked", ["llama", "llama-v2"], indirect=True)
def test_hooked_serves_any_point_equal_to_hf(hooked):
    _, path, m = hooked
    toks = prompts(8, (12, 70, 130))
    got = run_with_cache(m, toks, POINTS)
    ref = run_with_cache(load_model(path, backend="eager", dtype="float32"), toks, POINTS)
    for g, r in zip(got, ref):
        assert list(g) == [Address.parse(p) for p in POINTS]
        for a in g:
            assert rel_err(g[a], r[a]) < BF16_REL_TOL, a


@pytest.mark.parametrize("hooked", ["llama", "llama-v2"], indirect=True)
def test_hooked_points_can_change_between_calls(hooked):
    _, path, m = hooked
    toks = prompts(9, (20,))
    a = run_with_cache(m, toks, ["resid_post.1"])[0]
    b = run_with_cache(m, toks, ["mlp_out.2", "resid_post.1"])[0]
    assert list(b) == [Address("mlp_out", 2), Address("resid_post", 1)]
    torch.testing.assert_close(a[Address("resid_post", 1)], b[Address("resid_post", 1)])
    # module-site points of other widths, hooked like the rest: each at its own width, equal to
    # Hugging Face fp32 read by plain hooks (tests/support/hf_points.py)
    pts = ["mlp_act.2", "z.1", "resid_mid.0", "q.3", "k.1", "v.0", "mlp_pre.2",
           "mlp_pre_linear.1"]
    c = run_with_cache(m, toks, pts)[0]
    assert [tuple(c[p].shape) for p in pts] == [(20, 256), (20, 128), (20, 128), (20, 128),
                                                (20, 64), (20, 64), (20, 256), (20, 256)]
    (ref,) = hf_points.references([{"path": path, "family": "llama", "tokens": toks,
                                    "points": pts}])
    for p in pts:
        assert rel_err(c[p], ref[0][p]) < 0.05, p


@pytest.mark.parametrize("hooked", ["llama", "llama-v2"], indirect=True)
def test_hooked_mode_needs_explicit_points(hooked):
    *_, m = hooked
    with pytest.raises(ValueError, match="explicit points"):
        run_with_cache(m, [[4, 5, 6]])


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="use one of vllm, eager"):
        load_model("x", backend="onnx")
