"""Generation through the pipeline: 2 CPU actors with freeze-mode vLLM engines complete every
context's prompt into its slot (pipeline/generation.py); one actor is SIGKILLed while it has a
unit in flight, so Ray re-runs that unit in a new process and samples it again.

What is checked, slot by slot, against independent references: the prompt tokens are the packed
corpus; the `gen` column is prompt, sampled, last, padding in that order; every row with
activations equals Hugging Face fp32 run on exactly the stored tokens of its slot (so a unit that
mixed two attempts' samples would fail); rows without activations are zeros, outside the
statistics (a recount) and never yielded by the reader.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from harvest.pipeline.driver import run
from harvest.pipeline.store import open_store
from harvest.pipeline.store.layout import (GEN_LAST, GEN_PAD, GEN_PROMPT, GEN_SAMPLED, META_PAD)
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, rel_err
from tests.support.pipeline import CONTEXT, make_cfg

pytestmark = pytest.mark.slow  # Ray + vLLM pipeline runs: not in `pytest -m 'not slow'`

NEW = 8
STOP = list(range(100, 140))  # ~8% of a random tiny model's draws: some slots stop early


class KillOnce:
    """on_event: SIGKILL the actor that has units in flight, after the first unit is done."""

    def __init__(self):
        self.pids, self.killed, self.events = {}, None, []

    def __call__(self, e: dict) -> None:
        self.events.append(e)
        if e["event"] == "actors_ready":
            self.pids = {a["index"]: a["pid"] for a in e["actors"]}
        elif e["event"] == "unit_done" and self.killed is None:
            busy = [a for a, n in sorted(e["in_flight"].items()) if n > 0]
            victim = busy[0] if busy else 1 - e["actor"]
            os.kill(self.pids[victim], signal.SIGKILL)
            self.killed = (victim, self.pids[victim], bool(busy))


def test_generation_units_survive_a_killed_actor_and_match_hf(ray_cluster, tiny_llama, corpus,
                                                              reference, tmp_path):
    ref, _ = reference
    gen = {"max_new_tokens": NEW, "temperature": 1.0, "seed": 3, "stop": STOP,
           "stop_at_eos": False}
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   "capture.points=[resid_post.0, resid_post.2]",
                   capture={"generate": gen, "check_model": False})
    k = KillOnce()
    summary = run(cfg, on_event=k)
    assert k.killed is not None and summary["actor_restarts"] >= 1, summary
    store = open_store(cfg.store.resolved_url)
    v = store.verify(deep=True)
    assert v["ok"], v["errors"]
    assert store.n_rows == ref.packed.n_rows and not v["missing_units"]
    assert store.attrs["generation"]["prompt_len"] == CONTEXT - NEW
    done = [e["unit_id"] for e in k.events if e["event"] == "unit_done"]
    assert sorted(done) == ref.unit_ids  # each unit committed and reported once

    assert list(store.meta_columns) == ["token_id", "doc_id", "position", "gen"]
    tok, doc, pos = store.read_row_meta(0, store.n_rows)
    g = store.read_gen(0, store.n_rows, checked=True)
    P, C = CONTEXT - NEW, CONTEXT
    packed = ref.packed.token_ids.reshape(-1, C)
    slots, fed_lens = [], []
    for s in range(store.n_rows // C):
        a = s * C
        gs = g[a:a + C]
        assert np.array_equal(tok[a:a + P], packed[s, :P]), s  # the prompt is the corpus
        assert np.array_equal(doc[a:a + P], ref.packed.doc_ids[a:a + P])
        assert (gs[:P] == GEN_PROMPT).all()
        last = int(np.flatnonzero(gs == GEN_LAST)[0])
        assert (gs[P:last] == GEN_SAMPLED).all() and (gs[last + 1:] == GEN_PAD).all(), gs
        assert (tok[a + last + 1:a + C] == META_PAD).all() and (doc[a + last + 1:a + C] == META_PAD).all()
        G = last - P + 1  # sampled tokens; the last one has no row
        assert 1 <= G <= NEW
        assert G == NEW or int(tok[a + last]) in STOP  # an early end is a stop token
        assert not set(tok[a + P:a + last].tolist()) & set(STOP)
        slots.append(tok[a:a + last].tolist())
        fed_lens.append(last)
    assert min(fed_lens) < P + NEW - 1 < max(fed_lens) + 1  # some slots stopped early
    assert len({tuple(t[P:]) for t in slots}) > len(slots) // 2  # sampled, not one text

    # every row with activations equals HF fp32 on exactly the slot's stored tokens
    hs, _ = hf_hidden_states(tiny_llama, slots)
    acts = {p: torch.from_numpy(store.read(p, 0, store.n_rows).astype(np.float32))
            for p in ("resid_post.0", "resid_post.2")}
    for s, (t, h) in enumerate(zip(slots, hs)):
        a, n = s * C, len(t)
        for p, L in (("resid_post.0", 0), ("resid_post.2", 2)):
            assert rel_err(acts[p][a:a + n], h[L + 1]) < BF16_REL_TOL, (s, p)
            if n > P:
                assert rel_err(acts[p][a + P:a + n], h[L + 1][P:]) < BF16_REL_TOL, (s, p)
            assert (acts[p][a + n:a + C] == 0).all(), (s, p)  # last token and padding: zeros

    # statistics count exactly the rows with activations (a recount)
    have = np.isin(g, (GEN_PROMPT, GEN_SAMPLED))
    st = store.stats(["resid_post.2"], "all")["resid_post.2"]
    assert st["count"] == int(have.sum())
    x = acts["resid_post.2"][torch.from_numpy(have)].double()
    assert np.allclose(st["mean"], x.mean(0).numpy(), rtol=1e-4, atol=1e-5)

    # the reader yields exactly those rows
    from harvest.pipeline.store.reader import ActivationDataset

    ds = ActivationDataset(cfg.store.resolved_url, "resid_post.2", batch_size=512, shuffle=False,
                           return_meta=True)
    rows = np.concatenate([b["row"].numpy() for b in ds])
    assert np.array_equal(np.sort(rows), np.flatnonzero(have))
