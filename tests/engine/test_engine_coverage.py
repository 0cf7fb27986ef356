"""Row accounting without an engine: coverage bitmaps, step plans, fed-token checks, and the
handover of rows whose copies complete later (a deferred transport standing in for CUDA events).

The synthetic step sequences are what vLLM's scheduler produces: chunked prefill interleaving
requests, and a preemption that recomputes a request from its first token.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harvest.engine import platform as plat
from harvest.engine.capture.coverage import Coverage, CoverageError, check_fed, plan_step, require_no_stray
from harvest.engine.vllm.rowmap import HarvestState
from harvest.engine.capture.taps import TapSet
from harvest.engine.capture.transport import CPUTransport, check_destination
from harvest.engine.addresses import Address


def test_preemption_recompute_overwrites_and_completes():
    cov = Coverage(150)
    for start, count in [(0, 64), (64, 64), (0, 64), (64, 64), (128, 22)]:  # preempted after 128
        cov.mark(start, count)
    assert cov.complete and cov.gaps() == [] and cov.rewrites == 128
    cov.require_complete("request 0")


def test_a_gap_is_refused_with_its_positions():
    cov = Coverage(150)
    for start, count in [(0, 64), (0, 64), (128, 22)]:  # the chunk [64, 128) never arrived
        cov.mark(start, count)
    assert not cov.complete and cov.gaps() == [(64, 128)]
    with pytest.raises(CoverageError, match=r"\[64, 128\) of 150"):
        cov.require_complete("request 3")


def test_rows_outside_the_request_are_refused():
    with pytest.raises(CoverageError, match="outside"):
        Coverage(10).mark(8, 4)


def test_step_plan_maps_rows_in_runner_order():
    lengths = {"a": 100, "b": 30}
    plan = plan_step(["b", "a"], [30, 34], [0, 64], lengths)
    assert [(s.rid, s.row, s.start, s.count) for s in plan.segments] == [("b", 0, 0, 30), ("a", 30, 64, 34)]
    assert plan.n == 64 and not plan.stray
    require_no_stray(plan)


def test_stray_rows_are_counted_and_refused_for_prompt_capture():
    # a decode row of "a" (position 100 of a 100-token prompt) and a request nobody registered
    plan = plan_step(["a", "x"], [1, 5], [100, 0], {"a": 100})
    assert plan.segments == () and sum(s.count for s in plan.stray) == 6
    with pytest.raises(CoverageError, match="6 rows of a step belong to no captured request"):
        require_no_stray(plan)
    # rows of an aborted (retired) request are dropped, not stray
    plan = plan_step(["x"], [5], [0], {}, retired={"x"})
    assert plan.dropped == 5 and not plan.stray


def test_fed_tokens_and_positions_are_checked_against_the_request():
    toks = {"a": np.arange(100, 140, dtype=np.int32), "b": np.arange(500, 520, dtype=np.int32)}
    plan = plan_step(["a", "b"], [8, 4], [16, 0], {"a": 40, "b": 20})
    pos = np.concatenate([np.arange(16, 24), np.arange(0, 4)])
    ids = np.concatenate([toks["a"][16:24], toks["b"][0:4]])
    check_fed(plan, pos, ids, toks)
    swapped = np.concatenate([toks["b"][0:4], toks["a"][16:24]])  # rows of the wrong request
    with pytest.raises(CoverageError, match="fed token"):
        check_fed(plan, pos, swapped, toks)
    shifted = pos.copy()
    shifted[:8] += 1  # right request, wrong offset
    with pytest.raises(CoverageError, match="fed positions"):
        check_fed(plan, shifted, ids, toks)


# -- the runner side and the handover, on a fake runner ------------------------------------------

class DeferredTransport(CPUTransport):
    """Copies happen at `release`, as a side stream would complete them later."""

    def __init__(self):
        self.held = []

    def submit(self, plan, buf, slots, fed_positions, fed_ids, dests):
        t = super().submit(plan, torch.full_like(buf, float("nan")), slots, fed_positions,
                           fed_ids, dests)  # nothing real lands before release
        t.done = [False, plan, buf.clone(), slots, dests]
        self.held.append(t)
        return t

    def release(self):
        from harvest.engine.capture.transport import copy_segment

        for t in self.held:
            _, plan, buf, slots, dests = t.done
            for seg in plan.segments:
                copy_segment(dests[seg.rid], buf, slots, seg, non_blocking=False)
            t.done[0] = True
        self.held = []

    def ready(self, t):
        return t.done is None or t.done[0]

    def wait(self, t):
        if not self.ready(t):
            self.release()


@pytest.fixture(params=["v1", "v2"])
def runner_kind(request) -> str:
    """The row map's tests on both of vLLM's runners' step state (engine/vllm/compat.py)."""
    return request.param


class FakeRunner:
    """The runner state compat.step_layout/fed_inputs read, for one step at a time: V1's
    persistent batch, or the per-step InputBatch V2 builds in prepare_inputs (`kind`)."""

    def __init__(self, max_tokens, kind: str = "v1"):
        self.harvest_runner = kind
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)
        self.input_ids = SimpleNamespace(gpu=torch.zeros(max_tokens, dtype=torch.int32))
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=None)
        self.harvest_step_batch = None

    def prepare(self, tokens, chunks, points, width):
        """chunks: [(rid, start, count)] in runner order: the batch vLLM prepares for a step.
        Returns the scheduler output and the step's rows [points, n, width] (as the taps see them)."""
        row, xs = 0, []
        for rid, s, c in chunks:
            self.positions[row : row + c] = torch.arange(s, s + c)
            self.input_ids.gpu[row : row + c] = torch.from_numpy(tokens[rid][s : s + c])
            xs.append(_rows(tokens[rid][s : s + c], points, width))
            row += c
        self.input_batch.req_ids = [r for r, _, _ in chunks]
        self.input_batch.num_reqs = len(chunks)
        self.input_batch.num_computed_tokens_cpu = np.array([s for _, s, _ in chunks])
        if self.harvest_runner == "v2":   # V2: a fresh batch each step, padded like V2's
            counts = np.array([c for _, _, c in chunks], dtype=np.int32)
            qsl = np.zeros(len(chunks) + 3, dtype=np.int32)
            qsl[1:len(chunks) + 1] = np.cumsum(counts)
            qsl[len(chunks) + 1:] = row
            self.harvest_step_batch = SimpleNamespace(
                req_ids=[r for r, _, _ in chunks], num_reqs=len(chunks),
                num_scheduled_tokens=counts, num_tokens=row, query_start_loc_np=qsl,
                num_computed_tokens_np=np.array([s for _, s, _ in chunks], dtype=np.int32),
                positions=self.positions, input_ids=self.input_ids.gpu)
            self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=None)
        so = SimpleNamespace(num_scheduled_tokens={r: c for r, _, c in chunks},
                             total_num_scheduled_tokens=row)
        return so, torch.cat([torch.zeros(points, 0, width), *xs], dim=1).contiguous()

    def step(self, st, buf, tokens, chunks):
        """One step whose taps write buf rows (the tap buffer path)."""
        so, x = self.prepare(tokens, chunks, buf.shape[0], buf.shape[2])
        buf[:, : x.shape[1]] = x
        st.before_forward()
        st.after_forward(self, so)


def _rows(tok_ids, points, width):
    """A row that encodes its token and point, so a misplaced row is visible."""
    t = torch.as_tensor(np.asarray(tok_ids), dtype=torch.float32)[None, :, None]
    p = torch.arange(points, dtype=torch.float32)[:, None, None]
    return (t + 1000 * p).expand(points, -1, width)


def _state(transport, points=3, max_tokens=16, width=4):
    reads = tuple(Address("resid_post", i) for i in range(points))
    buf = torch.zeros(points, max_tokens, width)
    st = HarvestState(TapSet(reads, (), buf, {}, width), None, "freeze", max_tokens, width,
                      torch.float32, torch.device("cpu"), transport, staging=False)
    return st, buf


def test_rows_are_handed_over_only_when_their_copies_complete_and_land_in_caller_memory(runner_kind):
    tr = DeferredTransport()
    st, buf = _state(tr)
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32), "b-2": np.arange(50, 56, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 2), Address("resid_post", 0)))  # a subset, reordered
    shard = torch.zeros(2, 64, 4)  # the caller's memory, e.g. a writer's shard buffer
    st.register("a-1", st.destination(shard[:, 8:28], 20), tokens["a-1"])
    st.register("b-2", st.destination(None, 6), tokens["b-2"])
    runner.step(st, buf, tokens, [("a-1", 0, 12), ("b-2", 0, 4)])
    runner.step(st, buf, tokens, [("a-1", 0, 12)])  # preempted and recomputed from the start
    runner.step(st, buf, tokens, [("b-2", 4, 2), ("a-1", 12, 8)])
    st.raise_if_failed()
    st.mark_finished("a-1")
    st.mark_finished("b-2")
    st.poll()
    assert not st.is_final("a-1") and not st.is_final("b-2")  # vLLM finished, copies did not
    assert torch.isnan(shard[:, 8:28]).all()  # the fake's stand-in for "not written yet"
    tr.release()
    st.poll()
    assert st.is_final("a-1") and st.is_final("b-2")
    a = st.take("a-1", "request 0")
    assert a.data_ptr() == shard[:, 8].data_ptr()
    assert torch.equal(shard[:, 8:28], _rows(tokens["a-1"], 3, 4)[[2, 0]])
    assert torch.equal(st.take("b-2", "request 1"), _rows(tokens["b-2"], 3, 4)[[2, 0]])
    assert st.rewrites == 12 and st.rows == 26 and not st.dests


def test_a_quantised_capture_hands_over_packed_fp8_rows_in_caller_memory(runner_kind):
    """quantize="float8_e4m3fn": the step's rows are quantised before the copy (the transport's
    own path, points reordered, a request split over steps and recomputed) and land as packed
    rows (uint8 [points, n, width + 4]) equal to the store's numpy quantiser bit for bit."""
    from harvest.store.format import fp8

    st, buf = _state(CPUTransport(), width=6)
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32), "b-2": np.arange(50, 56, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 2), Address("resid_post", 0)), "float8_e4m3fn")
    shard = torch.zeros(2, 64, 10, dtype=torch.uint8)   # a writer's packed block buffer
    st.register("a-1", st.destination(shard[:, 8:28], 20), tokens["a-1"])
    st.register("b-2", st.destination(None, 6), tokens["b-2"])
    with pytest.raises(ValueError, match="dtype"):
        st.destination(torch.zeros(2, 5, 10), 5)     # a float destination is refused
    runner.step(st, buf, tokens, [("a-1", 0, 12), ("b-2", 0, 4)])
    runner.step(st, buf, tokens, [("a-1", 0, 12)])
    runner.step(st, buf, tokens, [("b-2", 4, 2), ("a-1", 12, 8)])
    st.raise_if_failed()
    st.mark_finished("a-1")
    st.mark_finished("b-2")
    st.poll()
    want = lambda rid: fp8.quantize(_rows(tokens[rid], 3, 6)[[2, 0]].numpy())  # noqa: E731
    assert st.take("a-1", "request 0").data_ptr() == shard[:, 8].data_ptr()
    assert np.array_equal(shard[:, 8:28].numpy(), want("a-1"))
    assert np.array_equal(st.take("b-2", "request 1").numpy(), want("b-2"))
    with pytest.raises(ValueError, match="quantize="):
        st.begin_capture((Address("resid_post", 0),), "int8")


def test_a_request_missing_a_chunk_is_refused_at_handover(runner_kind):
    st, buf = _state(CPUTransport())
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 0),))
    st.register("a-1", st.destination(None, 20), tokens["a-1"])
    runner.step(st, buf, tokens, [("a-1", 0, 12)])
    st.mark_finished("a-1")
    st.poll()
    with pytest.raises(CoverageError, match=r"\[12, 20\)"):
        st.take("a-1", "request 0")


def test_a_row_map_error_inside_the_runner_surfaces_in_the_capture_loop(runner_kind):
    st, buf = _state(CPUTransport())
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32), "zz": np.arange(5, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 0),))
    st.register("a-1", st.destination(None, 20), tokens["a-1"])
    runner.step(st, buf, tokens, [("a-1", 0, 12), ("zz", 0, 4)])  # rows of an unknown request
    with pytest.raises(CoverageError, match="no captured request"):
        st.raise_if_failed()
    runner.step(st, buf, {"a-1": tokens["a-1"][::-1].copy()}, [("a-1", 12, 4)])  # wrong tokens fed
    with pytest.raises(CoverageError, match="fed token"):
        st.poll()


def test_destinations_are_validated():
    shape = (2, 5, 4)
    ok = torch.zeros(2, 64, 4)[:, 3:8]
    assert check_destination(ok, shape, torch.float32, need_pinned=False) is ok
    with pytest.raises(ValueError, match="shape"):
        check_destination(torch.zeros(2, 6, 4), shape, torch.float32, False)
    with pytest.raises(ValueError, match="dtype"):
        check_destination(torch.zeros(shape, dtype=torch.bfloat16), shape, torch.float32, False)
    with pytest.raises(ValueError, match="contiguous"):
        check_destination(torch.zeros(2, 4, 5).transpose(1, 2), shape, torch.float32, False)
    with pytest.raises(ValueError, match="pinned"):
        check_destination(torch.zeros(shape), shape, torch.float32, need_pinned=True)


def test_platform_profiles_keep_cpu_defaults_out_of_gpu_runs():
    cpu = plat.engine_defaults(plat.CPU, {"max_num_batched_tokens": None, "max_num_seqs": None,
                                          "gpu_memory_utilization": None})
    gpu = plat.engine_defaults(plat.CUDA, {"max_num_batched_tokens": None, "max_num_seqs": None,
                                           "gpu_memory_utilization": None})
    assert cpu["kv_cache_memory_bytes"] == 512 << 20 and "gpu_memory_utilization" not in cpu
    assert gpu["gpu_memory_utilization"] == 0.90 and "kv_cache_memory_bytes" not in gpu
    assert gpu["max_num_batched_tokens"] == 8192 and cpu["max_num_batched_tokens"] == 2048
    mine = plat.engine_defaults(plat.CUDA, {"gpu_memory_utilization": 0.5, "max_num_batched_tokens": 1024})
    assert mine["gpu_memory_utilization"] == 0.5 and mine["max_num_batched_tokens"] == 1024
    # a 16-core GPU actor: few engine threads, the rest to the codec; a CPU actor: all to the engine
    assert plat.engine_threads(plat.CUDA, None, 16) == 4 and plat.codec_threads(plat.CUDA, 16) == 11
    assert plat.engine_threads(plat.CPU, None, 2) == 2 and plat.codec_threads(plat.CPU, 2) == 2
    assert plat.engine_threads(plat.CUDA, 3, 16) == 3
    assert plat.codec_for(plat.CUDA, 7e9, 11) == "none" and plat.codec_for(plat.CPU, 112e6, 2) == "default"
    assert plat.cpu_share(3) == 3 and plat.cpu_share() >= 1


def test_decode_rows_wait_for_their_sampled_tokens_and_end_where_the_generation_ends(runner_kind):
    """A generation registers room for prompt + max_new_tokens; each decode row is checked against
    the token vLLM reports (a ticket waits for it), the handover stops at prompt + generated - 1,
    and a row vLLM still runs for it after the handover (async scheduling) is dropped."""
    st, buf = _state(CPUTransport())
    runner = FakeRunner(16, runner_kind)
    prompt, sampled = np.arange(10, 16, dtype=np.int32), np.array([70, 71, 72], dtype=np.int32)
    full = {"g-1": np.concatenate([prompt, sampled])}
    st.begin_capture((Address("resid_post", 1),))
    room = np.zeros(6 + 5, dtype=np.int32)
    room[:6] = prompt
    st.register("g-1", st.destination(None, 11), room, known=6)
    runner.step(st, buf, full, [("g-1", 0, 6)])  # prefill; samples 70
    st.poll()
    runner.step(st, buf, full, [("g-1", 6, 1)])  # decode feeds 70 before the loop saw it
    st.poll()
    assert len(st.tickets) == 1  # held: its fed token cannot be checked yet
    st.extend("g-1", [70])
    st.poll()
    assert not st.tickets
    runner.step(st, buf, full, [("g-1", 7, 1)])  # feeds 71, vLLM then samples 72 and stops
    st.extend("g-1", [71, 72])
    st.end_rows("g-1", 6 + 3 - 1)
    st.mark_finished("g-1")
    st.poll()
    got = st.take("g-1", "prompt 0 sample 0")
    assert torch.equal(got[:, :8], _rows(full["g-1"][:8], 3, 4)[[1]])
    assert st.rows == 8
    runner.step(st, buf, full, [("g-1", 8, 1)])  # the stop token fed by a step already planned
    st.raise_if_failed()
    assert st.dropped_rows == 1
    for _ in range(6):  # the handed-over id is forgotten a few steps later: bounded memory
        runner.step(st, buf, {"x": np.zeros(1, np.int32)}, [])
    assert "g-1" not in st.retired


def test_a_decode_row_past_the_registered_room_or_a_wrong_sample_is_refused(runner_kind):
    st, buf = _state(CPUTransport())
    runner = FakeRunner(16, runner_kind)
    full = {"g-1": np.arange(10, 20, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 0),))
    room = np.zeros(8, dtype=np.int32)
    room[:6] = full["g-1"][:6]
    st.register("g-1", st.destination(None, 8), room, known=6)
    runner.step(st, buf, full, [("g-1", 0, 6)])
    st.extend("g-1", [99])  # vLLM reported 99 but the runner fed 16 at position 6
    runner.step(st, buf, full, [("g-1", 6, 1)])
    with pytest.raises(CoverageError, match="fed token 16 at position 6"):
        st.poll()
    with pytest.raises(CoverageError, match="more than the 8 positions"):
        st.extend("g-1", [1, 2])
    runner.step(st, buf, full, [("g-1", 7, 2)])  # position 8 is past the room of 8
    with pytest.raises(CoverageError, match="no captured request.*positions \\[8, 9\\)"):
        st.raise_if_failed()


def _direct_step(runner, st, tokens, chunks, skip=(), fused=(), then=None):
    """A CPU forward whose taps deliver (engine/capture/direct.py): the runner's batch is
    prepared, the taps run as the compiled graph calls them (`fused` slots through tap_sum, as
    a fused trunk's stream), `then` may change the runner's batch, then the runner plans."""
    buf = st.taps.buf
    so, x = runner.prepare(tokens, chunks, buf.shape[0], buf.shape[2])
    st.before_forward(runner, so)
    for slot in range(buf.shape[0]):
        if slot in fused:
            torch.ops.harvest.tap_sum(x[slot] - 1, torch.ones_like(x[slot]), buf, slot)
        elif slot not in skip:
            torch.ops.harvest.tap(x[slot], buf, slot)
    if then is not None:
        then()
    st.after_forward(runner, so)


def _direct_state(fast=True):
    from harvest.engine.capture import ntcopy
    from harvest.engine.capture.direct import Sink

    st, buf = _state(CPUTransport(), points=4)
    st.sink = Sink(buf)
    assert st.sink.fast == ntcopy.available()
    st.sink.fast = fast
    return st, buf


@pytest.mark.parametrize("fast", [True, False], ids=["non-temporal", "torch-copy"])
def test_cpu_taps_deliver_rows_straight_into_the_destinations(fast, runner_kind):
    """The taps write each planned request's rows into its destination during the forward (a
    subset of the frozen points, reordered; a request split over steps and recomputed; a fused
    stream through tap_sum), with non-temporal stores (ntcopy.py) or torch's copy: the rows
    equal the reference, nothing lands outside the requests' slices, and the tap buffer is
    never written."""
    st, buf = _direct_state(fast)
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32), "b-2": np.arange(50, 56, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 2), Address("resid_post", 0)))
    shard = torch.full((2, 64, 4), float("nan"))
    st.register("a-1", st.destination(shard[:, 8:28], 20), tokens["a-1"])
    st.register("b-2", st.destination(None, 6), tokens["b-2"])
    _direct_step(runner, st, tokens, [("a-1", 0, 12), ("b-2", 0, 4)], fused=(2,))
    _direct_step(runner, st, tokens, [("a-1", 0, 12)])
    _direct_step(runner, st, tokens, [("b-2", 4, 2), ("a-1", 12, 8)], fused=(0, 1))
    st.raise_if_failed()
    for rid in tokens:
        st.mark_finished(rid)
    st.poll()
    assert st.take("a-1", "request 0").data_ptr() == shard[:, 8].data_ptr()
    assert torch.equal(shard[:, 8:28], _rows(tokens["a-1"], 4, 4)[[2, 0]])
    assert torch.isnan(shard[:, :8]).all() and torch.isnan(shard[:, 28:]).all()
    assert torch.equal(st.take("b-2", "request 1"), _rows(tokens["b-2"], 4, 4)[[2, 0]])
    assert st.direct_steps == 3 and st.rewrites == 12 and st.rows == 26
    assert not buf.any()   # every row went straight to its destination
    # not armed (vLLM's dummy and warm-up runs, no capture): the taps write the buffer
    torch.ops.harvest.tap(torch.ones(3, 4), buf, 1)
    assert buf[1, :3].eq(1).all()


def test_a_tap_that_did_not_run_is_refused(runner_kind):
    st, _ = _direct_state()
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 1), Address("resid_post", 3)))
    st.register("a-1", st.destination(None, 20), tokens["a-1"])
    _direct_step(runner, st, tokens, [("a-1", 0, 12)], skip=(0,))   # a point not captured: fine
    st.raise_if_failed()
    _direct_step(runner, st, tokens, [("a-1", 12, 8)], skip=(3,))
    with pytest.raises(CoverageError, match=r"resid_post\.3 did not run"):
        st.raise_if_failed()


def test_a_batch_that_changes_during_the_forward_is_refused(runner_kind):
    st, _ = _direct_state()
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 0),))
    st.register("a-1", st.destination(None, 20), tokens["a-1"])

    def shift():   # the batch the runner describes moves under the taps' feet
        if runner_kind == "v2":
            b = runner.harvest_step_batch
            b.num_computed_tokens_np = b.num_computed_tokens_np + 1
        else:
            runner.input_batch.num_computed_tokens_cpu = runner.input_batch.num_computed_tokens_cpu + 1

    _direct_step(runner, st, tokens, [("a-1", 0, 12)], then=shift)
    with pytest.raises(CoverageError, match="changed between the step's first tap"):
        st.raise_if_failed()


def test_a_step_the_taps_cannot_plan_falls_back_to_the_buffer_and_fails_as_before(runner_kind):
    """Rows of an unknown request: planning at the first tap fails, so every tap of the step
    writes the tap buffer (nothing reaches a destination) and the runner's own plan after the
    forward raises the same error as the buffer path."""
    st, buf = _direct_state()
    runner = FakeRunner(16, runner_kind)
    tokens = {"a-1": np.arange(10, 30, dtype=np.int32), "zz": np.arange(5, dtype=np.int32)}
    st.begin_capture((Address("resid_post", 0),))
    shard = torch.full((1, 20, 4), float("nan"))
    st.register("a-1", st.destination(shard, 20), tokens["a-1"])
    _direct_step(runner, st, tokens, [("a-1", 0, 12), ("zz", 0, 4)])
    with pytest.raises(CoverageError, match="no captured request"):
        st.raise_if_failed()
    assert torch.isnan(shard).all() and buf[:, :16].any() and st.direct_steps == 0


@pytest.mark.parametrize("width,dtype,offset", [(576, torch.bfloat16, 3), (7, torch.bfloat16, 0),
                                                (4096, torch.float32, 1), (13, torch.float16, 5)])
def test_non_temporal_row_copies_equal_torch_copies(width, dtype, offset):
    """ntcopy against torch's copy_: widths whose rows are not whole 16-byte vectors (a tail),
    destinations at unaligned rows (refused: torch copies them), several segments and points."""
    from harvest.engine.capture import ntcopy

    x = torch.randn(40, width).to(dtype)
    block = torch.zeros(3, 64, width, dtype=dtype)
    segs = [(block[:, offset + 0 : offset + 10], 0, 10, 0, 10),
            (block[:, offset + 24 : offset + 54], 0, 30, 10, 40)]
    table = ntcopy.plan(segs, width, x.element_size())
    aligned = all((d.data_ptr() + d0 * width * x.element_size()) % ntcopy.ALIGN == 0
                  and d.stride(0) * x.element_size() % ntcopy.ALIGN == 0 for d, d0, *_ in segs)
    assert (table is not None) == aligned == (offset != 5)   # 5 rows of 26 bytes: unaligned
    if table is None:
        return
    for point in (2, 0):
        ntcopy.copy_rows(table, point, x.data_ptr())
    want = torch.zeros_like(block)
    for point in (2, 0):
        want[point, offset : offset + 10] = x[:10]
        want[point, offset + 24 : offset + 54] = x[10:40]
    assert torch.equal(block, want)
    assert ntcopy.plan([(block[:, :5, : width - 1], 0, 5, 0, 5)], width - 1, x.element_size()) is None


def test_a_v2_batch_whose_query_starts_disagree_with_its_counts_is_refused():
    """V2's rows of request i are [query_start_loc[i], query_start_loc[i+1]): a batch whose
    starts do not follow its counts (a V2 that reorders or pads differently) fails loudly."""
    from harvest.engine.vllm import compat

    runner = FakeRunner(16, "v2")
    so, _ = runner.prepare({"a": np.arange(8), "b": np.arange(8)}, [("a", 0, 5), ("b", 2, 3)], 1, 4)
    lay = compat.step_layout(runner, so)
    assert lay.req_ids == ("a", "b") and lay.counts.tolist() == [5, 3] and lay.starts.tolist() == [0, 2]
    runner.harvest_step_batch.query_start_loc_np[1] = 4
    with pytest.raises(compat.VLLMIncompatible, match="query starts"):
        compat.step_layout(runner, so)
    runner.harvest_step_batch = None
    with pytest.raises(compat.VLLMIncompatible, match="without calling prepare_inputs"):
        compat.step_layout(runner, so)
