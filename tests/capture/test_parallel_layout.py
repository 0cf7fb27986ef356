"""Parallel layouts without an engine: the PP refusal, config keys, the step ring's own checks.

The engine-level TP=2 capture is tests/engine/test_engine_tp.py (slow); here are the parts that need no
vLLM engine: what a config or load_model refuses and why, and the step ring (engine/capture/stepring.py)
publishing and reading steps between two mappings of one file, as a worker and the capture loop
do, including the overrun it exists to catch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from harvest.engine.vllm import compat
from harvest.engine.capture import stepring
from harvest.engine.parallel import PP_REFUSED, check_parallel, check_tp_points
from harvest.pipeline.config.fields import ConfigError
from harvest.pipeline.config.sections import ModelConfig


def test_pipeline_parallel_is_refused_at_config_load_with_the_reason():
    with pytest.raises(ConfigError) as e:
        ModelConfig(pipeline_parallel_size=2).validate()
    msg = str(e.value)
    assert "model.pipeline_parallel_size=2" in msg and "intermediate_tensors" in msg
    assert "tensor_parallel_size" in msg  # the way out
    ModelConfig(pipeline_parallel_size=1, tensor_parallel_size=2).validate()
    kw = ModelConfig(tensor_parallel_size=2).engine_kwargs(["resid_post.0"])
    assert kw["tensor_parallel_size"] == 2 and "pipeline_parallel_size" not in kw


def test_engine_refuses_pp_and_hooked_tp_before_starting_anything():
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is refused"):
        check_parallel(1, 2, "freeze")
    with pytest.raises(ValueError, match="needs freeze mode"):
        check_parallel(2, 1, "hooked")
    with pytest.raises(ValueError, match="whole number"):
        check_parallel(0, 1, "freeze")
    assert check_parallel(2, 1, "freeze") == 2
    assert check_parallel(1, 2, "plain") == 1  # plain vLLM: nothing is captured, nothing refused
    assert PP_REFUSED.startswith("pipeline_parallel_size > 1")


def test_tp_compilation_turns_off_the_allreduce_fusion_and_refuses_it_explicit():
    cc = compat.tp_compilation_config({"mode": 0})
    assert cc == {"mode": 0, "pass_config": {"fuse_allreduce_rms": False}}
    with pytest.raises(ValueError, match="fuse_allreduce_rms"):
        compat.tp_compilation_config({"pass_config": {"fuse_allreduce_rms": True}})


def test_cpu_thread_binding_gives_each_rank_its_own_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3, 4})
    assert compat.cpu_thread_binding(2) == "0-1|2-3"
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    assert compat.cpu_thread_binding(2) == "0|1"
    with pytest.raises(ValueError, match="need 4 cores"):
        compat.cpu_thread_binding(4)


def _step(n_points=3, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(n_points, 32, width, generator=g).to(torch.bfloat16)
    return buf


def test_step_ring_carries_a_step_between_two_mappings():
    spec = stepring.new_spec(3, 32, 8, torch.bfloat16, max_reqs=4)
    reader = stepring.RingReader(spec)
    try:
        writer = stepring.RingWriter(stepring.RingSpec(**spec.as_dict()))
        buf = _step()
        pos = torch.tensor([0, 1, 2, 7, 8], dtype=torch.int64)
        ids = torch.tensor([5, 6, 7, 9, 10], dtype=torch.int64)
        writer.publish(("h0-abc", "h1-def"), [3, 2], [0, 7], pos, ids, buf)
        steps = list(reader.steps())
        assert len(steps) == 1 and list(reader.steps()) == []  # each step read once
        s = steps[0]
        assert s.req_ids == ("h0-abc", "h1-def") and s.n == 5
        assert s.counts.tolist() == [3, 2] and s.starts.tolist() == [0, 7]
        assert torch.equal(s.fed_pos, pos) and torch.equal(s.fed_ids, ids)
        assert torch.equal(s.rows[:, :5], buf[:, :5])
        reader.skip()
        assert list(reader.steps()) == []
        writer.close()
    finally:
        reader.close()


def test_step_ring_refuses_a_step_overwritten_before_it_was_read():
    spec = stepring.new_spec(1, 32, 8, torch.bfloat16, max_reqs=4)
    reader = stepring.RingReader(spec)
    try:
        writer = stepring.RingWriter(stepring.RingSpec(**spec.as_dict()))
        for k in range(stepring.SLOTS + 1):  # one step more than the ring holds, none read
            writer.publish(("h0-x",), [1], [k], torch.tensor([k]), torch.tensor([3]),
                           _step(1, seed=k))
        with pytest.raises(RuntimeError, match="step ring overran"):
            list(reader.steps())
    finally:
        reader.close()


def test_step_ring_reports_a_step_too_large_for_it():
    spec = stepring.new_spec(1, 4, 8, torch.bfloat16, max_reqs=1)
    reader = stepring.RingReader(spec)
    try:
        writer = stepring.RingWriter(stepring.RingSpec(**spec.as_dict()))
        writer.publish(("a", "b"), [1, 1], [0, 0], torch.zeros(2, dtype=torch.int64),
                       torch.zeros(2, dtype=torch.int64), _step(1))
        assert "does not fit the step ring" in reader.error()
        assert list(reader.steps()) == []  # nothing half-written was published
    finally:
        reader.close()


def test_step_ring_file_is_gone_after_unlink_and_rows_stay_readable():
    spec = stepring.new_spec(1, 8, 4, torch.float32, max_reqs=2)
    reader = stepring.RingReader(spec)
    writer = stepring.RingWriter(stepring.RingSpec(**spec.as_dict()))
    reader.unlink()  # as the engine does once the workers have mapped it
    import os

    assert not os.path.exists(spec.path)
    buf = torch.arange(32, dtype=torch.float32).view(1, 8, 4)
    writer.publish(("r",), [2], [0], torch.tensor([0, 1]), torch.tensor([4, 5]), buf)
    (s,) = list(reader.steps())
    assert np.array_equal(s.rows[0, :2].numpy(), buf[0, :2].numpy())
    reader.close()


def test_plan_prices_a_tp_actor_as_its_gpus():
    from types import SimpleNamespace

    from harvest.pipeline.config.run import load_config
    from harvest.pipeline.cli.estimate import guess_rate

    prep = SimpleNamespace(n_layers=80, width=8192, vocab_size=128256)
    base = {"name": "t", "model": {"path": "x"}, "data": {"source": "pydoc"},
            "ray": {"num_actors": 2, "num_gpus_per_actor": 8}}
    one = guess_rate(load_config(data={**base, "ray": {"num_actors": 2, "num_gpus_per_actor": 1}}),
                     prep)
    tp8 = guess_rate(load_config(data={**base, "model": {"path": "x", "tensor_parallel_size": 8}}),
                     prep)
    assert tp8["tokens_per_second"] == pytest.approx(8 * one["tokens_per_second"], rel=0.01)
    assert "tensor_parallel_size=8 (16 GPUs)" in tp8["rate_note"]
    with pytest.raises(ConfigError, match="num_gpus_per_actor"):
        load_config(data={**base, "model": {"path": "x", "tensor_parallel_size": 8},
                          "ray": {"num_actors": 2, "num_gpus_per_actor": 4}})


def test_tensor_parallel_serves_sharded_points_and_router_logits(monkeypatch):
    """z / mlp_act (column shards, gathered on every rank) and router_logits (off the replicated
    gate) pass at TP=2 like d_model points; a point listed in TP_REFUSED is refused by name, with
    its reason, before any worker starts, and only at TP > 1."""
    from harvest.engine import parallel
    from harvest.engine.addresses import Address

    info = None  # check_tp_points reads the names only
    reads = [Address("mlp_in", 1), Address("resid_mid", 2), Address("z", 0), Address("mlp_act", 1),
             Address("router_logits", 3)]
    assert parallel.TP_REFUSED == {}
    check_tp_points(2, info, reads)
    monkeypatch.setitem(parallel.TP_REFUSED, "router_logits", "a reason given here")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: router_logits.3 cannot be "
                                         r"captured under tensor parallelism: a reason given "
                                         r"here.*tensor_parallel_size=1"):
        check_tp_points(2, info, reads)
    check_tp_points(1, info, reads)


def test_replica_check_measures_each_read_on_its_own_columns():
    """The load-time replica check (engine/vllm/probe.require_replicated) fills its buffer with
    NaN, as wide as the widest read: a narrower point (router_logits, 8 experts in a 16-wide
    buffer) leaves NaN past its width on every rank. Its spread is measured on its own columns
    (0 here: the ranks agree), while a NaN or a rank difference inside them still fails."""
    from harvest.engine.vllm.probe import REPLICA_TOL, replica_spread

    ranks = torch.full((2, 3, 5, 16), float("nan"), dtype=torch.bfloat16)  # [rank, read, n, w]
    x = torch.randn(5, 16).to(torch.bfloat16)
    ranks[:, 0] = x                   # resid_post: the full width, same on both ranks
    ranks[:, 1, :, :8] = x[:, :8]     # router_logits: 8 wide, same on both ranks
    ranks[:, 2, :, :8] = x[:, :8]
    ranks[1, 2, :, :8] *= 0.5         # a shard-like difference
    spread = (ranks.float().amax(0) - ranks.float().amin(0))
    got = replica_spread(ranks[0], spread, (16, 8, 8))
    assert got[0] == 0.0 and got[1] == 0.0 and got[2] > REPLICA_TOL, got
    whole = ranks[0].float().abs().amax(dim=(1, 2))  # the old whole-buffer reading
    assert whole[1].isnan(), whole
    ranks[:, 1, 2, 3] = float("nan")  # a tap that never wrote one of its own cells
    spread = (ranks.float().amax(0) - ranks.float().amin(0))
    assert not replica_spread(ranks[0], spread, (16, 8, 8))[1] <= REPLICA_TOL


def test_engine_close_removes_only_its_own_rank_group_files(tmp_path):
    """vLLM CPU's ranks name their shared-memory segments `<ident>-...-cpushm_<rank>`; a killed
    rank leaves its own. The engine removes its group's by the ident it asked the ranks for, and
    no other engine's (another ident) or other file."""
    from harvest.engine.parallel import remove_dist_files

    mine, other = "vllm_dist_" + "a" * 32, "vllm_dist_" + "b" * 32
    for name in (f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[0-1]-cpushm_1",
                 f"{other}-tp:0-[0-1]-cpushm_0", "psm_1234", mine + "x"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_dist_files(mine, shm_dir=str(tmp_path))
    assert sorted(p.rsplit("/", 1)[-1] for p in removed if p.startswith(str(tmp_path))) == [
        f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[0-1]-cpushm_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{other}-tp:0-[0-1]-cpushm_0", "psm_1234", mine + "x"])
    assert remove_dist_files(None, str(tmp_path)) == [] == remove_dist_files("../x", str(tmp_path))


def test_message_queue_segments_left_by_a_dead_rank_are_removed_and_nothing_else(tmp_path):
    """A rank killed outright leaves its response queue's segment (`psm_<random>`, Python's
    shared_memory name); the engine's close removes the names it recorded at load, and never a
    name of another shape, a path, or a file it did not record."""
    from multiprocessing import resource_tracker, shared_memory

    from harvest.engine.parallel import remove_queue_shm

    for name in ("psm_0a1b2c3d", "psm_99999999", "notpsm", "psm_other"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_queue_shm(["psm_0a1b2c3d", "notpsm", "../psm_x", "psm_gone"], str(tmp_path))
    assert removed == [str(tmp_path / "psm_0a1b2c3d")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notpsm", "psm_99999999", "psm_other"]
    # in /dev/shm: the name goes, a mapping of it stays readable (a live rank keeps its queue)
    seg = shared_memory.SharedMemory(create=True, size=4096)
    try:
        seg.buf[:3] = b"abc"
        assert os.path.exists(f"/dev/shm/{seg.name}")
        assert remove_queue_shm([seg.name]) == [f"/dev/shm/{seg.name}"]
        assert not os.path.exists(f"/dev/shm/{seg.name}") and bytes(seg.buf[:3]) == b"abc"
    finally:
        seg.close()
        resource_tracker.unregister(seg._name, "shared_memory")   # unlinked above


def test_vllm_socket_folders_are_per_process_and_swept_when_their_process_is_gone(tmp_path):
    """rpc_dir: one folder per process for vLLM's ZMQ sockets; clear_rpc_dir empties it at an
    engine's close; remove_stale_rpc_dirs removes the folders of dead processes (a killed
    actor's), never a live one's or this process's."""
    import subprocess
    import sys

    from harvest.engine.parallel import RPC_DIR_PREFIX, clear_rpc_dir, remove_stale_rpc_dirs, rpc_dir

    mine = rpc_dir(str(tmp_path))
    assert mine == str(tmp_path / f"{RPC_DIR_PREFIX}{os.getpid()}") and os.path.isdir(mine)
    (tmp_path / mine / "0b1c-uuid").write_bytes(b"")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for pid in (dead, "1", "notapid"):
        d = tmp_path / f"{RPC_DIR_PREFIX}{pid}"
        d.mkdir()
        (d / "sock").write_bytes(b"")
    removed = remove_stale_rpc_dirs(str(tmp_path))
    assert removed == [str(tmp_path / f"{RPC_DIR_PREFIX}{dead}")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{RPC_DIR_PREFIX}{os.getpid()}", f"{RPC_DIR_PREFIX}1", f"{RPC_DIR_PREFIX}notapid"])
    assert clear_rpc_dir(mine) == [os.path.join(mine, "0b1c-uuid")] and not os.path.exists(mine)
