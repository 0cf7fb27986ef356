"""Generation in the pipeline: each slot's rows (the `capture.generate` section itself is in
pipeline/config/generate.py).

Slots. Units are planned as dense row ranges before anything runs, but the rows of a generation
are known only after sampling (a stop token or EOS ends it early). So a context of the packed
corpus (packing.context_size = C rows, planned as for prompt capture) is a *slot*: its first L
tokens are the prompt (text: L = P = C - n * max_new_tokens; chat: the rendered conversation
ending in the template's generation prompt, L <= P), the model completes it n times, and the
slot's rows are the prompt's rows once, then one *region* of M = max_new_tokens rows per sample
(region s at [L + s*M, L + (s+1)*M): a row per generated token that was fed back, G - 1 of G
sampled, the last sampled token, padding), then padding up to C. The corpus tokens past the
prompt are not used. Planning, units, shards, commits and resume are those of prompt capture,
unchanged; which rows hold activations is in the `gen` row-metadata column, which sample a row
belongs to in `sample` (n > 1 only; store/FORMAT.md, "Generation"):

    GEN_PROMPT (0)   a prompt row (and every row of a store without generation)
    GEN_SAMPLED (1)  a generated token, fed back: its row is the forward at that token
    GEN_LAST (2)     the last sampled token: never fed, so no activations (zeros); token_id is it
    GEN_DROPPED (3)  a prompt row whose activations were dropped (keep_prompt: false; zeros)
    GEN_PAD (4)      past the end of a generation: zeros, token_id/doc_id/position -3

Only GEN_PROMPT and GEN_SAMPLED rows hold activations; statistics and the reader skip the rest.
Zeros compress to almost nothing, so padding costs metadata, not activation bytes.

Why the prompt is stored once with n > 1: the engine runs each sample as its own request (prompt
included), and the n prompt forwards are the same tokens at the same positions; storing them n
times would put n copies of every prompt row into the statistics and the SAE's training data.
Sample 0's prompt rows are kept (they are the rows of the sequence prompt + sample 0), and a
sample s's sequence is the prompt rows followed by its region.

Seeds. The context at global context index k samples with seed `slot_seed(seed, k)` and its
sample s with that + s (the engine's rule): a retry on another actor, or a resumed run, asks for
the same draws (see FORMAT.md for what a retry guarantees).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the `capture.generate` section itself (GenerateConfig, its YAML parsing) is a config section,
# in pipeline/config/generate.py: config loading validates it without importing this runtime
# module (this one imports chat -> data -> config: importing it from the section was a cycle)
from ..config.generate import GenerateConfig

# The `gen` values and META_PAD live in store/format/layout.py (the store's format); imported where
# used, so importing this module (the actor does at start) never loads the store package
# (zarr, numcodecs: ~2 s) before it is needed.


def engine_params(cfg: GenerateConfig):
    """The engine's sampling parameters (seeds are set per slot, see slot_seed). Here, not on
    the config section: the section stays a leaf that loading a config can import without the
    engine (pipeline/config/generate.py)."""
    from ...engine.vllm.generate import GenerateParams

    return GenerateParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, n=cfg.n, seed=cfg.seed, stop=tuple(cfg.stop),
                          stop_at_eos=cfg.stop_at_eos)


def slot_seed(seed: int | None, context_index: int) -> int | None:
    """The sampling seed of one slot: a function of the run's seed and the slot's global context
    index only, so whichever actor runs it, and however often, it asks for the same draws."""
    if seed is None:
        return None
    return int((seed * 0x9E3779B1 + context_index * 0x85EBCA77) % ((1 << 31) - 1))


def slot_meta(gc: GenerateConfig, C: int, doc: np.ndarray, pos: np.ndarray, reqs,
              role: "np.ndarray | None" = None) -> dict:
    """Row metadata of one slot of C rows, from the n requests the engine returned for it (each
    a GeneratedRequest: fed tokens, prompt_len, generated), sample s at reqs[s]. `doc`/`pos`
    (and `role`, chat input) are the context's planned columns; generated rows continue the
    prompt's last document and its positions, and are the assistant's in a chat store."""
    from ...store import roles as R
    from ...store import GEN_DROPPED, GEN_LAST, GEN_PAD, GEN_PROMPT, GEN_SAMPLED, META_PAD

    L, M = reqs[0].prompt_len, gc.max_new_tokens
    tok = np.full(C, META_PAD, np.int32)
    d = np.full(C, META_PAD, np.int64)
    p = np.full(C, META_PAD, np.int32)
    g = np.full(C, GEN_PAD, np.int8)
    smp = np.zeros(C, np.int16)
    rl = np.full(C, R.PAD, np.int8)
    tok[:L], d[:L], p[:L] = reqs[0].token_ids[:L], doc[:L], pos[:L]
    g[:L] = GEN_PROMPT if gc.keep_prompt else GEN_DROPPED
    if role is not None:
        rl[:L] = role[:L]
    for s, r in enumerate(reqs):
        a, G = L + s * M, len(r.generated)
        if not 1 <= G <= M:
            raise RuntimeError(f"sample {s}: {G} generated tokens, outside 1..{M} (max_new_tokens)")
        # the fed tokens, then the last sampled one (its row holds no activations)
        tok[a:a + G] = r.generated
        d[a:a + G - 1] = doc[L - 1]
        # after an inserted BOS (no document: -2) the generated tokens belong to no document either
        p[a:a + G - 1] = pos[L - 1] + 1 + np.arange(G - 1) if doc[L - 1] >= 0 else doc[L - 1]
        g[a:a + G - 1] = GEN_SAMPLED
        g[a + G - 1] = GEN_LAST
        smp[a:a + M] = s
        rl[a:a + G] = R.ASSISTANT
    out = {"token_id": tok, "doc_id": d, "position": p, "gen": g}
    if role is not None:
        out["role"] = rl
    if gc.n > 1:
        out["sample"] = smp
    return out


def zero_rows_without_activations(acts, gen: np.ndarray) -> None:
    """Rows that hold no activations are zeros in the store: the engine never wrote the padding
    (a destination's rows past the generation are left as they were) and wrote a dropped
    prompt's rows. `acts` is [points, C, width] (a torch tensor or a numpy view)."""
    from ...store import GEN_HAS_ACTS

    none = np.flatnonzero(~np.isin(gen, GEN_HAS_ACTS))
    if none.size:
        acts[:, none[0]:none[-1] + 1][:, none - none[0]] = 0


@dataclass
class SlotSamples:
    """The n samples of one slot's prompt, delivered together (sample s at `samples[s]`): a slot's
    metadata is written once, and only when all its samples are known. `index` is the prompt's
    request index in the actor's stream, as a captured request's is."""

    index: int
    samples: list


def _role(job, i: int):
    """Context i's planned roles (chat input), None for text."""
    return job.meta[2][i] if len(job.meta) > 2 and job.meta[2] is not None else None


class Slots:
    """An actor's generation: prompts from contexts, a seed per slot, a slot's rows to write.

    Built from ActorSpec.generate (GenerateConfig.describe(), stop ids resolved: actor_section);
    the actor keeps its unit bookkeeping and calls stream and deliver. A unit's job carries
    (doc_id, position, role or None) per context in `job.meta`."""

    def __init__(self, described: dict, context_size: int):
        self.cfg = GenerateConfig(**described)
        self.C, self.M, self.n = context_size, self.cfg.max_new_tokens, self.cfg.n
        self.P = self.cfg.prompt_len(context_size)
        self.params = engine_params(self.cfg)

    def prompt_len(self, role: "np.ndarray | None") -> int:
        """L: text prompts are P rows; a chat context is its conversation (which ends in the
        template's generation prompt), then pad rows: the prompt stops at the first of them."""
        if role is None:
            return self.P
        from ...store import roles

        pad = np.flatnonzero(role == roles.PAD)
        L = int(pad[0]) if pad.size else len(role)
        if not 0 < L <= self.P or (role[L:] != roles.PAD).any():
            # the tokenisers skip conversations longer than P (prompt_too_long): never a guess
            raise RuntimeError(f"a chat context's conversation has {L} tokens, outside 1..{self.P} "
                               "(the prompt room of a slot), or is followed by more than padding")
        return L

    def stream(self, engine, feed, points, routes: dict, **kw):
        """The engine's generation over the actor's feed, one SlotSamples per context once its n
        samples are done: each context's prompt, seeded by the slot's global context number
        (routes: request index -> (job, context index), set by the feed before it yields)."""
        n = self.n

        def seed(index: int):
            job, i = routes[index]
            return slot_seed(self.cfg.seed, job.row_start // self.C + i)

        def prompts():
            k = 0
            for batch in feed:
                out = []
                for ctx in batch:
                    job, i = routes[k]
                    k += 1
                    out.append(ctx[: self.prompt_len(_role(job, i))])
                    del job
                yield out

        dest = kw.pop("destinations", None)
        if dest is not None:
            # sample 0's rows (the prompt, then region 0) are one contiguous range at the slot's
            # start, so the engine may write them in place; a later sample's prompt rows are not
            # stored (sample 0's are), so its rows go to a buffer of the engine's and rows()
            # copies its region
            kw["destinations"] = lambda k, room: dest(k // n, room) if k % n == 0 else None
        pending: dict[int, list] = {}
        for r in engine.generate(prompts(), points, self.params, seeds=seed, **kw):
            got = pending.setdefault(r.index, [None] * n)
            got[r.sample] = r
            if all(x is not None for x in got):
                del pending[r.index]
                yield SlotSamples(r.index, got)

    def deliver(self, job, i: int, slot: SlotSamples, view) -> int:
        """Write slot i of an actor's unit (pipeline/actor._Job): its metadata, then its rows
        (in place: marks the engine's rows final, and writes the later samples' regions).
        Returns the rows written in place."""
        row = job.row_start + i * self.C
        meta, acts = self.rows(job.contexts[i], job.meta[0][i], job.meta[1][i], slot.samples,
                               view, _role(job, i))
        job.writer.write_meta(row, **meta)
        if view is None:
            job.writer.write(row, acts)
            return 0
        k = view.shape[1]
        job.writer.fill_reserved(row, k)
        if acts is not None:
            job.writer.write(row + k, acts)
        return k

    def rows(self, context: np.ndarray, doc: np.ndarray, pos: np.ndarray, reqs, view=None,
             role: "np.ndarray | None" = None):
        """(metadata columns, activations to write or None) of one slot from the engine's
        GeneratedRequests, sample s at reqs[s]. Without `view`: the activations of all C rows.
        `view`: sample 0's rows [0, k) in the shard buffer, which the engine wrote in place
        (rows without activations are zeroed there); the activations returned are rows [k, C)
        (the later samples' regions, padding), None when k = C."""
        reqs = list(reqs)
        L = self.prompt_len(role)
        if len(reqs) != self.n:
            raise RuntimeError(f"a slot got {len(reqs)} samples, not capture.generate.n={self.n}")
        for s, r in enumerate(reqs):
            if r.sample != s or r.prompt_len != L or not np.array_equal(r.token_ids[:L], context[:L]):
                raise RuntimeError("the engine returned a generation of another prompt than the "
                                   "context's; refusing to write rows that do not match their "
                                   "metadata")
        meta = slot_meta(self.cfg, self.C, doc, pos, reqs, role)
        import torch

        first = reqs[0]
        k = 0 if view is None else view.shape[1]
        if view is not None:
            zero_rows_without_activations(view, meta["gen"][:k])
        if k == self.C:
            return meta, None
        out = torch.zeros((first.acts.shape[0], self.C - k, first.acts.shape[2]),
                          dtype=first.acts.dtype)
        if view is None:
            out[:, : len(first)] = first.acts
        for s, r in enumerate(reqs[1:], 1):
            a = L + s * self.M - k  # region s, in `out`'s rows (a >= 0: k is L + M at most)
            out[:, a:a + len(r) - L] = r.acts[:, L:]
        zero_rows_without_activations(out, meta["gen"][k:])
        return meta, out


def resolved_stop(g: GenerateConfig, chat: bool, model_path: str) -> list:
    """The ids generation stops at (the store's `stop_ids`): capture.generate.stop and, with
    stop_at_eos, the checkpoint's EOS ids (the engine adds those itself, engine/generate.eos_ids:
    listed here so the store names every id that ended a sample, text stores included); with
    chat input also the chat template's end-of-turn token (SmolLM2's <|im_end|>, Llama-3's
    <|eot_id|>) and the tokenizer's EOS: an instruct model's end of turn is often not among the
    checkpoint's EOS ids, and a completion that ran past it would write the next turn's
    scaffolding and a made-up user message as 'assistant'. `chat`: data.format is chat."""
    stop = set(g.stop)
    if g.stop_at_eos:
        stop |= set(checkpoint_eos_ids(model_path))
    if chat and g.stop_at_eos:
        from transformers import AutoTokenizer

        from ..data.chat import end_of_turn_ids

        stop |= set(end_of_turn_ids(AutoTokenizer.from_pretrained(model_path)))
    return sorted(stop)


def checkpoint_eos_ids(model_path: str, revision: "str | None" = None) -> list:
    """The EOS ids of the checkpoint's config and generation config, inside its vocabulary: the
    ids engine/generate.eos_ids gives the engine (read the same way, without an engine)."""
    from transformers import AutoConfig, GenerationConfig

    conf = AutoConfig.from_pretrained(model_path, revision=revision)
    sources = [conf]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path, revision=revision))
    except OSError:  # no generation_config.json
        pass
    ids: set = set()
    for c in sources:
        e = getattr(c, "eos_token_id", None)
        ids |= {e} if isinstance(e, int) else set(e or ())
    vocab = getattr(conf, "vocab_size", None) or getattr(conf.get_text_config(), "vocab_size", None)
    return sorted(int(i) for i in ids if 0 <= i < (vocab or 1 << 62))


def actor_section(g: "GenerateConfig | None", chat: bool, model_path: str) -> "dict | None":
    """ActorSpec.generate: the settings Slots is built from (capture.generate), stop ids
    resolved; None without generation."""
    if g is None:
        return None
    return {**g.describe(), "stop": resolved_stop(g, chat, model_path)}


def store_attrs(g: GenerateConfig, chat: bool, context_size: int, model_path: str) -> dict:
    """The store's `generation` attribute (FORMAT.md, "Generation"): the settings, the prompt
    room P, the slot's rows and the stop ids the engine was given."""
    return {**g.describe(), "prompt_len": g.prompt_len(context_size),
            "slot_rows": context_size, "stop_ids": resolved_stop(g, chat, model_path)}
