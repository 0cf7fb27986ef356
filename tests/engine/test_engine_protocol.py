"""Every capture engine implements harvest.engine.protocol.CaptureEngine (issue 23 item 2).

Checked on the classes, so no model loads: a data member is a class attribute or property, or
an assignment `self.<name> = ...` in the class's own source; a method accepts every call the
Protocol's allows (protocol.signature_problems). The actor relies on exactly these members and
no longer guesses (getattr fallbacks, signature inspection), so a class that lacks one fails here
rather than as a silently degraded run.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import pytest

from harvest.engine import protocol


def _engines():
    from harvest.benchmarks.bench_scale import StubEngine
    from harvest.engine.hf_backend import HFModel
    from harvest.engine.vllm.backend import VLLMModel
    from tests.support.slow_engine import SlowEngine

    return [VLLMModel, HFModel, StubEngine, SlowEngine]


def _assigned_on_self(cls) -> set[str]:
    """Names assigned as `self.<name>` anywhere in the class's or its bases' bodies (tuple
    targets included)."""
    out = set()
    for k in cls.__mro__:
        if k is not object:
            out |= _assigned_in(k)
    return out


def _assigned_in(cls) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) \
                        and e.value.id == "self":
                    out.add(e.attr)
    return out


def class_problems(cls) -> list[str]:
    data, methods = protocol.members()
    on_class = set().union(*(vars(k) for k in cls.__mro__ if k is not object))
    assigned = _assigned_on_self(cls)
    out = [f"attribute {n!r} is never set" for n in data if n not in on_class | assigned]
    for n in methods:
        out += protocol.signature_problems(cls, n)
    return out


@pytest.mark.parametrize("cls", _engines(), ids=lambda c: c.__name__)
def test_engine_class_implements_the_protocol(cls):
    assert class_problems(cls) == []


def test_the_checks_see_what_an_engine_lacks():
    """The same checks on engines as they were before the Protocol: each gap is named."""

    class Old(protocol.CaptureOnly):  # the stub engine as it was: no step_stats, max_batch_tokens, no destinations
        backend, name, revision, info, frozen = "stub", "x", None, None, None

        def __init__(self):
            self.n_layers = self.width = self.max_model_len = 1
            self.max_batch_tokens, self.dtype = 8192, None

        def describe(self):
            return {}

        def capture(self, batches, points):
            return iter(())

        def close(self):
            pass

    class Swapped(Old):  # destinations as the first parameter; a required extra one
        accepts_destinations = True
        max_num_batched_tokens = 1

        def capture(self, destinations, batches, points, order, quantize=None):
            return iter(())

        def step_stats(self):
            return {}

    assert sorted(class_problems(Old)) == sorted([
        "attribute 'max_num_batched_tokens' is never set",
        "attribute 'accepts_destinations' is never set",
        "capture() has no parameter 'destinations'", "capture() has no parameter 'quantize'",
        "step_stats() is missing"])
    assert sorted(protocol.problems(Old())) == sorted([
        "attribute 'max_num_batched_tokens' is missing",
        "attribute 'accepts_destinations' is missing",
        "capture() has no parameter 'destinations'", "capture() has no parameter 'quantize'",
        "step_stats() is missing"])
    assert sorted(class_problems(Swapped)) == sorted([
        "capture(): 'batches' must be positional parameter 1",
        "capture(): 'points' must be positional parameter 2",
        "capture(): 'destinations' must be optional",
        "capture(): extra parameter 'order' must be optional"])
    assert not isinstance(Old(), protocol.CaptureEngine)
    # the optional capabilities are members too: an engine without CaptureOnly's defaults
    class Bare:
        backend, name, revision, info, frozen = "stub", "x", None, None, None
        accepts_destinations, max_num_batched_tokens = True, 1

        def __init__(self):
            self.n_layers = self.width = self.max_model_len = 1
            self.dtype = None

        def describe(self):
            return {}

        def capture(self, batches, points, destinations=None, quantize=None):
            return iter(())

        def step_stats(self):
            return {}

        def close(self):
            pass

    assert sorted(class_problems(Bare)) == sorted([
        "attribute 'lost' is never set", "attribute 'quantizes' is never set",
        "generate() is missing", "shared_allocator() is missing"])
    assert isinstance(Swapped(), protocol.CaptureEngine)  # presence only: why signatures matter


class _NoStepStats(protocol.CaptureOnly):
    """A factory engine without step_stats: the actor refuses it when it loads."""

    backend, name, revision, info, frozen = "broken", "x", None, None, None
    accepts_destinations = False

    def __init__(self, spec):
        import torch

        self.n_layers, self.width, self.max_model_len = 1, 8, 16
        self.max_num_batched_tokens, self.dtype = 16, torch.bfloat16

    def describe(self):
        return {}

    def capture(self, batches, points, destinations=None, quantize=None):
        return iter(())

    def close(self):
        pass


def test_the_actor_refuses_an_engine_that_lacks_a_member(tmp_path, monkeypatch):
    import torch

    from harvest.pipeline.actor.capture import HarvestActor
    from harvest.pipeline.messages import ActorSpec

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("HARVEST_LOG_DIR", raising=False)
    threads = torch.get_num_threads()
    spec = ActorSpec(index=0, model_path="", engine_kwargs={}, points=("resid_post.0",),
                     context_size=16, store_url=str(tmp_path / "s.zarr"),
                     engine_factory=f"{__name__}:_NoStepStats")
    try:
        with pytest.raises(TypeError, match=r"_NoStepStats is not a .*CaptureEngine: "
                                            r"step_stats\(\) is missing"):
            HarvestActor(spec)
    finally:
        torch.set_num_threads(threads)


def test_eager_backend_counts_steps_and_refuses_destinations(tiny_llama):
    """HFModel's step_stats: one step per padded micro-batch of at most max_num_batched_tokens
    (padding included), scheduled tokens the real ones; destinations and quantize fail at the call."""
    from harvest.engine import load_model

    m = load_model(tiny_llama, backend="eager", dtype="float32", max_num_batched_tokens=64)
    try:
        assert m.max_num_batched_tokens == 64
        lengths = (30, 30, 10, 50, 5)
        rng = np.random.default_rng(0)
        toks = [rng.integers(3, m.info.vocab_size, n).tolist() for n in lengths]
        before = m.step_stats()
        got = list(m.capture([toks], ["resid_post.0"]))
        after = m.step_stats()
        assert len(got) == len(lengths)
        # micro-batches, cut when longest x count would pass 64: [30, 30], [10], [50], [5]
        assert after["steps"] - before["steps"] == 4
        assert after["scheduled_tokens"] - before["scheduled_tokens"] == sum(lengths)
        assert after["max_num_batched_tokens"] == 64
        with pytest.raises(ValueError, match="destinations are not supported"):
            m.capture([toks], ["resid_post.0"], destinations=lambda i, n: None)
        assert m.quantizes is False
        with pytest.raises(ValueError, match="quantize='float8_e4m3fn' is not supported"):
            m.capture([toks], ["resid_post.0"], quantize="float8_e4m3fn")
    finally:
        m.close()
