"""The capture engine's contract: what the pipeline's actor and `check_loaded` call on an engine.

Declared once, so callers never guess (step figures, the step size, whether `capture` takes
destinations): a caller that probed for them instead would degrade silently on a new engine or a
renamed attribute (no step figures, a wrong queue size, copies instead of in-place rows). Every implementation (both backends, the benchmarks' and tests' stub engines)
is checked against this Protocol by tests/engine/test_engine_protocol.py, on the classes (no model
loads), and the actor checks the engine it loaded with `problems` before its first unit.
"""

from __future__ import annotations

import inspect
from typing import (TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, NotRequired,
                    Protocol, Sequence, TypedDict, runtime_checkable)

if TYPE_CHECKING:
    import torch

    from .addresses import FreezeSet
    from .capture.captured import CapturedRequest
    from .checkpoint import ModelInfo

# How vLLM's engine reads rows: "freeze" (taps compiled into the forward), "hooked" (Python hooks,
# enforce_eager) or "plain" (no taps: generation or timing only). engine/vllm/backend.py picks it.
CaptureMode = Literal["freeze", "hooked", "plain"]

# (index, n_tokens) -> host tensor [points, n_tokens, width] in the engine dtype, or None for a
# fresh tensor. See VLLMModel.capture for the ownership contract.
DestinationProvider = Callable[[int, int], "torch.Tensor | None"]


class StepStats(TypedDict):
    """Cumulative engine steps since the engine loaded; differences of two give a step fill
    (scheduled_tokens / (steps x max_num_batched_tokens))."""

    steps: int
    scheduled_tokens: int
    max_num_batched_tokens: int
    rows_placed: NotRequired[int]
    """Tensor parallel only: rows the publishing rank wrote straight into shared destinations."""


# `allocate(shape, dtype) -> np.ndarray`: buffers in memory another process writes rows into
Allocator = Callable[[tuple, Any], Any]


@runtime_checkable
class CaptureEngine(Protocol):
    """A loaded model that streams requests' activation rows. Data members are read-only facts
    of the loaded engine; an implementation may set them in `__init__` or as class attributes."""

    backend: str
    """"vllm", "eager", or a stub's own name."""
    name: str
    """The checkpoint (path or hub name) it loaded; `check_loaded`'s default reference."""
    revision: str | None
    info: ModelInfo
    """The checkpoint's config as `common.read_model_info` reads it (vocab_size, ...)."""
    n_layers: int
    width: int
    max_model_len: int
    """The longest request (prompt tokens) `capture` accepts."""
    max_num_batched_tokens: int
    """Tokens one engine step schedules at most: the actor keeps enough units queued to fill
    a few steps, and step fill is measured against it."""
    dtype: Any
    """The torch dtype of the rows `capture` yields (and of destinations it writes)."""
    accepts_destinations: bool
    """Whether `capture` writes rows into caller memory given `destinations`; an engine that
    cannot raises ValueError when given one."""
    frozen: FreezeSet | None
    """vLLM's freeze set (the points its taps serve); None for engines that serve any point."""
    lost: bool
    """True once the engine can no longer run (vLLM: a worker process died): the actor exits so
    Ray restarts it. Always False for an engine that has no part to lose."""
    quantizes: bool
    """Whether `capture(quantize="float8_e4m3fn")` is served: the engine quantises rows before
    they leave the device (vLLM in process; not tensor parallel). False: the caller quantises on
    the host (the writer does, bit for bit the same) and never passes `quantize`."""

    def describe(self) -> dict:
        """JSON-able facts for reports: model, backend, mode, dtype, versions."""
        ...

    def capture(self, batches: Iterable[Sequence[Sequence[int]]], points, *,
                destinations: DestinationProvider | None = None,
                quantize: str | None = None) -> Iterator[CapturedRequest]:
        """Yield each request's rows (a CapturedRequest, `index` in submission order from 0 per
        call) once they are final; `batches` is consumed lazily. `destinations` and `quantize`
        are passed by keyword (engines place their own options before them); an engine whose
        `quantizes` is False raises ValueError when given `quantize`."""
        ...

    def generate(self, batches: Iterable[Sequence[Sequence[int]]], points=None, sampling=None,
                 max_in_flight_tokens: int | None = None,
                 destinations: DestinationProvider | None = None, seeds=None) -> Iterator[Any]:
        """Complete prompts and stream each sample's rows (capture.generate; vLLM's
        engine/vllm/generate.py). An engine that cannot generate raises NotImplementedError."""
        ...

    def shared_allocator(self) -> Allocator | None:
        """Tensor parallel: an allocator of buffers the publishing rank writes rows straight into
        (the writer's block buffers come from it); None where rows never leave this process."""
        ...

    def step_stats(self) -> StepStats:
        ...

    def close(self) -> None:
        ...


class CaptureOnly:
    """The optional capabilities of CaptureEngine as an engine without them has them: nothing to
    lose, no shared memory, no generation, no quantising. Engines other than vLLM's inherit it."""

    lost = False
    quantizes = False

    def generate(self, batches, points=None, sampling=None, max_in_flight_tokens=None,
                 destinations=None, seeds=None):
        raise NotImplementedError(f"the {getattr(self, 'backend', type(self).__name__)} engine "
                                  "cannot generate: capture.generate needs model.backend=vllm")

    def shared_allocator(self) -> None:
        return None


def members(proto=CaptureEngine) -> tuple[list[str], list[str]]:
    """(data members, methods) the Protocol declares."""
    data = [n for n in proto.__annotations__]
    methods = [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]
    return data, methods


def signature_problems(impl, name: str, proto=CaptureEngine) -> list[str]:
    """How `impl.<name>` (a class or an instance) fails to accept every call the Protocol's
    method allows: each declared parameter present (positional ones in the same place, keyword
    ones by name), optional where the Protocol's is; any extra parameter optional."""
    fn = getattr(impl, name, None)
    if not callable(fn):
        return [f"{name}() is missing"]
    want = _params(getattr(proto, name))
    have = _params(fn)
    out = []
    by_name = {p.name: (k, p) for k, p in enumerate(have)}
    for k, p in enumerate(want):
        if p.name not in by_name:
            if not any(q.kind is q.VAR_KEYWORD for q in have):
                out.append(f"{name}() has no parameter {p.name!r}")
            continue
        j, q = by_name[p.name]
        if p.kind is p.POSITIONAL_OR_KEYWORD and (j != k or q.kind is not q.POSITIONAL_OR_KEYWORD):
            out.append(f"{name}(): {p.name!r} must be positional parameter {k + 1}")
        if p.kind is p.KEYWORD_ONLY and q.kind not in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY):
            out.append(f"{name}(): {p.name!r} must be accepted by keyword")
        if p.default is not p.empty and q.default is q.empty:
            out.append(f"{name}(): {p.name!r} must be optional")
    for q in have:
        if q.name not in {p.name for p in want} and q.default is q.empty \
                and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            out.append(f"{name}(): extra parameter {q.name!r} must be optional")
    return out


def problems(engine, proto=CaptureEngine) -> list[str]:
    """What a loaded engine (an instance) lacks of the Protocol; empty when it complies."""
    data, methods = members(proto)
    out = [f"attribute {n!r} is missing" for n in data if not hasattr(engine, n)]
    for n in methods:
        out += signature_problems(engine, n, proto)
    return out


def _params(fn) -> list[inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    return ps[1:] if ps and ps[0].name == "self" else ps
