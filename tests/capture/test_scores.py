"""logprob / entropy (engine/capture/scores.py) without an engine: the chunked computation
against a whole-vocabulary log_softmax, the next-token map of a step's rows, and the float32
values surviving a bf16 tap buffer bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harvest.engine.capture import scores
from harvest.engine.points import BY_NAME, LOGIT_POINTS, point_width


def test_points_are_model_level_float32_scalars():
    assert LOGIT_POINTS == ("logprob", "entropy")
    for name in LOGIT_POINTS:
        p = BY_NAME[name]
        assert (p.width, p.level, p.tp, p.logits) == ("scalar", "model", "replicated", True)
        assert point_width({"hidden_size": 64}, name) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_keeps_float32_bits(dtype):
    v = torch.tensor([-1e-7, -3.14159274, float("nan"), 12.5, -88.0], dtype=torch.float32)
    packed = scores.pack(v, dtype)
    assert packed.dtype == dtype and packed.shape == (5, scores.slot_width(dtype))
    # through a strided slot of a wider buffer, as the taps write it
    buf = torch.zeros(3, 8, 6, dtype=dtype)
    buf[1, :5, :packed.shape[1]].copy_(packed)
    back = scores.unpack(buf[1, :5, :packed.shape[1]])
    assert back.dtype == torch.float32
    assert torch.equal(back.view(torch.int32), v.view(torch.int32))


def test_next_token_ids_follow_chunks_and_end_with_none():
    prompts = {"a": np.arange(10, 20), "b": np.arange(100, 104)}
    # a: positions 4..7 (a middle chunk: row 7's next token is from the prompt, not this step);
    # b: positions 2..3 (its last chunk: position 3 has no next token); c: unknown prompt
    got = scores.next_token_ids(("a", "b", "c"), [4, 2, 1], [4, 2, 0], prompts)
    assert got.tolist() == [15, 16, 17, 18, 103, -1, -1]


def test_scores_match_a_whole_vocab_log_softmax_in_chunks(monkeypatch):
    torch.manual_seed(0)
    n, d, vocab = 37, 16, 50
    hidden = torch.randn(n, d)
    head = torch.randn(vocab, d)
    calls = []

    def compute_logits(h):
        calls.append(h.shape[0])
        return 30.0 * torch.tanh(h @ head.T / 30.0)   # a softcapped head

    monkeypatch.setattr(scores, "CHUNK_BYTES", 4 * vocab * 8)   # 8 rows per chunk
    monkeypatch.setattr(scores, "CPU_PASS_ROWS", 3)   # passes of 3 rows: not a divisor of 8
    nxt = torch.randint(0, vocab, (n,))
    nxt[[5, 36]] = -1
    lp, ent = scores.scores(hidden, nxt, compute_logits, vocab)
    assert calls == [8, 8, 8, 8, 5]
    logp = torch.log_softmax(compute_logits(hidden), -1)
    want_lp = logp[torch.arange(n), nxt.clamp(min=0)]
    assert torch.isnan(lp[[5, 36]]).all() and not torch.isnan(lp[:5]).any()
    keep = nxt >= 0
    torch.testing.assert_close(lp[keep], want_lp[keep])
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))


def test_entropy_is_finite_with_minus_inf_logits():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    lp, ent = scores.scores(torch.zeros(1, 2), torch.tensor([1]), lambda h: logits, 4)
    torch.testing.assert_close(ent, torch.tensor([np.log(2.0)], dtype=torch.float32))
    torch.testing.assert_close(lp, torch.tensor([-np.log(2.0)], dtype=torch.float32))


def test_a_rank_without_the_gathered_logits_gets_none():
    assert scores.scores(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long),
                         lambda h: None, 10) is None


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_eager_backend_serves_the_scores(arch):
    """The Hugging Face backend (the pipeline's reference engine) yields the same two columns,
    batched and padded, as the independent per-prompt reference (gemma2: softcapped logits)."""
    from harvest.engine import load_model, run_with_cache
    from tests.fixtures.models import tiny_model_path
    from tests.support.engine_reference import prompts
    from tests.support.hf_logits import scores_of

    toks = prompts(3, (9, 1, 30, 4))
    m = load_model(tiny_model_path(arch), backend="eager", dtype="float32")
    try:
        got = run_with_cache(m, toks, ["entropy.0", "logprob.0"])
        for g, t in zip(got, toks):
            want = scores_of(m.model, t)
            for name in ("logprob", "entropy"):
                assert g[f"{name}.0"].dtype == torch.float32
                torch.testing.assert_close(g[f"{name}.0"], want[name], equal_nan=True,
                                           atol=1e-4, rtol=1e-4)
            assert torch.isnan(g["logprob.0"][-1])
    finally:
        m.close()


def test_check_model_measures_the_scores_per_row():
    """check_loaded's per-row figures on one value per row (nats, relative above 1 nat), with
    the last position's NaN matched by the reference's; an eager bf16 engine passes its own gap."""
    from harvest.engine import check_loaded, load_model
    from harvest.engine.model_check import CheckConfig, row_errors
    from tests.fixtures.models import tiny_model_path

    nan = float("nan")
    errs = row_errors(torch.tensor([-2.0, -0.5, nan]), torch.tensor([-1.0, -0.25, nan]))
    assert errs.tolist() == [1.0, 0.25, 0.0]
    assert np.isnan(row_errors(torch.tensor([nan]), torch.tensor([-1.0]))).all()
    m = load_model(tiny_model_path("llama"), backend="eager")
    try:
        out = check_loaded(m, points=["logprob.0", "entropy.0"],
                           cfg=CheckConfig(lengths=(5, 40, 17)))
    finally:
        m.close()
    assert out["ok"], out["points"] if "points" in out else out
    assert set(out["points"]) == {"logprob.0", "entropy.0"}


def test_runner_step_scores_each_request_from_its_own_prompt():
    """ScoreStep over a step of two requests (one mid-prefill, one finishing), with the
    runner's final hidden states and compute_logits stood in: prompts tracked from the
    scheduler's new requests and forgotten when finished; values written through `write`."""
    from types import SimpleNamespace as NS

    from harvest.engine.vllm.compat import StepLayout
    from harvest.engine.vllm.scorestep import ScoreStep

    torch.manual_seed(1)
    vocab, d = 11, 4
    head = torch.randn(vocab, d)
    hidden = torch.randn(9, d)   # 7 real rows and padding
    model = NS(compute_logits=lambda h: h @ head.T)
    runner = NS(execute_model_state=NS(hidden_states=hidden), get_model=lambda: model)
    st = ScoreStep({"logprob": 0, "entropy": 1}, vocab, torch.bfloat16)
    st.track(NS(finished_req_ids=set(), scheduled_new_reqs=[
        NS(req_id="a", prompt_token_ids=[1, 2, 3, 4, 5, 6]), NS(req_id="b", prompt_token_ids=[7, 8, 9])]))
    lay = StepLayout(("a", "b"), np.array([4, 3]), np.array([0, 0]), 7)
    out = {}
    st.run(runner, lay, lambda x, slot: out.__setitem__(slot, scores.unpack(x)))
    logp = torch.log_softmax(hidden[:7] @ head.T, -1)
    nxt = [2, 3, 4, 5, 8, 9]
    rows = [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(out[0][rows], logp[rows, nxt])
    assert torch.isnan(out[0][6])   # b's last prompt position
    torch.testing.assert_close(out[1], -(logp.exp() * logp).sum(-1))
    st.track(NS(finished_req_ids={"a"}, scheduled_new_reqs=[]))
    assert set(st.prompts) == {"b"}
