"""vLLM freeze capture against the Hugging Face reference, one compiled engine per architecture
and model runner (V1 and V2).

Each engine start costs 10-50 s on 2 cores, so one module-scoped engine per architecture serves
every test here; max_num_batched_tokens=64 forces chunked prefill (prompts up to 150 tokens) and
several requests per step.
"""

from __future__ import annotations

import pytest
import torch

from harvest.engine import Address, load_model, run_with_cache
from tests.fixtures.models import ARCHS, tiny_model_path
from tests.support import runners
from tests.support.engine_reference import (BF16_REL_TOL, final_norm, hf_hidden_states, prompts,
                                             rel_err)

pytestmark = pytest.mark.slow  # vLLM engines: not in `pytest -m 'not slow'`

LENGTHS = (5, 37, 150, 64, 90, 17, 1, 120)
MAX_BATCHED = 64


@pytest.fixture(scope="module", params=runners.params(ARCHS))
def frozen(request):
    """Every architecture on both of vLLM's model runners (tests/support/runners.py)."""
    arch, runner = request.param
    path = tiny_model_path(arch)
    with runners.model_runner(runner):
        m = load_model(path, backend="vllm", freeze_points="auto", max_num_batched_tokens=MAX_BATCHED)
        assert m.describe()["model_runner"] == runner
        yield arch, path, m
        m.close()


def test_freeze_resid_post_every_layer_equals_hf(frozen):
    arch, path, m = frozen
    toks = prompts(1, LENGTHS)
    before = m.step_stats()
    got = run_with_cache(m, toks)
    after = m.step_stats()
    # Chunked prefill really happened: the 150-token prompt needs >= 3 steps of 64 rows.
    assert after["steps"] - before["steps"] >= sum(LENGTHS) // MAX_BATCHED
    assert after["scheduled_tokens"] - before["scheduled_tokens"] == sum(LENGTHS)
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
    """The tap buffer is NaN-poisoned before every forward: a delivered row that no compiled-in
    tap wrote in that very step would be NaN. Python hooks, in contrast, never fire."""
    arch, _, m = frozen
    from vllm.config import CompilationMode

    assert m.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    toks = prompts(3, (30, 70))  # 64 + 36 rows: the last step leaves rows 36.. of the buffer
    clean = run_with_cache(m, toks)
    hook_calls = []
    h = m.state.layers[0].register_forward_hook(lambda *a: hook_calls.append(1))
    m.set_poison(True)
    try:
        got = run_with_cache(m, toks)
        assert torch.isnan(m.state.taps.buf[:, MAX_BATCHED - 1]).all()  # the poison was there
    finally:
        m.set_poison(False)
        h.remove()
    assert hook_calls == []
    for g, c in zip(got, clean):
        for a in g:
            assert not torch.isnan(g[a]).any() and torch.equal(g[a], c[a]), (arch, a)


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
    assert not m.state.dests and not m.state.tickets  # every request was handed over


def test_token_list_longer_than_the_engine_takes_is_refused(frozen):
    _, _, m = frozen
    with pytest.raises(ValueError, match="at most"):
        run_with_cache(m, [[5] * (m.max_model_len + 5)])


def test_rows_land_in_caller_memory_from_a_destination_provider(frozen):
    """One host copy: the rows are written straight into the caller's buffer (a stand-in for the
    writer's [points, shard_rows, width] shard buffer), equal to a default capture's rows."""
    arch, _, m = frozen
    toks = prompts(6, (40, 90, 7))
    pts = ["resid_post.1", "resid_post.3"]
    want = run_with_cache(m, toks, pts)
    shard = torch.full((2, 256, m.width), float("nan"), dtype=m.dtype)
    offsets = [0, 40, 130]
    asked = []

    def dest(index, n):
        asked.append((index, n))
        return shard[:, offsets[index] : offsets[index] + n]

    got = {r.index: r for r in m.capture([toks], pts, destinations=dest)}
    assert sorted(asked) == [(0, 40), (1, 90), (2, 7)]
    for i, t in enumerate(toks):
        assert got[i].acts.data_ptr() == shard[:, offsets[i]].data_ptr()
        for j, p in enumerate(pts):
            assert torch.equal(shard[j, offsets[i] : offsets[i] + len(t)], want[i][Address.parse(p)])
    assert torch.isnan(shard[:, 137:]).all()  # nothing written outside the requests' slices


def test_cpu_taps_deliver_rows_equal_to_the_tap_buffer_path(frozen):
    """On a CPU engine the compiled taps write each request's rows straight into its destination
    (engine/capture/direct.py); the same capture through the tap buffer and the transport's
    copies gives the same rows, bit for bit (a subset of the frozen points, reordered; requests
    split over chunked-prefill steps)."""
    _, _, m = frozen
    toks = prompts(9, (40, 90, 7, 130))
    pts = ["resid_post.2", "resid_post.0"]
    before = m.state.direct_steps
    direct = run_with_cache(m, toks, pts)
    assert m.state.direct_steps - before >= sum(map(len, toks)) // MAX_BATCHED
    sink, m.state.sink = m.state.sink, None
    try:
        steps = m.state.direct_steps
        buffered = run_with_cache(m, toks, pts)
        assert m.state.direct_steps == steps
    finally:
        m.state.sink = sink
    for a, b in zip(direct, buffered):
        for p in pts:
            assert torch.equal(a[Address.parse(p)], b[Address.parse(p)]), p


def test_a_wrong_destination_is_refused_before_anything_runs(frozen):
    _, _, m = frozen
    bad = lambda i, n: torch.zeros(1, n, m.width, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype|shape"):
        list(m.capture([prompts(7, (10,))], ["resid_post.0"], destinations=bad))
    assert not m.state.dests


def test_stopping_early_aborts_the_rest_and_leaves_the_engine_clean(frozen):
    arch, path, m = frozen
    toks = prompts(8, (60, 60, 60, 60, 60))
    stream = m.capture([toks], ["resid_post.0"], max_in_flight_tokens=120)
    first = next(stream)
    stream.close()
    assert not m.state.dests and not m.state.tickets
    got = run_with_cache(m, toks[:2], ["resid_post.0"])  # the engine still captures correctly
    ref, _ = hf_hidden_states(path, toks[:2])
    for i in range(2):
        assert rel_err(got[i][Address("resid_post", 0)], ref[i][1]) < BF16_REL_TOL
    assert first.index in range(5)
