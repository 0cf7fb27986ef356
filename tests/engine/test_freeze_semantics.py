"""The freeze rules on real engines, on both of vLLM's model runners.

tests/capture/test_addresses.py pins `resolve_freeze_points` case by case (the seed system's
rules); this module builds an engine for each distinct plan those cases resolve to and checks
that the engine does what the plan says: which mode it runs in, whether vLLM runs it as a graph
(not enforce_eager), which points it reads and serves, where it takes a steering vector, and what
it refuses. Cases that resolve to the same plan as another share its engine (they are asserted
equal at the resolver). One tiny llama engine per plan, vLLM's compilation off (NO_COMPILE: the
taps are the same wrappers, run eagerly; the compiled path is tests/engine/test_engine_vllm.py's).
"""

from __future__ import annotations

import pytest
import torch

from harvest.engine import Address, load_model, resolve_freeze_points, run_with_cache
from harvest.engine.model_check import NO_COMPILE
from tests.fixtures.models import tiny_model_path
from tests.support import runners
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, prompts, rel_err

pytestmark = pytest.mark.slow  # vLLM engines: not in `pytest -m 'not slow'`

N = 4  # the tiny llama's layers
ALL = [f"resid_post.{i}" for i in range(N)]

# plan name -> (load_model arguments, mode, reads, writes, runs as a graph); each of the seed's
# cases below names the plan it resolves to
PLANS = {
    "auto": ({"freeze_points": "auto"}, "freeze", ALL, ALL, True),
    "hooked": ({}, "hooked", [], [], False),
    "reads_no_writes": ({"freeze_points": "auto", "freeze_writes": []}, "freeze", ALL, [], True),
    "read_list": ({"freeze_points": ["resid_post.1", "resid_pre.0"]}, "freeze",
                  ["resid_post.1", "resid_pre.0"], [], True),
    "writes_only": ({"freeze_writes": ["resid_post.2"]}, "freeze", [], ["resid_post.2"], True),
    "plain": ({"freeze_points": []}, "plain", [], [], True),
}
CASES = {  # the seed's rules (test_addresses.py), as load_model arguments -> plan
    "auto reads resid_post everywhere and writes where it reads": ({"freeze_points": "auto"}, "auto"),
    "no list with enforce_eager=False is auto": ({"enforce_eager": False}, "auto"),
    "no list, enforce_eager unset: hooked": ({}, "hooked"),
    "freeze_writes=[] keeps the reads without write buffers":
        ({"freeze_points": "auto", "freeze_writes": []}, "reads_no_writes"),
    "freeze_writes=[] alone is not graph mode": ({"freeze_writes": []}, "hooked"),
    "an explicit read list implies no writes":
        ({"freeze_points": ["resid_post.1", "resid_pre.0"]}, "read_list"),
    "a named write without reads stays writes-only": ({"freeze_writes": ["resid_post.2"]},
                                                      "writes_only"),
    "an empty list is graph mode with no taps": ({"freeze_points": []}, "plain"),
    "enforce_eager=True alone is hooked": ({"enforce_eager": True}, "hooked"),
}


def _plan_of(kw: dict):
    return resolve_freeze_points(kw.get("freeze_points"), N, 1, kw.get("freeze_writes"),
                                 kw.get("enforce_eager"))


def test_every_case_resolves_to_its_plan():
    for name, (kw, plan) in CASES.items():
        assert _plan_of(kw) == _plan_of(PLANS[plan][0]), name
    for kw in ({"freeze_points": ["resid_post.0"]}, {"freeze_points": []},
               {"freeze_points": None, "freeze_writes": ["resid_post.0"]}):
        with pytest.raises(ValueError, match="omit freeze_points"):   # before vLLM starts
            load_model(tiny_model_path("llama"), backend="vllm", enforce_eager=True, **kw)


@pytest.fixture(scope="module", params=[pytest.param((p, r), id=f"{p}-{r}")
                                        for r in runners.RUNNERS for p in PLANS])
def planned(request):
    plan, runner = request.param
    kw, *_ = PLANS[plan]
    path = tiny_model_path("llama")
    with runners.model_runner(runner):
        # freeze_points given even when None: load_model's own default is "auto"
        m = load_model(path, backend="vllm", max_num_batched_tokens=64,
                       **{"freeze_points": None, **kw}, **NO_COMPILE)
        assert m.describe()["model_runner"] == runner
        yield plan, path, m
        m.close()


def test_the_engine_runs_its_plan(planned):
    plan, path, m = planned
    _, mode, reads, writes, graph = PLANS[plan]
    assert m.mode == mode
    assert m.llm.llm_engine.vllm_config.model_config.enforce_eager is (not graph)
    got_reads = [str(a) for a in m.frozen.reads] if m.frozen else []
    got_writes = [str(a) for a in m.frozen.writes] if m.frozen else []
    assert (got_reads, got_writes) == (reads, writes)
    toks = prompts(31, (23, 70))
    if mode == "plain" or (mode == "freeze" and not reads):
        with pytest.raises(ValueError, match="cannot serve|no capture|plain"):
            run_with_cache(m, toks, ["resid_post.1"])
        return
    pts = reads if mode == "freeze" else ["resid_post.1", "mlp_out.2", "resid_pre.0"]
    got = run_with_cache(m, toks, pts)
    ref, _ = hf_hidden_states(path, toks)
    for g, hs in zip(got, ref):
        assert list(g) == [Address.parse(p) for p in pts]
        for p in pts:
            a = Address.parse(p)
            if a.name == "resid_post" and a.layer < N - 1:
                assert rel_err(g[a], hs[a.layer + 1]) < BF16_REL_TOL, (plan, p)
            elif a.name == "resid_pre":
                assert rel_err(g[a], hs[0]) < BF16_REL_TOL, (plan, p)
    if mode == "freeze":   # a frozen engine serves its set only
        outside = next(p for p in ["resid_post.0", "resid_pre.2"] if p not in reads)
        with pytest.raises(ValueError, match=f"cannot serve {outside}"):
            run_with_cache(m, toks, [outside])


def test_steering_only_where_the_plan_writes(planned):
    plan, _, m = planned
    _, mode, reads, writes, _ = PLANS[plan]
    vec = torch.linspace(-1, 1, m.width)
    for site in ("resid_post.0", "resid_post.2"):
        if site not in writes:
            with pytest.raises(ValueError, match="has no write buffer"):
                m.set_steering(site, vec)
    if not writes:
        return
    site = writes[0] if plan == "writes_only" else "resid_post.0"
    if not reads:   # writes only: the vector is taken (nothing here can read it back)
        m.set_steering(site, vec)
        m.set_steering(site, torch.zeros(m.width))
        return
    toks = prompts(32, (25,))
    base = run_with_cache(m, toks, [site])[0][Address.parse(site)]
    m.set_steering(site, vec)
    try:
        steered = run_with_cache(m, toks, [site])[0][Address.parse(site)]
    finally:
        m.set_steering(site, torch.zeros(m.width))
    assert rel_err((steered.float() - base.float()).mean(0), vec) < BF16_REL_TOL
