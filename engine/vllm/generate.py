"""Capture of the model's own generations: prompts are completed by vLLM and the rows of the
generated tokens are captured on the decode steps, beside the prompt's rows.

Which rows exist. The row at position p is the hidden state when token p is the *input*. A
sampled token is fed (and gets a row) only if another step runs for its request; the last
sampled token never is (vLLM stops on it). So a request with prompt length P that generated G
tokens has rows for positions [0, P + G - 1): the prompt, then every generated token but the
last. Nothing is lost for the usual question "what state produced token k": generated token k
was sampled from the row at position P - 1 + k, which is captured for every k < G (k = 0 is the
prompt's last row). Capturing the last token's own row would cost one more forward whose sample
is thrown away, and with a stop token the request is already finished in vLLM; we do not run it.
`GeneratedRequest.token_ids` are the fed tokens, aligned with the rows; `generated` holds all G
sampled tokens (its last one is the one without a row).

Freeze-mode taps already run on every scheduled token, decode steps included (inside the
compiled graph / CUDA-graph replay); the capture registers room for prompt + max_new_tokens
positions per request, so decode rows are planned, copied and checked exactly like prompt rows
(engine/vllm/rowmap.py): each row's fed position and token id are compared with the request's tokens
once vLLM reported the sample, and a row of no captured request, or past a request's room, is a
stray row that fails the capture.

`n > 1` is n separate requests of the same prompt (sample i uses seed + i when a seed is set):
each sample is its own sequence of rows, and prefix caching is off while capturing, so vLLM's
own fan-out would compute the prompt n times too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import compat
from ..capture.captured import CapturedRequest
from ..checkpoint import validate_tokens
from ..points import LOGIT_POINTS
from ..protocol import DestinationProvider


@dataclass(frozen=True)
class GenerateParams:
    """How prompts are completed. `stop` is a list of token ids (the engine feeds ids and never
    detokenizes, so stop strings would need a detokenizer per step); `stop_at_eos` adds the
    model's end-of-sequence ids (from its config / generation config)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[int, ...] = ()
    stop_at_eos: bool = True

    def __post_init__(self):
        problems = generate_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def describe(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "n": self.n, "seed": self.seed, "stop": list(self.stop),
                "stop_at_eos": self.stop_at_eos}


def generate_problems(p, where: str = "") -> list[str]:
    """What is wrong with a GenerateParams-like object (also the pipeline config's check)."""
    out = []
    if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
        out.append(f"{where}max_new_tokens={p.max_new_tokens!r}: must be an integer >= 1")
    if not isinstance(p.temperature, (int, float)) or p.temperature < 0:
        out.append(f"{where}temperature={p.temperature!r}: must be >= 0 (0 is greedy)")
    if not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1:
        out.append(f"{where}top_p={p.top_p!r}: must be in (0, 1]")
    if not isinstance(p.n, int) or p.n < 1:
        out.append(f"{where}n={p.n!r}: must be an integer >= 1")
    elif p.n > 1 and isinstance(p.temperature, (int, float)) and p.temperature == 0:
        out.append(f"{where}n={p.n} with temperature=0: greedy decoding samples the same text "
                   "n times; set temperature > 0 or n: 1")
    if p.seed is not None and (not isinstance(p.seed, int) or p.seed < 0):
        out.append(f"{where}seed={p.seed!r}: must be an integer >= 0 or null")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p.stop):
        out.append(f"{where}stop={list(p.stop)!r}: must be a list of token ids (integers); the "
                   "engine feeds token ids and does not detokenize, so stop strings are not "
                   "supported: tokenize the string and list its id")
    return out


@dataclass
class GeneratedRequest(CapturedRequest):
    """One sample of one prompt: rows of positions [0, prompt_len + len(generated) - 1).

    `index` is the prompt's place in submission order, `sample` which of its n samples."""

    sample: int = 0
    prompt_len: int = 0
    generated: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_reason: str = ""


@dataclass
class _Gen:
    index: int
    sample: int
    prompt: np.ndarray
    internal: str
    room: int
    generated: list = field(default_factory=list)
    finish_reason: str = ""


def eos_ids(model) -> tuple[int, ...]:
    """The model's end-of-sequence ids: vLLM learns them from its tokenizer, which the engine
    does not load (skip_tokenizer_init), so they are read from the checkpoint's configs."""
    from transformers import AutoConfig, GenerationConfig

    ids: set[int] = set()
    sources = [AutoConfig.from_pretrained(model.name, revision=model.revision)]
    try:
        sources.append(GenerationConfig.from_pretrained(model.name, revision=model.revision))
    except OSError:  # no generation_config.json
        pass
    for cfg in sources:
        e = getattr(cfg, "eos_token_id", None)
        ids |= {e} if isinstance(e, int) else set(e or ())
    return tuple(sorted(i for i in ids if 0 <= i < model.info.vocab_size))


def sampling_params(gp: GenerateParams, sample: int, eos: tuple[int, ...],
                    seed: int | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop = sorted(set(gp.stop) | (set(eos) if gp.stop_at_eos else set()))
    # DELTA: each step reports only the new tokens, which the row check needs as they come;
    # CUMULATIVE would copy the whole sequence every step. ignore_eos: vLLM's own EOS (None here,
    # no tokenizer) stays out; the model's EOS ids are in `stop` when asked for.
    return SamplingParams(
        max_tokens=gp.max_new_tokens, temperature=float(gp.temperature), top_p=float(gp.top_p),
        seed=None if seed is None else seed + sample, stop_token_ids=stop,
        ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)


def generate(model, batches: Iterable[Sequence[Sequence[int]]], points=None,
             sampling: GenerateParams | None = None, max_in_flight_tokens: int | None = None,
             destinations: DestinationProvider | None = None,
             seeds: Callable[[int], int | None] | None = None) -> Iterator[GeneratedRequest]:
    """Complete each prompt `sampling.n` times, streaming each sample once its rows are final.

    Like VLLMModel.capture (same ownership contract for `destinations`), except that
    `destinations(index * n + sample, room)` is asked for room = prompt + max_new_tokens rows:
    the sample's real length is known only when it ends, and rows [0, prompt + generated - 1)
    of that room are filled (the rest is left as it was). `max_in_flight_tokens` counts room.
    `seeds(index)`: prompt `index`'s own seed (sample s draws with seed + s) instead of
    `sampling.seed`; the pipeline seeds each slot by its place in the store (slot_seed).
    """
    gp = sampling or GenerateParams()
    pts = model.resolve_points(points)
    scored = [str(a) for a in pts if a.name in LOGIT_POINTS]
    if scored:
        raise ValueError(
            f"{', '.join(scored)}: not served in generation: a generated position's next token "
            "is sampled after its row is captured (vLLM's own sample logprobs are the place for "
            "them); capture the prompts with logprob/entropy, or generate without them")
    st = model.state
    capturing = bool(pts)
    if capturing:
        st.begin_capture(pts)
    eos = eos_ids(model) if gp.stop_at_eos else ()
    params = [sampling_params(gp, i, eos, gp.seed) for i in range(gp.n)]
    budget = max_in_flight_tokens or 4 * model.max_num_batched_tokens
    engine = model.llm.llm_engine
    source = (t for batch in batches for t in batch)
    reqs: dict[str, _Gen] = {}
    finished: deque[str] = deque()
    prompt_no = 0
    in_flight, exhausted = 0, False
    try:
        while True:
            while not exhausted and in_flight < budget:
                toks = next(source, None)
                if toks is None:
                    exhausted = True
                    break
                ids = validate_tokens(toks, model.max_model_len - gp.max_new_tokens,
                                      model.info.vocab_size)
                room = len(ids) + gp.max_new_tokens
                own = None if seeds is None else seeds(prompt_no)
                for sample in range(gp.n):
                    rid = model.next_request_id("g")
                    acts = None
                    if capturing:
                        want = destinations(prompt_no * gp.n + sample, room) if destinations else None
                        acts = st.destination(want, room)
                    sp = params[sample] if own is None else sampling_params(gp, sample, eos, own)
                    internal = compat.add_request(engine, rid, ids.tolist(), sp)
                    if capturing:
                        tokens = np.zeros(room, dtype=np.int32)
                        tokens[: len(ids)] = ids
                        st.register(internal, acts, tokens, known=len(ids))
                    reqs[rid] = _Gen(prompt_no, sample, ids, internal, room)
                    in_flight += room
                prompt_no += 1
            if not reqs:
                break
            stepped = engine.has_unfinished_requests()
            outputs = engine.step() if stepped else []
            if capturing:  # a stray row (a request nobody captures) first, named as such
                st.raise_if_failed()
            for out in outputs:
                g = reqs.get(out.request_id)
                if g is None:
                    raise RuntimeError(f"vLLM returned request {out.request_id!r}, which this "
                                       "generation never submitted: one generation per engine")
                new = list(out.outputs[0].token_ids)
                g.generated += new
                if capturing and new:
                    st.extend(g.internal, new)
                if out.finished:
                    g.finish_reason = str(out.outputs[0].finish_reason)
                    finished.append(out.request_id)
                    if capturing:
                        st.end_rows(g.internal, len(g.prompt) + len(g.generated) - 1)
                        st.mark_finished(g.internal)
            if capturing:
                st.raise_if_failed()
                st.poll(block=not stepped)
            handed = 0
            for _ in range(len(finished)):
                rid = finished.popleft()
                g = reqs[rid]
                if capturing and not st.is_final(g.internal):
                    finished.append(rid)
                    continue
                del reqs[rid]
                in_flight -= g.room
                handed += 1
                yield _handover(model, g, pts)
            if not stepped and not handed and not outputs:
                raise RuntimeError(f"generation stalled: vLLM has no unfinished requests but "
                                   f"{len(reqs)} were never reported finished")
    finally:
        if reqs:
            try:
                engine.abort_request(list(reqs))
            finally:
                if capturing:
                    st.wait_all_and_drop([g.internal for g in reqs.values()])


def _handover(model, g: _Gen, pts) -> GeneratedRequest:
    gen = np.asarray(g.generated, dtype=np.int32)
    if len(gen) == 0:
        raise RuntimeError(f"prompt {g.index} sample {g.sample}: vLLM finished it without a token")
    fed = np.concatenate([g.prompt, gen[:-1]]).astype(np.int32)
    n = len(fed)
    if pts:
        acts = model.state.take(g.internal, f"prompt {g.index} sample {g.sample}")[:, :n]
    else:
        acts = torch.empty(0, n, model.width, dtype=model.dtype)
    widths = model.point_widths(pts) if pts else ()
    return GeneratedRequest(g.index, fed, np.arange(n, dtype=np.int32), tuple(pts), acts,
                            None if all(w == acts.shape[-1] for w in widths) else widths,
                            sample=g.sample, prompt_len=len(g.prompt), generated=gen,
                            finish_reason=g.finish_reason)


def generate_with_cache(model, prompts, points=None, sampling: GenerateParams | None = None
                        ) -> list[list[GeneratedRequest]]:
    """Complete a list of token lists; out[i][s] is sample s of prompt i (rows, tokens, text
    ids). `out[i][s].as_dict()` is the {Address: [rows, width]} cache."""
    gp = sampling or GenerateParams()
    out: list[list] = [[None] * gp.n for _ in prompts]
    for r in generate(model, [prompts], points, gp):
        out[r.index][r.sample] = r
    return out
