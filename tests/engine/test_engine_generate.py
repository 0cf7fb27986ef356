"""Capture of generated tokens (engine/vllm/generate.py) against Hugging Face fp32 teacher-forced on
prompt + generation, one compiled freeze-mode engine per family (llama: fused residual trunk;
gpt2: plain block). max_num_batched_tokens=64 forces chunked prefill of the long prompts while
other requests decode in the same steps; n=2 samples each prompt twice.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.engine import Address, GenerateParams, load_model
from harvest.engine.capture.coverage import CoverageError
from tests.fixtures.models import tiny_model_path
from tests.support import runners
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, prompts, rel_err

pytestmark = pytest.mark.slow  # vLLM engines: not in `pytest -m 'not slow'`

LENGTHS = (5, 150, 37, 1, 90)
MAX_BATCHED = 64
NEW = 12


@pytest.fixture(scope="module", params=runners.params(("llama", "gpt2")))
def frozen(request):
    """Each family on both of vLLM's model runners (tests/support/runners.py)."""
    arch, runner = request.param
    path = tiny_model_path(arch)
    with runners.model_runner(runner):
        m = load_model(path, backend="vllm", freeze_points="auto", max_num_batched_tokens=MAX_BATCHED)
        yield arch, path, m
        m.close()


def _check_against_hf(path, m, out, toks, layers):
    """Every sample's rows equal HF fp32 run on exactly the tokens it fed, row for row."""
    flat = [r for per in out for r in per]
    ref, _ = hf_hidden_states(path, [r.token_ids.tolist() for r in flat])
    for r, hs in zip(flat, ref):
        p, g = r.prompt_len, len(r.generated)
        assert p == len(toks[r.index]) and 1 <= g <= NEW
        assert len(r) == p + g - 1  # the last sampled token is never fed: no row
        assert r.token_ids[:p].tolist() == toks[r.index]
        assert r.token_ids[p:].tolist() == r.generated[:-1].tolist()
        assert r.positions.tolist() == list(range(p + g - 1))
        for L in layers:
            got = r.point(Address("resid_post", L))
            assert got.shape == (p + g - 1, m.width)
            assert rel_err(got, hs[L + 1]) < BF16_REL_TOL, (r.index, r.sample, L)
            if g > 1:  # the decode rows on their own, and each one, not just on average
                d, ref_d = got[p:].float(), hs[L + 1][p:].float()
                assert rel_err(d, ref_d) < BF16_REL_TOL, (r.index, r.sample, L)
                per_row = (d - ref_d).norm(dim=1) / ref_d.norm(dim=1)
                assert float(per_row.max()) < 0.1, (r.index, r.sample, L)


def test_generated_rows_equal_hf_teacher_forced(frozen):
    arch, path, m = frozen
    toks = prompts(21, LENGTHS)
    gp = GenerateParams(max_new_tokens=NEW, temperature=1.0, seed=5, n=2, stop_at_eos=False)
    before = m.step_stats()
    out = m.generate_with_cache(toks, None, gp)
    after = m.step_stats()
    assert all(len(per) == 2 for per in out)
    # sampled with temperature 1: the two samples of a prompt differ (12 tokens from ~500)
    assert all(per[0].generated.tolist() != per[1].generated.tolist() for per in out)
    assert all(len(r.generated) == NEW and r.finish_reason == "length" for per in out for r in per)
    # prompt rows once each, then one decode row per fed generated token, nothing else
    fed = sum(len(r) for per in out for r in per)
    assert after["scheduled_tokens"] - before["scheduled_tokens"] == fed
    _check_against_hf(path, m, out, toks, range(m.n_layers - 1))
    # the same seed reproduces the same text, whatever else shares the steps
    again = m.generate_with_cache(toks[:2], ["resid_post.0"], gp)
    assert [[r.generated.tolist() for r in per] for per in again] == \
        [[r.generated.tolist() for r in per] for per in out[:2]]


def test_a_stop_token_ends_a_sample_and_its_rows(frozen):
    arch, path, m = frozen
    toks = prompts(22, (40, 9))
    gp = GenerateParams(max_new_tokens=NEW, temperature=1.0, seed=11, stop_at_eos=False)
    free = m.generate_with_cache(toks, ["resid_post.0"], gp)
    stop = int(free[0][0].generated[3])
    first = free[0][0].generated.tolist().index(stop)
    stopped = m.generate_with_cache(toks, ["resid_post.0", "resid_post.1"],
                                    GenerateParams(**{**gp.describe(), "stop": (stop,)}))
    r = stopped[0][0]
    assert r.generated.tolist() == free[0][0].generated.tolist()[: first + 1]
    assert r.finish_reason == "stop" and len(r) == 40 + first
    _check_against_hf(path, m, stopped, toks, (0, 1))


def test_a_decode_row_of_no_captured_request_fails_loudly(frozen):
    """A request vLLM runs beside the capture (never registered) decodes through the taps: its
    rows are stray, and the capture refuses to go on instead of skipping them silently."""
    from vllm import SamplingParams

    from harvest.engine.vllm import compat

    arch, path, m = frozen
    engine = m.llm.llm_engine
    compat.add_request(engine, "foreign", list(range(3, 10)),
                       SamplingParams(max_tokens=8, temperature=0.0, detokenize=False))
    with pytest.raises(CoverageError, match="belong to no captured request.*'foreign"):
        m.generate_with_cache(prompts(23, (20,)), None, GenerateParams(max_new_tokens=4))
    engine.abort_request([r for r in ("foreign",)])
    while engine.has_unfinished_requests():
        engine.step()
    # the engine is clean afterwards: the next generation is exact
    out = m.generate_with_cache(prompts(24, (30,)), ["resid_post.0"],
                                GenerateParams(max_new_tokens=5, temperature=0.0))
    _check_against_hf(path, m, out, prompts(24, (30,)), (0,))


def test_greedy_generation_follows_the_reference_argmax(frozen):
    """temperature 0: each generated token is the argmax of the logits of the row before it; the
    engine's bf16 logits may break a near-tie differently from fp32, so most (not all) agree."""
    from transformers import AutoModelForCausalLM

    arch, path, m = frozen
    toks = prompts(25, (30, 60))
    out = m.generate_with_cache(toks, ["resid_post.0"], GenerateParams(max_new_tokens=8,
                                                                       temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    agree = total = 0
    for per in out:
        r = per[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([r.token_ids.tolist()])).logits[0]
        pred = logits[r.prompt_len - 1:].argmax(-1).numpy()
        agree += int((pred == r.generated[: len(pred)]).sum())
        total += len(pred)
    assert agree >= 0.8 * total, (agree, total)
    assert np.all([len(per[0].generated) == 8 for per in out])
