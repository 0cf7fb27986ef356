"""Preemption: a KV cache too small for the batch makes vLLM evict running requests and recompute
them from their first token later. Every row must still match Hugging Face, row for row.

The engine is the hooked mode (enforce_eager: starts in seconds); its rows take the same path
as freeze mode's (runner, row map, coverage, transport), only the taps are Python hooks.
`long_prefill_token_threshold` caps each request's chunk so several prompts grow side by side
and run out of KV blocks part-way, which is when vLLM's scheduler preempts.
"""

from __future__ import annotations

import pytest

from harvest.engine import Address, load_model
from tests.fixtures.models import tiny_model_path
from tests.support import runners
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, prompts, rel_err

pytestmark = pytest.mark.slow  # a vLLM engine under preemption: not in `pytest -m 'not slow'`

MAX_LEN = 256
# tiny llama: 4 layers x (k, v) x 1 KV head x 64 x 2 bytes = 1 KiB of KV per token, so this is
# room for 640 tokens while six prompts of ~200 tokens are admitted side by side.
KV_BYTES = 640 << 10


@pytest.fixture(scope="module", params=runners.RUNNERS)
def cramped(request):
    """On both of vLLM's model runners: V2 orders a step's requests its own way (decode first)
    and rebuilds its batch every step, which preemption exercises."""
    path = tiny_model_path("llama")
    with runners.model_runner(request.param):
        m = load_model(path, backend="vllm", enforce_eager=True, max_model_len=MAX_LEN,
                       max_num_batched_tokens=128, max_num_seqs=8, kv_cache_memory_bytes=KV_BYTES,
                       long_prefill_token_threshold=32, block_size=32)
        yield path, m
        m.close()


def test_preempted_requests_are_recomputed_and_match_hf_row_for_row(cramped):
    path, m = cramped
    toks = prompts(11, (200, 180, 220, 150, 210, 190))
    pts = ["resid_post.0", "resid_post.2"]  # not the last layer: HF applies the final norm there
    got = [None] * len(toks)
    # all six in flight at once (the default budget would admit only ~600 tokens)
    for req in m.capture([toks], pts, max_in_flight_tokens=sum(map(len, toks))):
        got[req.index] = req.as_dict()
    summary = m.state.summary()
    # vLLM recomputed chunks: the same positions arrived again and overwrote the first rows
    assert summary["rewrites"] > 0, summary
    assert summary["rows"] == sum(map(len, toks))
    ref, _ = hf_hidden_states(path, toks)
    for i, t in enumerate(toks):
        for p in pts:
            a = Address.parse(p)
            assert got[i][a].shape == (len(t), m.width)
            assert rel_err(got[i][a], ref[i][a.layer + 1]) < BF16_REL_TOL, (i, p)
        # row for row, not just on average: each row is nearest its own HF row
        g, r = got[i][Address("resid_post", 2)].float(), ref[i][3].float()
        per_row = (g - r).norm(dim=1) / r.norm(dim=1)
        assert float(per_row.max()) < 0.1, (i, float(per_row.max()))


def test_preempted_generations_are_recomputed_and_match_hf_teacher_forced(cramped):
    """Decode steps grow every request's KV blocks until vLLM evicts one; it is recomputed from
    its first token, prompt and generated tokens alike, and its decode rows still match HF fp32
    on exactly the tokens it fed, row for row."""
    from harvest.engine import GenerateParams

    path, m = cramped
    toks = prompts(12, (150, 140, 160, 130, 150))
    before = m.state.summary()["rewrites"]
    gp = GenerateParams(max_new_tokens=60, temperature=1.0, seed=4, stop_at_eos=False)
    # all five in flight at once (the default budget would admit about two)
    out = sorted(m.generate([toks], ["resid_post.2"], gp, max_in_flight_tokens=10_000),
                 key=lambda r: r.index)
    assert m.state.summary()["rewrites"] > before  # something was recomputed
    ref, _ = hf_hidden_states(path, [r.token_ids.tolist() for r in out])
    for r, hs in zip(out, ref):
        assert len(r.generated) == 60 and len(r) == len(toks[r.index]) + 59
        g, h = r.point("resid_post.2").float(), hs[3].float()
        per_row = (g - h).norm(dim=1) / h.norm(dim=1)
        assert rel_err(g, h) < BF16_REL_TOL and float(per_row.max()) < 0.1, r.index
        assert rel_err(g[r.prompt_len:], h[r.prompt_len:]) < BF16_REL_TOL, r.index
