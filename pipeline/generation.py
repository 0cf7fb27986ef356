"""Generation in the pipeline: the `capture.generate` config section and each slot's rows.

Slots. Units are planned as dense row ranges before anything runs, but the rows of a generation
are known only after sampling (a stop token or EOS ends it early). So a context of the packed
corpus (packing.context_size = C rows, planned as for prompt capture) is a *slot*: its first
P = C - max_new_tokens tokens are the prompt, the model completes it, and the slot's rows are
the prompt's rows, then one row per generated token that was fed back (G - 1 of G sampled), then
padding up to C. The corpus tokens of positions [P, C) are not used. Planning, units, shards,
commits and resume are those of prompt capture, unchanged; which rows hold activations is in
the `gen` row-metadata column (store/FORMAT.md, "Generation"):

    GEN_PROMPT (0)   a prompt row (and every row of a store without generation)
    GEN_SAMPLED (1)  a generated token, fed back: its row is the forward at that token
    GEN_LAST (2)     the last sampled token: never fed, so no activations (zeros); token_id is it
    GEN_DROPPED (3)  a prompt row whose activations were dropped (keep_prompt: false; zeros)
    GEN_PAD (4)      past the end of the generation: zeros, token_id/doc_id/position -3

Only GEN_PROMPT and GEN_SAMPLED rows hold activations; statistics and the reader skip the rest.
Zeros compress to almost nothing, so padding costs metadata, not activation bytes.

Seeds. Sample of the context at global context index k uses seed `slot_seed(seed, k)`: a retry
on another actor, or a resumed run, asks for the same draws (see FORMAT.md for what a retry
guarantees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config_fields import ConfigError, check_bool, check_float, check_int

# The `gen` values and META_PAD live in store/layout.py (the store's format); imported where
# used, so loading a config (which validates this section) never imports the store package
# (zarr, numcodecs: ~2 s).


@dataclass
class GenerateConfig:
    """`capture.generate`: complete each context's prompt and capture the generated tokens too.

    The prompt is the first `packing.context_size - max_new_tokens` tokens of each context.
    `stop` lists token ids (the engine feeds ids and never detokenizes); `stop_at_eos` adds the
    model's EOS ids. `keep_prompt: false` keeps the prompt's token ids but not its activations.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: list = field(default_factory=list)
    stop_at_eos: bool = True
    keep_prompt: bool = True

    def validate(self, context_size: int | None = None) -> None:
        w = "capture.generate."
        check_int(w + "max_new_tokens", self.max_new_tokens, 1)
        check_float(w + "temperature", self.temperature, 0.0, 100.0)
        check_float(w + "top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ConfigError(f"{w}top_p must be > 0 (1 keeps the whole distribution)")
        check_int(w + "n", self.n, 1)
        if self.n != 1:
            raise ConfigError(
                f"{w}n={self.n}: the pipeline captures one sample per context (a slot is one "
                "context's rows); repeat contexts or call model.generate_with_cache with n > 1")
        check_int(w + "seed", self.seed, 0, optional=True, hi=(1 << 31) - 1)
        if not isinstance(self.stop, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop):
            raise ConfigError(
                f"{w}stop={self.stop!r} must be a list of token ids such as [2, 13]; the engine "
                "feeds token ids and does not detokenize, so stop strings are not supported: "
                "tokenize the string and list its ids")
        check_bool(w + "stop_at_eos", self.stop_at_eos)
        check_bool(w + "keep_prompt", self.keep_prompt)
        if context_size is not None and self.max_new_tokens >= context_size:
            raise ConfigError(
                f"{w}max_new_tokens={self.max_new_tokens} leaves no prompt in a "
                f"packing.context_size={context_size} slot (prompt = context_size - "
                "max_new_tokens): raise packing.context_size or lower max_new_tokens")

    def prompt_len(self, context_size: int) -> int:
        return context_size - self.max_new_tokens

    def params(self):
        """The engine's sampling parameters (seeds are set per slot, see slot_seed)."""
        from harvest.engine.generate import GenerateParams

        return GenerateParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, n=1, seed=self.seed, stop=tuple(self.stop),
                              stop_at_eos=self.stop_at_eos)

    def describe(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "n": self.n, "seed": self.seed, "stop": list(self.stop),
                "stop_at_eos": self.stop_at_eos, "keep_prompt": self.keep_prompt}


def from_section(value) -> GenerateConfig | None:
    """`capture.generate` as YAML gives it (None, a mapping, or already a GenerateConfig)."""
    if value is None or isinstance(value, GenerateConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"capture.generate must be a mapping such as {{max_new_tokens: 32}}, "
                          f"got {value!r}")
    names = list(GenerateConfig.__dataclass_fields__)
    for k in value:
        if k not in names:
            from .yamlconf import unknown_msg

            raise ConfigError(unknown_msg(k, names, "capture.generate."))
    return GenerateConfig(**value)


def slot_seed(seed: int | None, context_index: int) -> int | None:
    """The sampling seed of one slot: a function of the run's seed and the slot's global context
    index only, so whichever actor runs it, and however often, it asks for the same draws."""
    if seed is None:
        return None
    return int((seed * 0x9E3779B1 + context_index * 0x85EBCA77) % ((1 << 31) - 1))


def slot_meta(gc: GenerateConfig, C: int, doc: np.ndarray, pos: np.ndarray, req) -> dict:
    """Row metadata of one slot of C rows, from the request the engine returned (a
    GeneratedRequest: fed tokens, prompt_len, generated). `doc`/`pos` are the context's planned
    columns; generated rows continue the prompt's last document and its positions."""
    from .store.layout import GEN_DROPPED, GEN_LAST, GEN_PAD, GEN_PROMPT, GEN_SAMPLED, META_PAD

    P, n = req.prompt_len, len(req)
    tok = np.full(C, META_PAD, np.int32)
    d = np.full(C, META_PAD, np.int64)
    p = np.full(C, META_PAD, np.int32)
    g = np.full(C, GEN_PAD, np.int8)
    tok[:n] = req.token_ids
    d[:P], p[:P] = doc[:P], pos[:P]
    d[P:n] = doc[P - 1]
    # after an inserted BOS (no document: -2) the generated tokens belong to no document either
    p[P:n] = pos[P - 1] + 1 + np.arange(n - P) if doc[P - 1] >= 0 else doc[P - 1]
    g[:P] = GEN_PROMPT if gc.keep_prompt else GEN_DROPPED
    g[P:n] = GEN_SAMPLED
    tok[n] = int(req.generated[-1])  # n = P + G - 1 <= C - 1: the first free row holds it
    g[n] = GEN_LAST
    return {"token_id": tok, "doc_id": d, "position": p, "gen": g}


def zero_rows_without_activations(acts, gen: np.ndarray) -> None:
    """Rows that hold no activations are zeros in the store: the engine never wrote the padding
    (a destination's rows past the generation are left as they were) and wrote a dropped
    prompt's rows. `acts` is [points, C, width] (a torch tensor or a numpy view)."""
    from .store.layout import GEN_HAS_ACTS

    none = np.flatnonzero(~np.isin(gen, GEN_HAS_ACTS))
    if none.size:
        acts[:, none[0]:none[-1] + 1][:, none - none[0]] = 0


class Slots:
    """An actor's generation: prompts from contexts, a seed per slot, a slot's rows to write.

    Built from ActorSpec.generate (GenerateConfig.describe()); the actor keeps its unit
    bookkeeping and calls these three."""

    def __init__(self, described: dict, context_size: int):
        self.cfg = GenerateConfig(**described)
        self.C = context_size
        self.P = self.cfg.prompt_len(context_size)
        self.params = self.cfg.params()

    def stream(self, engine, feed, points, routes: dict, **kw):
        """The engine's generation over the actor's feed: each context's first P tokens, seeded
        by the slot's global context number (routes: request index -> (job, context index))."""
        def seed(index: int):
            job, i = routes[index]
            return slot_seed(self.cfg.seed, job.row_start // self.C + i)

        prompts = ([ctx[: self.P] for ctx in batch] for batch in feed)
        return engine.generate(prompts, points, self.params, seeds=seed, **kw)

    def deliver(self, job, i: int, req, view) -> int:
        """Write slot i of an actor's unit (pipeline/actor._Job): its metadata, then its rows
        (in place: marks the engine's rows final). Returns the rows written in place."""
        row = job.row_start + i * self.C
        meta, acts = self.rows(job.contexts[i], job.meta[0][i], job.meta[1][i], req, view)
        job.writer.write_meta(row, **meta)
        if view is not None:
            job.writer.fill_reserved(row, self.C)
            return self.C
        job.writer.write(row, acts)
        return 0

    def rows(self, context: np.ndarray, doc: np.ndarray, pos: np.ndarray, req, view=None):
        """(metadata columns, activations to write or None) of one slot from the engine's
        GeneratedRequest. `view`: the slot's rows in the shard buffer when the engine wrote them
        in place (padding and dropped prompt rows are zeroed there; nothing to write)."""
        if req.prompt_len != self.P or not np.array_equal(req.token_ids[: self.P], context[: self.P]):
            raise RuntimeError("the engine returned a generation of another prompt than the "
                               "context's; refusing to write rows that do not match their metadata")
        meta = slot_meta(self.cfg, self.C, doc, pos, req)
        if view is not None:
            zero_rows_without_activations(view, meta["gen"])
            return meta, None
        import torch

        acts = torch.zeros((req.acts.shape[0], self.C, req.acts.shape[2]), dtype=req.acts.dtype)
        acts[:, : len(req)] = req.acts
        zero_rows_without_activations(acts, meta["gen"])
        return meta, acts
