"""Generation through the pipeline: CPU actors with freeze-mode vLLM engines complete every
context's prompt n = 2 times into its slot (pipeline/actor/generation.py).

1. Text: 2 actors; one is SIGKILLed while it has a unit in flight, so Ray re-runs that unit in a
   new process and samples it again.
2. Chat: the tiny model with a ChatML-like template, conversations completed as the assistant,
   capture.roles: [assistant] (1 actor: the killed-actor path is the text run's).

What is checked, slot by slot, against independent references: the prompt tokens are the packed
corpus (chat: the conversation rendered with the template's generation prompt); the `gen` column
is prompt, then per sample its sampled rows, last, padding; the `sample` column is recounted
(every slot has each sample 0..n-1 exactly once, in its own region); every row with activations
equals Hugging Face fp32 run on exactly the stored tokens of its own sample (so a unit that mixed
two attempts' samples, or two samples' rows, would fail); rows without activations are zeros,
outside the statistics (a recount) and never yielded by the reader.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from harvest.store.format.layout import (GEN_LAST, GEN_PAD, GEN_PROMPT, GEN_SAMPLED, META_PAD)
from harvest.store.format.roles import ASSISTANT, PAD
from tests.support.engine_reference import BF16_REL_TOL, hf_hidden_states, rel_err
from tests.support.pipeline import CONTEXT, EAGER_VLLM, SHARD_ROWS, make_cfg

pytestmark = pytest.mark.slow  # Ray + vLLM pipeline runs: not in `pytest -m 'not slow'`

NEW, N = 6, 2
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


def check_slots(store, model: str, prompts: list, roles=None, kept=None, stops=STOP) -> np.ndarray:
    """Every slot of a generation store against HF fp32 on its own stored tokens (see the module
    docstring); `prompts[s]`: slot s's prompt tokens; `roles[s]`: its prompt's roles (chat) and
    `kept`: the role codes stored (capture.roles). Returns the rows that hold activations."""
    C, M = store.context_size, NEW
    tok = store.read_row_meta(0, store.n_rows)[0]
    g = store.read_gen(0, store.n_rows, checked=True)
    smp = store.read_sample(0, store.n_rows, checked=True)
    role = None if roles is None else np.asarray(store.meta_array("role")[:])
    early, seqs, where = 0, [], []  # per (slot, sample): its tokens; (slot row, L, fed generated rows)
    for s, prompt in enumerate(prompts):
        a, L = s * C, len(prompt)
        assert np.array_equal(tok[a:a + L], prompt), s
        assert (g[a:a + L] == GEN_PROMPT).all() and (smp[a:a + L] == 0).all()
        if roles is not None:
            assert np.array_equal(role[a:a + L], roles[s])
        lasts = []
        for k in range(N):
            r = a + L + k * M
            gs = g[r:r + M]
            last = int(np.flatnonzero(gs == GEN_LAST)[0])
            assert (gs[:last] == GEN_SAMPLED).all() and (gs[last + 1:] == GEN_PAD).all(), gs
            assert (tok[r + last + 1:r + M] == META_PAD).all()
            assert last == M - 1 or int(tok[r + last]) in stops  # an early end is a stop token
            early += last < M - 1
            assert not set(tok[r:r + last].tolist()) & set(STOP)
            if roles is not None:
                assert (role[r:r + last + 1] == ASSISTANT).all() and (role[r + last + 1:r + M] == PAD).all()
            lasts += smp[r:r + M][gs == GEN_LAST].tolist()
            assert (smp[r:r + M] == k).all()
            seqs.append(list(prompt) + tok[r:r + last].tolist())
            where.append((r, L, last))
        assert sorted(lasts) == list(range(N)), (s, lasts)  # each sample once, none missing
        assert (g[a + L + N * M:a + C] == GEN_PAD).all() and (smp[a + L + N * M:a + C] == 0).all()
    assert early > 0  # some samples stopped early (the region's padding is exercised)
    gen_seqs = [tuple(t) for t in seqs]
    assert len(set(gen_seqs)) > len(gen_seqs) // 2  # sampled, not one text
    have = np.isin(g, (GEN_PROMPT, GEN_SAMPLED))
    stored = have if kept is None else have & np.isin(role, kept)

    hs, _ = hf_hidden_states(model, seqs)
    for p in store.points:
        L_ = int(p.split(".")[1])
        acts = torch.from_numpy(store.read(p, 0, store.n_rows).astype(np.float32))
        want = torch.zeros_like(acts)
        for j, ((r, L, fed), h) in enumerate(zip(where, hs)):
            if j % N == 0:  # the prompt's rows are sample 0's
                want[r - L:r] = h[L_ + 1][:L]
            want[r:r + fed] = h[L_ + 1][L:L + fed]
        want[torch.from_numpy(~stored)] = 0
        assert (acts[torch.from_numpy(~stored)] == 0).all(), p  # no activations: zeros
        rows = np.flatnonzero(stored)
        for j in range(0, rows.size, 64):
            i = rows[j:j + 64]
            assert rel_err(acts[i], want[i]) < BF16_REL_TOL, (p, i[0])
        err = ((acts[rows] - want[rows]).norm(dim=1) / want[rows].norm(dim=1)).max()
        assert err < 0.1, (p, float(err))  # and no single row far off

    # the `all` statistics count exactly the rows with activations (a recount; role-masked rows
    # too, as zeros: FORMAT.md "Chat"), the reader yields exactly the stored ones
    p = store.points[-1]
    x = torch.from_numpy(store.read(p, 0, store.n_rows).astype(np.float64))[torch.from_numpy(have)]
    st = store.stats([p], "all")[p]
    assert st["count"] == int(have.sum())
    assert np.allclose(st["mean"], x.mean(0).numpy(), rtol=1e-4, atol=1e-5)
    from harvest.store.read.dataset import ActivationDataset

    ds = ActivationDataset(store, p, batch_size=512, shuffle=False, return_meta=True)
    rows = np.concatenate([b["row"].numpy() for b in ds])
    assert np.array_equal(np.sort(rows), np.flatnonzero(stored))
    return stored


def test_generation_units_survive_a_killed_actor_and_match_hf(ray_cluster, tiny_llama, corpus,
                                                              reference, tmp_path):
    ref, _ = reference
    gen = {"max_new_tokens": NEW, "n": N, "temperature": 1.0, "seed": 3, "stop": STOP,
           "stop_at_eos": False}
    # 8 of the reference's 24 units (its first contexts: the corpus is one block): enough for
    # units in flight on both actors when one is killed, a third of the engine work
    units = 8
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   "capture.points=[resid_post.0, resid_post.2]", EAGER_VLLM,
                   f"packing.max_tokens={units * SHARD_ROWS}",
                   capture={"generate": gen, "check_model": False})
    k = KillOnce()
    summary = run(cfg, on_event=k)
    assert k.killed is not None and summary["actor_restarts"] >= 1, summary
    # sample 0's rows (prompt + its region) went straight into the shard buffers
    assert sum(a["rows_in_place"] or 0 for a in summary["per_actor"]) > 0, summary["per_actor"]
    store = open_store(cfg.store.resolved_url)
    v = store.verify(deep=True)
    assert v.ok, v.errors
    n_rows = units * SHARD_ROWS
    assert store.n_rows == n_rows <= ref.packed.n_rows and not v.missing_units
    P = CONTEXT - N * NEW
    assert store.attrs["generation"]["prompt_len"] == P
    done = [e["unit_id"] for e in k.events if e["event"] == "unit_done"]
    assert sorted(done) == list(range(units))  # each unit committed and reported once
    assert list(store.meta_columns) == ["token_id", "doc_id", "position", "gen", "sample"]
    packed = ref.packed.token_ids[:n_rows].reshape(-1, CONTEXT)
    doc = store.read_row_meta(0, store.n_rows)[1].reshape(-1, CONTEXT)
    assert np.array_equal(doc[:, :P], ref.packed.doc_ids[:n_rows].reshape(-1, CONTEXT)[:, :P])
    check_slots(store, tiny_llama, [packed[s, :P] for s in range(len(packed))])


# A ChatML-like template over the tiny tokenizer's own special tokens (it has no chat template)
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_chat_prompts_are_completed_as_the_assistant_and_match_hf(ray_cluster, tiny_llama,
                                                                 tmp_path):
    import json
    import shutil

    from transformers import AutoTokenizer

    from harvest.pipeline.data.chat import label_conversation

    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_llama, model)
    t = AutoTokenizer.from_pretrained(model)
    t.chat_template = TEMPLATE
    t.save_pretrained(model)
    convs = []
    for i in range(10):
        c = [{"role": "user", "content": f"What is {i} and {i + 1}?"}]
        if i % 3 == 0:  # an earlier assistant turn: stored with capture.roles [assistant]
            c = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}] + c
        convs.append(c)
    convs.insert(4, [{"role": "user", "content": "long " * 80}])  # past the prompt room: skipped
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    C = 64
    gen = {"max_new_tokens": NEW, "n": N, "temperature": 1.0, "seed": 5, "stop": STOP}
    # eager (EAGER_VLLM): the model is a copy in tmp_path, a compile-cache miss on every run;
    # compiled generation is tests/engine/test_engine_generate.py's
    cfg = make_cfg(str(model), str(tmp_path / "store"), data, "model.backend=vllm",
                   "model.max_num_batched_tokens=256", "model.gpu_memory_utilization=0.1",
                   EAGER_VLLM, data={"format": "chat"},
                   packing={"context_size": C, "bos": "none", "max_tokens": None},
                   capture={"points": ["resid_post.1"], "roles": ["assistant"],
                            "generate": gen, "check_model": False},
                   store={"shard_rows": 4 * C}, ray={"num_actors": 1})
    summary = run(cfg)
    assert summary["data"]["skipped_reasons"] == {"prompt_too_long": 1}, summary["data"]
    store = open_store(cfg.store.resolved_url)
    assert store.verify(deep=True).ok
    eos = t.convert_tokens_to_ids("<|eos|>")
    assert eos in store.attrs["generation"]["stop_ids"]  # the template's end of turn
    labelled = [label_conversation(t, c, generation_prompt=True) for c in convs if len(c[0]["content"]) < 100]
    assert store.n_rows == len(labelled) * C
    stored = check_slots(store, str(model), [np.asarray(i) for i, _ in labelled],
                         roles=[r for _, r in labelled], kept=[ASSISTANT], stops=STOP + [eos])
    role = np.asarray(store.meta_array("role")[:])
    # stored: the generated rows and the prompts' assistant turns, nothing else
    g = store.read_gen(0, store.n_rows)
    assert np.array_equal(stored, (role == ASSISTANT) & np.isin(g, (GEN_PROMPT, GEN_SAMPLED)))
    assert (stored & (g == GEN_PROMPT)).any() and (stored & (g == GEN_SAMPLED)).any()
