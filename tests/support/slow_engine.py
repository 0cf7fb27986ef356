"""SlowEngine: a capture engine without a model, for the actor tests (test_actor_memory.py) and
the Protocol check (test_engine_protocol.py). Rows are a function of the token ids; the engine
is slow on purpose (DELAY per context) and keeps ENGINE_WINDOW contexts in flight, so a stream
over many units never drains between them."""

from __future__ import annotations

import collections
import gc
import time
import weakref

import numpy as np

from harvest.engine.checkpoint import ModelInfo
from harvest.engine.protocol import CaptureOnly
from harvest.pipeline.messages import ActorSpec
from harvest.store.write.writer import RegionWriter

SLOW_ENGINE = f"{__name__}:SlowEngine"  # ActorSpec.engine_factory

P, W, C = 2, 8, 16            # points, width, context size
ENGINE_WINDOW = 2             # contexts the fake engine holds before yielding the oldest
DELAY = 0.004                 # seconds per context: the engine is the slow side

live: list[int] = []          # live writers, sampled by the engine once per context
_tracked: "weakref.WeakSet | None" = None   # track_writers: the RegionWriters built since


def track_writers(monkeypatch) -> None:
    """From now on (the test's end undoes it) every RegionWriter registers itself in a WeakSet as
    it is built, so live_writers() counts the same objects as the garbage collector's list (a
    writer leaves both when it is freed, a cycle's only when the collector frees it) without
    scanning every object of the process per sample (0.2 s a scan with torch loaded)."""
    tracked: weakref.WeakSet = weakref.WeakSet()
    init = RegionWriter.__init__

    def registering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is RegionWriter:
            tracked.add(self)

    monkeypatch.setattr(RegionWriter, "__init__", registering_init)
    monkeypatch.setattr(f"{__name__}._tracked", tracked)


def live_writers() -> int:
    """RegionWriter objects alive: those track_writers registered, else a scan of gc's list."""
    if _tracked is not None:
        return len(_tracked)
    return sum(1 for o in gc.get_objects() if type(o) is RegionWriter)


def tokens_of(row_start: int, n: int) -> np.ndarray:
    return ((np.arange(row_start, row_start + n) * 7) % 97).astype(np.int32)


def rows_of(tok: np.ndarray) -> np.ndarray:
    """Activations [P, n, W] as a function of the token ids: small integers, exact in bf16."""
    t = tok.astype(np.float32)
    return (t[None, :, None] + 100 * np.arange(P)[:, None, None]
            + np.arange(W)[None, None, :]).astype(np.float32)


class SlowEngine(CaptureOnly):
    """A harvest.engine.protocol.CaptureEngine, no model: rows computed from the token ids,
    yielded in submission order `ENGINE_WINDOW` contexts behind the feed, `DELAY` seconds each.
    With factory_options["in_place"] it accepts destinations and writes into the writer's shard
    buffer, as vLLM does."""

    backend = "slow-fake"
    name = "slow-fake"
    revision = None
    frozen = None
    accepts_destinations = False

    def __init__(self, spec: ActorSpec):
        import torch

        self.info = ModelInfo(n_layers=P, width=W, max_position=4 * C, vocab_size=97,
                              n_streams=1, architecture="slow-fake")
        self.n_layers, self.width, self.max_model_len = P, W, 4 * C
        self.max_num_batched_tokens = C
        self.dtype = torch.bfloat16
        self.accepts_destinations = bool(spec.factory_options.get("in_place"))
        # ("raise" | "drop", request index): first stream only
        self.fault = spec.factory_options.get("fault")
        self.requests = 0

    def describe(self) -> dict:
        return {"backend": "slow-fake"}

    def step_stats(self) -> dict:
        return {"steps": self.requests, "scheduled_tokens": self.requests * C,
                "max_num_batched_tokens": C}

    def capture(self, batches, points, destinations=None, quantize=None):
        if destinations is not None and not self.accepts_destinations:
            raise ValueError("this SlowEngine takes no destinations")
        if quantize is not None:
            raise ValueError("a SlowEngine does not quantise (quantizes is False)")
        return self._run(iter(batches), points, destinations)

    def _run(self, batches, points, destinations):
        import torch

        from harvest.engine.addresses import parse_addresses
        from harvest.engine.capture.captured import CapturedRequest

        pts = tuple(parse_addresses(list(points), self.n_layers))
        window: collections.deque = collections.deque()
        index, more = 0, True
        while more or window:
            while more and len(window) < ENGINE_WINDOW:
                batch = next(batches, None)
                if batch is None:
                    more = False
                    break
                for toks in batch:
                    ids = np.asarray(toks, np.int32)
                    dest = destinations(index, len(ids)) if destinations else None
                    window.append((index, ids, dest))
                    index += 1
            if not window:
                break
            i, ids, dest = window.popleft()
            if self.fault and i == self.fault[1]:
                kind, self.fault = self.fault[0], None
                if kind == "raise":
                    raise RuntimeError("the engine died")
                continue  # "drop": this request never comes back
            time.sleep(DELAY)  # the engine is slow on purpose (what the tests measure against)
            self.requests += 1
            acts = torch.from_numpy(rows_of(ids)).to(torch.bfloat16)
            if dest is not None:
                dest.copy_(acts)
            live.append(live_writers())
            yield CapturedRequest(i, ids, np.arange(len(ids), dtype=np.int32), pts, acts)

    def close(self) -> None:
        pass
