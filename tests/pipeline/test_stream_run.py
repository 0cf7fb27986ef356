"""Streamed runs on a real local Ray cluster (issue 49): 2 eager capture actors feed 2 trainer
ranks with no store in between.

Run 1 (two ranks as threads of this process): one capture actor is SIGKILLed mid-stream, then
rank 1 stops reading for 30 s. Run 2 (two ranks as external processes that join through the
cluster's address; a tee writes the store; norm_scale normalisation): nothing killed. Both are
held to the single-process reference that every store capture of this config equals bit for bit
(tests/support/pipeline.check_store), to each other (the kill changes nothing a rank receives),
and run 2's tee store to the same reference.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from harvest.pipeline.config.run import load_config
from harvest.store import open_store
from tests.support.pipeline import CONTEXT, check_store, make_cfg
from tests.support.stream_rank import read_rank

# Ray runs with the eager backend: beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]

POINT = "resid_post.1"
SEND_ROWS = 256
OPTS = {"points": POINT, "batch_size": 64, "return_meta": True, "exclude_special": True,
        "seqpos": [2, None], "shuffle_buffer_rows": 256}
PAUSE_S = 30.0      # rank 1 reads nothing for at least this long...
SETTLED_SAMPLES = 10  # ...and until the capture has been blocked for this many 1 s samples
PAUSE_DEADLINE_S = 300.0


def blocked(sample: dict) -> bool:
    """Every capture actor is up and holds rows for rank 1 (its queue to the paused rank is
    where it waits) and none for rank 0 (everything for rank 0 left it)."""
    return all(f is not None and f.held_rows[1] > 0 and f.held_rows[0] == 0
               for f in sample["actors"])


def settled(samples: list[dict]) -> list[dict]:
    """The samples after the first one at which the capture was blocked (a sample is a moment:
    rows that left the actors just before it may still be on their way to rank 0)."""
    first = next((i for i, x in enumerate(samples) if blocked(x)), len(samples))
    return samples[first + 1:]


def _cfg(model, corpus, tmp, *overrides):
    return make_cfg(model, str(tmp / "store"), corpus, f"stream.name=t{uuid.uuid4().hex[:10]}",
                    f"stream.send_buffer_rows={SEND_ROWS}", "stream.take_rows=128",
                    "stream.linger_s=20", "stream.rank_timeout_s=45", *overrides)


class Trainers:
    """Run 1's two ranks: rank 1 kills actor 0 after its 2nd batch and stops reading after its
    6th, for PAUSE_S and until the capture has stayed blocked for SETTLED_SAMPLES samples (a
    condition, not a time: a loaded machine restarts the killed actor late), sampling both
    sides' memory and progress meanwhile."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.out: dict = {}
        self.errors: list = []
        self.killed = None
        self.samples: list[dict] = []
        self.rank0 = None

    def run(self) -> None:
        ts = [threading.Thread(target=self._rank, args=(r,), daemon=True) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        assert not any(t.is_alive() for t in ts), "a rank did not finish"

    def _rank(self, r: int) -> None:
        try:
            self.out[r] = read_rank(self.cfg, r, 2, OPTS, self._on_batch if r == 1 else
                                    self._keep_rank0)
        except BaseException as e:  # noqa: BLE001 -- asserted by the tests
            self.errors.append(e)

    def _keep_rank0(self, i, ds, rows) -> None:
        self.rank0 = ds

    def _on_batch(self, i: int, ds, rows) -> None:
        import ray

        if i == 1:
            pids = [ray.get(h.stream_figures.remote()).pid for h in ds.info.actors]
            self.killed = pids[0]
            os.kill(pids[0], signal.SIGKILL)
        if i == 5:
            handle = ds._handle
            t0 = time.monotonic()
            while time.monotonic() - t0 < PAUSE_DEADLINE_S and (
                    time.monotonic() - t0 < PAUSE_S or len(settled(self.samples)) < SETTLED_SAMPLES):
                self.samples.append(self._sample(ds, handle, time.monotonic() - t0))
                time.sleep(1.0)
            self.samples.append(self._sample(ds, handle, time.monotonic() - t0))

    def _sample(self, ds, handle, t: float) -> dict:
        import ray

        actors = []
        for h in ds.info.actors:
            try:
                actors.append(ray.get(h.stream_figures.remote(), timeout=10))
            except Exception:  # noqa: BLE001 -- restarting
                actors.append(None)
        st = ray.get(handle.status.remote())
        r0 = self.rank0.receiver.rows if self.rank0 is not None else None
        return {"t": t, "actors": actors, "units_done": st.units_done,
                "rank1": ds.figures(), "rank0_rows": r0}


@pytest.fixture(scope="module")
def run1(ray_cluster, tiny_llama, corpus, tmp_path_factory):
    cfg = _cfg(tiny_llama, corpus, tmp_path_factory.mktemp("run1"))
    t = Trainers(cfg)
    t.run()
    assert not t.errors, t.errors
    return t


def _spawn(ray_cluster, cfg, rank: int, out: str, **extra) -> subprocess.Popen:
    spec = {"address": ray_cluster.address, "config": cfg.to_dict(redact=False), "rank": rank,
            "world": 2, "opts": {**OPTS, "normalize": "norm_scale"}, "out": out, **extra}
    env = {**os.environ, **ray_cluster.env}
    return subprocess.Popen([sys.executable, "-m", "tests.support.stream_rank", json.dumps(spec)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def run2(ray_cluster, tiny_llama, corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run2")
    cfg = _cfg(tiny_llama, corpus, tmp, "stream.tee=true")
    procs = [_spawn(ray_cluster, cfg, r, str(tmp / f"rank{r}")) for r in (0, 1)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    out = {}
    for r in (0, 1):
        with np.load(tmp / f"rank{r}.npz") as z:
            out[r] = {k: z[k] for k in z.files}
        out[r].update(json.loads((tmp / f"rank{r}.json").read_text()))
    return cfg, out


def _kept_rows(reference) -> np.ndarray:
    """The rows the trainers' filter keeps: no special token (the BOS each context starts
    with), context position >= 2."""
    ref, _ = reference
    rows = np.arange(ref.packed.n_rows)
    bos = ref.packed.token_ids[0]
    return rows[(rows % CONTEXT >= 2) & (ref.packed.token_ids != bos)]


def _check_rows(got: dict, reference, bits: bool = True) -> None:
    ref, acts = reference
    rows = got["rows"]
    assert np.array_equal(got["token_id"], ref.packed.token_ids[rows])
    assert np.array_equal(got["doc_id"], ref.packed.doc_ids[rows])
    assert np.array_equal(got["position"], ref.packed.positions[rows])
    want = acts[POINT][rows].view(np.int16)
    if bits:
        same = (got["acts"] == want).all(axis=1)
        assert same.all(), f"{(~same).sum()} rows differ from the store capture's"


def test_two_actors_feed_two_ranks_disjoint_rows_in_equal_numbers_that_cover_the_corpus(
        run1, reference):
    a, b = run1.out[0], run1.out[1]
    kept = _kept_rows(reference)
    assert len(a["rows"]) == len(b["rows"]) == len(kept) // 2
    assert len(np.unique(a["rows"])) == len(a["rows"]) and not np.intersect1d(a["rows"], b["rows"]).size
    assert np.array_equal(np.sort(np.concatenate([a["rows"], b["rows"]])), kept[:2 * (len(kept) // 2)])
    assert a["batches"] == b["batches"]          # DDP steps stay equal
    d = a["describe"]
    assert d["window_rows"] == 256 and d["measured"]["batches"] > 0 and d["vs_uniform"] > 0


def test_every_streamed_row_is_the_store_captures_row_bit_for_bit(run1, reference):
    for r in (0, 1):
        _check_rows(run1.out[r], reference)


def test_a_killed_actor_mid_stream_is_recaptured_and_each_row_arrives_once(run1):
    summary = run1.out[0]["summary"]
    assert run1.killed is not None
    assert summary["actor_restarts"] + summary["unit_retries"] + summary["ray_task_retries"] >= 1, \
        summary
    figs = [run1.out[r]["figures"] for r in (0, 1)]
    assert sum(f["take_errors"] for f in figs) >= 1
    # rows taken twice (the first attempt's and the re-capture's) were dropped, not yielded
    assert all(f["rows"] == f["rows_yielded"] for f in figs)


def test_capture_pauses_and_memory_stays_bounded_while_a_rank_is_paused(run1):
    s = run1.samples
    assert s and s[-1]["t"] >= PAUSE_S - 1
    shown = [(round(x["t"]), x["units_done"], x["rank0_rows"],
              [f and (f.held_rows, f.rss_bytes >> 20) for f in x["actors"]]) for x in s]
    window = settled(s)
    # the capture blocked on the paused rank (every actor waiting on its queue to rank 1)
    assert len(window) >= SETTLED_SAMPLES, f"the capture never stayed blocked: {shown}"
    # the capture paused: no unit finished while rank 1 read nothing (after the buffers filled),
    # and the run was not over (it finished after the pause: every row arrived, test above)
    assert window[0]["units_done"] == window[-1]["units_done"], shown
    assert window[-1]["units_done"] < run1.out[0]["summary"]["units"]
    assert any(f is not None and f.held_rows[1] > 0 for f in window[-1]["actors"])
    # rank 0 stalled beyond the buffer: it received nothing more meanwhile
    assert window[0]["rank0_rows"] == window[-1]["rank0_rows"], shown
    row_bytes = 128 * 2
    for x in window:
        for f in x["actors"]:
            if f is not None:   # the capture side's bound: ranks x send_buffer_rows rows
                assert f.held_bytes <= 2 * (SEND_ROWS + CONTEXT) * row_bytes, f
    for i in range(2):
        rss = [x["actors"][i].rss_bytes for x in window if x["actors"][i] is not None]
        assert max(rss) - min(rss) < 48 << 20, rss
    r1 = [x["rank1"]["rss_bytes"] for x in window]
    assert max(r1) - min(r1) < 96 << 20, r1
    assert window[-1]["rank1"]["buffer_bytes"] == 2 * 256 * row_bytes
    # and it resumed: every row arrived in the end (the coverage test)


def test_external_ranks_with_a_tee_get_the_same_rows_and_the_tee_store_matches(
        run1, run2, reference):
    cfg, out = run2
    for r in (0, 1):
        got, before = out[r], run1.out[r]
        order_a, order_b = np.argsort(got["rows"]), np.argsort(before["rows"])
        # the same rows for each rank (the deal is the run's, not the timing's): run 1's kill
        # changed nothing a rank received
        assert np.array_equal(got["rows"][order_a], before["rows"][order_b])
        _check_rows(got, reference, bits=False)
        c = got["state"]["norm_constants"]
        assert c["source"] == "stream:first-window" and c["mode"] == "norm_scale"
        scale = np.asarray(c["scale"], np.float32)[0]
        x = before["acts"][order_b].astype(np.int32) << 16
        want = x.astype(np.uint32).view(np.float32) * scale
        np.testing.assert_allclose(got["acts"][order_a], want, rtol=1e-6, atol=1e-6)
    assert out[0]["state"]["norm_constants"] == out[1]["state"]["norm_constants"]
    store = open_store(load_config(data=cfg.to_dict(redact=False)).store.resolved_url)
    check_store(store, reference)


def test_a_killed_trainer_rank_that_does_not_come_back_stops_the_stream_saying_why(
        ray_cluster, tiny_llama, corpus, tmp_path):
    """Rank 1 (an external process) dies by SIGKILL after 2 batches and nobody restarts it:
    the stream stops within stream.rank_timeout_s and the other rank's iteration raises that
    reason; a rank that then tries to resume is told the stream ended."""
    import harvest
    from harvest.pipeline.errors import HarvestError
    from tests.support.stream_rank import options

    cfg = _cfg(tiny_llama, corpus, tmp_path, "stream.rank_timeout_s=5")
    p = _spawn(ray_cluster, cfg, 1, str(tmp_path / "rank1"), die_after=2,
               opts={**OPTS, "normalize": None})
    ds = harvest.stream(cfg, rank=0, world_size=2, **options(OPTS))
    t0 = time.monotonic()
    with pytest.raises(HarvestError, match="trainer rank 1 has not been heard from") as e:
        for _ in ds:
            pass
    assert "rows it took" in str(e.value) and time.monotonic() - t0 < 300
    assert p.wait(60) == -signal.SIGKILL
    late = harvest.stream(cfg, rank=1, world_size=2, **options(OPTS))
    late.load_state_dict({**late.state_dict(), "consumed": [], "partial": {}})
    with pytest.raises(HarvestError, match="stream ended|capture stopped|is gone"):
        next(iter(late))


def test_a_killed_trainer_rank_resumes_from_its_saved_state_and_yields_each_row_once(
        ray_cluster, tiny_llama, corpus, reference, tmp_path):
    """Rank 1 (an external process) saves its stream state after 4 batches (a checkpoint),
    reads 3 more, and dies by SIGKILL. A new process for rank 1 loads the saved state: the
    stream captures again, for rank 1 alone, the units it had not finished, and the new process
    drops what the first had yielded before the checkpoint. Rank 1's rows before the checkpoint
    and after the resume are its share exactly once (the 3 batches after the checkpoint are
    yielded again, as the model's own state rolls back to the checkpoint too); rank 0 is
    untouched."""

    cfg = _cfg(tiny_llama, corpus, tmp_path, "stream.rank_timeout_s=120")
    first = _spawn(ray_cluster, cfg, 1, str(tmp_path / "a"), checkpoint_at=4, die_after=7,
                   opts=OPTS)
    out: dict = {}
    t = threading.Thread(target=lambda: out.__setitem__(0, read_rank(cfg, 0, 2, OPTS)),
                         daemon=True)
    t.start()
    assert first.wait(300) == -signal.SIGKILL, first.communicate()[0][-3000:]
    second = _spawn(ray_cluster, cfg, 1, str(tmp_path / "b"), opts=OPTS,
                    resume=str(tmp_path / "a.state.json"))
    log = second.communicate(timeout=600)[0]
    assert second.returncode == 0, log[-4000:]
    t.join(300)
    assert 0 in out
    before = np.load(tmp_path / "a.ckpt_rows.npy")
    with np.load(tmp_path / "b.npz") as z:
        after = {k: z[k] for k in z.files}
    kept = _kept_rows(reference)
    share = kept[1::2][:len(kept) // 2]
    both = np.concatenate([before, after["rows"]])
    assert len(both) == len(share) and np.array_equal(np.sort(both), share)
    assert np.array_equal(np.sort(out[0]["rows"]), kept[0::2][:len(kept) // 2])
    _check_rows(after, reference)
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["figures"]["resumed_parts"] > 0
