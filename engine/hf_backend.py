"""Eager Hugging Face backend: the exact reference, on any device, with plain forward hooks.

Kept deliberately simple (right-padded micro-batches, hooks on the decoder layers) because every
other backend is checked against it. resid_post is the decoder layer's output: for the last layer
that is the stream *before* the final norm, which `output_hidden_states[-1]` is not.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from .capture import block_stream
from .addresses import Address, parse_addresses
from .capture import scores
from .capture.captured import CapturedRequest
from .points import LOGIT_POINTS, ROUTING_POINTS
from .checkpoint import read_model_info, validate_tokens
from .protocol import CaptureOnly, DestinationProvider, StepStats
from .capture.probe_sites import read_output
from .capture.sites import (ATTN_NAMES, QKV_ARGS, SITE_POINTS, Site, candidates,
                                          child, module_at)
from .capture.taps import ForwardSwap, check_supported, find_layers, routing_rows


def _input_of(args, kwargs, width: int):
    """A Hugging Face module's stream input ([batch, tokens, width]: batched, unlike vLLM's):
    the stream-named keyword, else the first floating tensor of that width."""
    for v in [kwargs.get(n) for n in block_stream.STREAM_NAMES] + list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape[-1] == width:
            return v
    raise RuntimeError(f"no {width}-wide floating input in this module call")


def hf_sites(sem: block_stream.BlockSemantics, layer, parallel: bool) -> tuple[block_stream.BlockSemantics,
                                                                          dict]:
    """The reference's module sites: the candidates by Hugging Face's module names (the eager
    backend has no probe), and the reasons of the points it refuses; a parallel-residual config
    has no stream between attention and MLP. q, k and v are read where Hugging Face has them
    after the rotary embedding: the inputs of the attention function (`attn_fn`, see
    `QKVRecording`)."""
    import dataclasses

    sites, why = candidates(layer)
    if parallel:
        for p in ("resid_mid", "attn_out_post", "mlp_out_post"):
            sites.pop(p, None)
            why[p] = "a parallel-residual block has no stream between attention and the MLP"
    attn = child(layer, ATTN_NAMES)
    if attn is not None:
        for p, arg in QKV_ARGS.items():
            sites[p] = Site(attn, "attn_fn", arg=arg)
            why.pop(p, None)
    return dataclasses.replace(sem, sites=sites), why


QKV_ATTENTION = "harvest_qkv"  # the attention function registered while q/k/v are captured


def _qkv_attention(module, query, key, value, *args, **kwargs):
    """transformers' attention function while q, k or v are captured (`QKVRecording`): hands
    the module's query/key/value (`[batch, heads, tokens, head_dim]`, after the rotary
    embedding and any QK-norm, KV heads before grouped-query repetition) to its recorder, then
    runs the implementation the model had."""
    module.harvest_qkv_record(query, key, value)
    return module.harvest_qkv_inner(module, query, key, value, *args, **kwargs)


class QKVRecording:
    """q, k, v on the eager backend. Hugging Face computes them inside the attention module's
    forward (projections, QK-norm, the family's rotary function) and passes them to the attention
    function the config names through transformers' AttentionInterface; no module outputs
    them. While this is in place the model's attention implementation is `harvest_qkv`
    (`model.set_attn_implementation`, the documented way to swap it), which records each
    module's inputs for the points asked and calls the implementation the model had (its
    family's `eager_attention_forward` when that was "eager"), so the forward is unchanged.
    `remove()` puts the implementation back."""

    def __init__(self, model, attn_modules: dict, want: dict, store: dict):
        """attn_modules: {layer: its attention module}; want: {layer: {arg: Address}}."""
        import sys

        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.model, self.modules = model, list(attn_modules.values())
        self.before = model.config._attn_implementation
        AttentionInterface.register(QKV_ATTENTION, _qkv_attention)
        for li, mod in attn_modules.items():
            eager = getattr(sys.modules[type(mod).__module__], "eager_attention_forward", None)
            mod.harvest_qkv_inner = ALL_ATTENTION_FUNCTIONS.get_interface(self.before, eager)
            mod.harvest_qkv_record = self._recorder(want.get(li, {}), store)
        model.set_attn_implementation(QKV_ATTENTION)

    @staticmethod
    def _recorder(points: dict, store: dict):
        """points: {"query"|"key"|"value": Address}."""
        def record(query, key, value):
            for arg, t in (("query", query), ("key", key), ("value", value)):
                if arg in points:  # [batch, heads, tokens, head_dim] -> [batch, tokens, width]
                    store[points[arg]] = t.transpose(1, 2).flatten(2)
        return record

    def remove(self) -> None:
        self.model.set_attn_implementation(self.before)
        for mod in self.modules:
            del mod.harvest_qkv_inner, mod.harvest_qkv_record


class HFModel(CaptureOnly):
    """A harvest.engine.protocol.CaptureEngine on a Hugging Face model. A step is one padded
    micro-batch forward of at most `max_num_batched_tokens` tokens, padding included."""

    backend = "eager"
    mode = "eager"
    frozen = None
    accepts_destinations = False  # rows come from the hooks' own tensors

    def __init__(self, name_or_path: str, *, dtype: str = "bfloat16", device: str | None = None,
                 revision: str | None = None, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, **unused):
        from transformers import AutoModelForCausalLM

        self.info = read_model_info(name_or_path, revision)
        self.name, self.revision = name_or_path, revision
        self.n_layers, self.width = self.info.n_layers, self.info.width
        self.max_model_len = min(max_model_len or self.info.max_position, self.info.max_position)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            name_or_path, revision=revision, dtype=self.dtype).to(self.device).eval()
        layers = find_layers(self.model, self.n_layers)
        parallel = bool(getattr(self.model.config, "use_parallel_residual", False)
                        or getattr(self.model.config, "parallel_attn", False))
        sems, notes = zip(*(hf_sites(block_stream.hf_semantics(layer), layer, parallel)
                            for layer in layers))
        self.trunk = block_stream.Trunk(layers, list(sems),
                                  {"blocks": [{"submodule_notes": n} for n in notes]})
        # final_norm.0: HF's base model applies the final norm to its output (no probe here)
        self.trunk.final_norm = self.model.base_model
        # expert routing: Hugging Face's top-k routers (transformers 5: Mixtral, Qwen2/3-MoE,
        # OLMoE `mlp.gate`) return (logits, top-k weights, top-k ids); checked at each call
        self.trunk.routing = {li: block_stream.RoutingSite(module_at(layer, sem.sites["router_logits"].path),
                                                     "forward", 1, 2)
                              for li, (layer, sem) in enumerate(zip(layers, sems))
                              if "router_logits" in sem.sites}
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.steps = self.scheduled_tokens = 0
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.name, revision=self.revision)
        return self._tokenizer

    def describe(self) -> dict:
        import transformers

        return {"model": self.name, "revision": self.revision, "backend": "eager", "mode": "eager",
                "dtype": str(self.dtype).replace("torch.", ""), "n_layers": self.n_layers,
                "width": self.width,
                "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}

    def _hooks(self, pts: tuple[Address, ...], store: dict):
        """Same stream and sub-module rules as the vLLM taps (engine/capture/block_stream.py), so a point one
        backend refuses the other refuses too."""
        check_supported(self.trunk, pts)
        handles: list = []
        qkv: dict[int, dict] = {}  # layer -> {"query"|"key"|"value": Address}
        for li in sorted({a.layer for a in pts if a.name in ROUTING_POINTS}):
            site = self.trunk.routing[li]
            handles.append(ForwardSwap(site.obj, self._router(getattr(site.obj, site.attr), li, store),
                                       site.attr))
        for a in pts:
            layer, sem = self.trunk[a.layer], self.trunk.semantics[a.layer]
            if a.name in LOGIT_POINTS or a.name in ROUTING_POINTS:   # _scores, _router
                continue
            if a.name == "final_norm":  # the base model's output: HF applies the final norm
                def final(mod, args, out, a=a):
                    store[a] = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
                handles.append(self.trunk.final_norm.register_forward_hook(final))
            elif a.name in ("resid_pre", "embeddings"):
                def pre(mod, args, kwargs, a=a, sem=sem):
                    store[a] = sem.stream.get(args, kwargs)
                handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            elif a.name in SITE_POINTS:
                site = sem.sites[a.name]
                mod = module_at(layer, site.path)
                width = self.info.point_width(a.name)
                if site.reading == "attn_fn":
                    qkv.setdefault(a.layer, {})[site.arg] = a
                elif site.reading == "out":
                    def out_hook(mod, args, out, a=a, site=site):
                        store[a] = read_output(site, out)
                    handles.append(mod.register_forward_hook(out_hook))
                else:
                    def in_hook(mod, args, kwargs, a=a, width=width):
                        store[a] = _input_of(args, kwargs, width)
                    handles.append(mod.register_forward_pre_hook(in_hook, with_kwargs=True))
            elif a.name == "resid_post":
                def post(mod, args, out, a=a):
                    store[a] = block_stream.first_or_tensor(out)
                handles.append(layer.register_forward_hook(post))
            else:
                def sub(mod, args, out, a=a):
                    store[a] = block_stream.sublayer_value(out)
                handles.append(self.trunk.sublayer(a).register_forward_hook(sub))
        if qkv:
            attn = {li: getattr(layer, name) for li, layer in enumerate(self.trunk.layers)
                    if (name := child(layer, ATTN_NAMES)) is not None}
            handles.append(QKVRecording(self.model, attn, qkv, store))
        return handles

    def _router(self, orig, li: int, store: dict):
        """The layer's Hugging Face router, its top-k choice kept as the vLLM taps keep it
        (sorted by weight, float32 weights and int32 ids packed: engine/capture/packed.py)."""
        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ValueError(f"expert_indices.{li} / expert_weights.{li}: this Hugging Face "
                                 f"router ({type(orig.__self__).__name__}) does not return "
                                 "(logits, top-k weights, top-k ids); capture router_logits")
            w_rows, i_rows = routing_rows(out[1], out[2], self.dtype)
            store[Address("expert_weights", li)], store[Address("expert_indices", li)] = w_rows, i_rows
            return out
        return forward

    def _batches(self, source):
        batch, longest = [], 0
        for item in source:
            n = len(item[1])
            if batch and max(longest, n) * (len(batch) + 1) > self.max_num_batched_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(item)
            longest = max(longest, n)
        if batch:
            yield batch

    def step_stats(self) -> StepStats:
        return {"steps": self.steps, "scheduled_tokens": self.scheduled_tokens,
                "max_num_batched_tokens": self.max_num_batched_tokens}

    def capture(self, batches: Iterable[Sequence[Sequence[int]]], points=None,
                destinations: DestinationProvider | None = None,
                quantize: str | None = None) -> Iterator[CapturedRequest]:
        if destinations is not None:  # at the call, not at the first row
            raise ValueError("the eager backend yields rows in its own tensors: destinations are "
                             "not supported (accepts_destinations is False)")
        if quantize is not None:
            raise ValueError(f"the eager backend yields rows in the model dtype: quantize="
                             f"{quantize!r} is not supported (quantizes is False)")
        return self._capture(batches, points)

    @torch.inference_mode()
    def _capture(self, batches, points) -> Iterator[CapturedRequest]:
        if points is None:
            points = [Address("resid_post", i) for i in range(self.n_layers)]
        pts = parse_addresses([points] if isinstance(points, (str, Address)) else points, self.n_layers)
        for a in pts:
            if a.name == "resid_streams":
                raise ValueError(f"{a}: this trunk has a single residual stream")
        source = ((i, validate_tokens(t, self.max_model_len, self.info.vocab_size))
                  for i, t in enumerate(t for b in batches for t in b))
        store: dict = {}
        handles = self._hooks(pts, store)
        try:
            for mb in self._batches(source):
                longest = max(len(ids) for _, ids in mb)
                ids = torch.zeros(len(mb), longest, dtype=torch.long)
                mask = torch.zeros(len(mb), longest, dtype=torch.long)
                for j, (_, t) in enumerate(mb):
                    ids[j, : len(t)] = torch.from_numpy(t.astype(np.int64))
                    mask[j, : len(t)] = 1
                store.clear()
                out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                 use_cache=False)
                self._scores(pts, out.logits, ids.to(self.device), mask.to(self.device), store)
                self.steps += 1
                self.scheduled_tokens += sum(len(t) for _, t in mb)
                missing = [str(a) for a in pts if a not in store]
                if missing:
                    raise ValueError(
                        f"{', '.join(missing)}: the Hugging Face model never handed these to "
                        "their hook (q/k/v: its attention module does not call transformers' "
                        "AttentionInterface, so they are not observable on the eager backend)")
                widths = tuple(store[a].shape[-1] for a in pts)
                wide = max(widths, default=self.width)
                stacked = torch.stack([torch.nn.functional.pad(store[a], (0, wide - store[a].shape[-1]))
                                       .reshape(len(mb), longest, wide) for a in pts]).to("cpu")
                for j, (index, t) in enumerate(mb):
                    acts = stacked[:, j, : len(t)].contiguous()
                    yield CapturedRequest(index, t, np.arange(len(t), dtype=np.int32), pts, acts,
                                          None if all(w == wide for w in widths) else widths)
        finally:
            for h in handles:
                h.remove()

    def _scores(self, pts, logits, ids, mask, store) -> None:
        """logprob.0 / entropy.0 from the forward's logits (Hugging Face applies the final
        softcapping in its forward), packed like the vLLM engine's (engine/capture/scores.py)."""
        want = [a for a in pts if a.name in LOGIT_POINTS]
        if not want:
            return
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)
        nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        has = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1).bool()
        lp = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        lp = torch.where(has, lp, torch.full_like(lp, float("nan")))
        for a in want:
            v = lp if a.name == "logprob" else ent
            store[a] = scores.pack(v.reshape(-1), self.dtype).reshape(*v.shape, -1)

    def close(self) -> None:
        self.model = None
