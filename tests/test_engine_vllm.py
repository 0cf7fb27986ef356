"""vLLM freeze capture against the Hugging Face reference, one compiled engine per architecture.

Each engine start costs 10-50 s on 2 cores, so one module-scoped engine per architecture serves
every test here; max_num_batched_tokens=64 forces chunked prefill (prompts up to 150 tokens) and
several requests per step.
"""

from __future__ import annotations

import pytest
import torch

from engine import Address, load_model, run_with_cache
from engine import harvest, taps
from tests.engine_reference import BF16_REL_TOL, final_norm, hf_hidden_states, prompts, rel_err
from tests.fixtures.models import ARCHS, tiny_model_path

LENGTHS = (5, 37, 150, 64, 90, 17, 1, 120)
MAX_BATCHED = 64


@pytest.fixture(scope="module", params=ARCHS)
def frozen(request):
    path = tiny_model_path(request.param)
    m = load_model(path, backend="vllm", freeze_points="auto", max_num_batched_tokens=MAX_BATCHED)
    yield request.param, path, m
    m.close()


def test_freeze_resid_post_every_layer_equals_hf(frozen):
    arch, path, m = frozen
    toks = prompts(1, LENGTHS)
    steps0 = m.state.steps
    got = run_with_cache(m, toks)
    # Chunked prefill really happened: the 150-token prompt needs >= 3 steps of 64 rows.
    assert m.state.steps - steps0 >= sum(LENGTHS) // MAX_BATCHED
    ref, hf = hf_hidden_states(path, toks)
    norm = final_norm(hf)
    n = m.n_layers
    for i, (g, hs) in enumerate(zip(got, ref)):
        assert list(g) == [Address("resid_post", L) for L in range(n)]
        for L in range(n - 1):
            assert g[Address("resid_post", L)].shape == (len(toks[i]), m.width)
            assert rel_err(g[Address("resid_post", L)], hs[L + 1]) < BF16_REL_TOL, (arch, i, L)
        # The last hidden state of HF includes the final norm; resid_post excludes it.
        last = g[Address("resid_post", n - 1)].float()
        with torch.inference_mode():
            assert rel_err(norm(last), hs[n]) < BF16_REL_TOL, (arch, i)
        assert rel_err(last, hs[n]) > 0.05  # ...so the raw stream must differ from it


def test_rows_attach_to_the_right_request(frozen):
    """Distinct prompts batched together: each request's rows match its own prompt, not a neighbour's."""
    _, path, m = frozen
    toks = prompts(2, (40, 40, 40, 40))
    got = run_with_cache(m, toks, ["resid_post.0"])
    ref, _ = hf_hidden_states(path, toks)
    for i in range(4):
        errs = [rel_err(got[i][Address("resid_post", 0)], ref[j][1]) for j in range(4)]
        assert min(range(4), key=errs.__getitem__) == i and errs[i] < BF16_REL_TOL


def test_taps_run_on_the_compiled_path(frozen):
    arch, _, m = frozen
    from vllm.config import CompilationMode

    assert m.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    hook_calls = []
    h = harvest.ACTIVE.layers[0].register_forward_hook(lambda *a: hook_calls.append(1))
    before = taps.TAP_CALLS[0]
    try:
        got = run_with_cache(m, prompts(3, (30, 70)))
    finally:
        h.remove()
    assert hook_calls == []  # Python hooks never fire inside the compiled graph...
    assert taps.TAP_CALLS[0] - before >= m.n_layers * 2  # ...the compiled-in taps do, per layer per step
    assert all(v.abs().sum() > 0 for g in got for v in g.values())


def test_frozen_engine_refuses_points_outside_its_set(frozen):
    _, _, m = frozen
    with pytest.raises(ValueError, match="cannot serve resid_pre.0"):
        run_with_cache(m, [[5, 6, 7]], ["resid_pre.0"])


def test_subset_of_frozen_points_in_requested_order(frozen):
    _, _, m = frozen
    toks = prompts(4, (20,))
    full = run_with_cache(m, toks)[0]
    sub = run_with_cache(m, toks, ["resid_post.2", "resid_post.0"])[0]
    assert list(sub) == [Address("resid_post", 2), Address("resid_post", 0)]
    for a in sub:
        assert torch.equal(sub[a], full[a])


def test_steering_write_shifts_the_stream(frozen):
    arch, _, m = frozen
    toks = prompts(5, (25,))
    base = run_with_cache(m, toks)[0]
    vec = torch.linspace(-1, 1, m.width)
    m.set_steering("resid_post.0", vec)
    try:
        steered = run_with_cache(m, toks)[0]
    finally:
        m.set_steering("resid_post.0", torch.zeros(m.width))
    a0, a1 = Address("resid_post", 0), Address("resid_post", 1)
    shift = (steered[a0].float() - base[a0].float()).mean(0)
    assert rel_err(shift, vec) < BF16_REL_TOL  # read after write at the same site
    assert rel_err(steered[a1], base[a1]) > 0.01  # and it propagates downstream
    assert torch.equal(run_with_cache(m, toks)[0][a0], base[a0])  # zero turns it off again


def test_streaming_capture_is_lazy_and_bounded(frozen):
    arch, _, m = frozen
    pulled = []

    def batches():
        for i in range(12):
            pulled.append(i)
            yield prompts(100 + i, (50,))

    stream = m.capture(batches(), ["resid_post.1"], max_in_flight_tokens=100)
    first = next(stream)
    assert len(pulled) <= 4  # a budget of 100 tokens admits at most 2 prompts of 50 (+1 peeked)
    rest = list(stream)
    assert sorted([first.index] + [r.index for r in rest]) == list(range(12))
    assert not harvest.ACTIVE.dests  # every per-request buffer was handed over


def test_token_list_longer_than_the_engine_takes_is_refused(frozen):
    _, _, m = frozen
    with pytest.raises(ValueError, match="at most"):
        run_with_cache(m, [[5] * (m.max_model_len + 5)])
