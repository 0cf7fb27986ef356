"""The block-semantics probe: measure how each block carries the residual stream, or refuse.

Run once at load, on the eager model, before anything is compiled or tapped. For every block it
tries the readings of engine/blocks.py and keeps the one that satisfies invariants any correct tap
satisfies:

  I0  each block runs once per forward, with a stream-shaped argument and output;
  I1  resid_pre(0) is the token embedding as the model scales it (c * embed + a row common to all
      probe rows: the position-0 embedding of learned-position trunks);
  I2  resid_pre(L+1) == resid_post(L);
  I3  resid_post(L) put back as the *whole* stream (second output zeroed) leaves block L+1's
      outputs and the model's final hidden state unchanged;
  I4  the model's final norm applied to resid_post(last) gives the model's final hidden state.

I2 alone would be tautological: block L+1's inputs are block L's outputs, so any reading applied
to both sides agrees (Cohere/EXAONE-4 return (full_stream, input_stream): "sum" reads 2x the
stream at both ends). I3 and I4 are not: they drop the information a wrong reading leaves out and
check that the model's own computation notices. I1 anchors the input side.

A trunk with a block no reading satisfies is refused (TrunkRefused names the layer class and the
invariant) unless the caller explicitly allows an unverified trunk; then the signature guess is
used and the report says so.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import blocks
from .blocks import BlockSemantics, Trunk

log = logging.getLogger("harvest.engine")

# bf16 everywhere: the right reading differs from the model's own path only by where one bf16
# rounding of the fused add happens (measured <= 0.004 on the tiny families and SmolLM2); a wrong
# reading drops or doubles a whole stream or block output (measured >= 0.3).
PROBE_TOL = 0.02

INVARIANTS = {
    "I0": "each block runs once per forward, with a [tokens, width] stream argument and output",
    "I1": "resid_pre(0) equals the token embeddings as the model scales them",
    "I2": "resid_pre(L+1) equals resid_post(L)",
    "I3": "resid_post(L), put back as the whole stream, leaves block L+1 and the final hidden state "
          "unchanged",
    "I4": "the final norm of resid_post(last) equals the model's final hidden state",
}


class TrunkRefused(ValueError):
    """The probe could not establish where some block's residual stream is."""


@dataclass
class _Record:
    calls: list  # per layer: (args, kwargs), tensors cloned before the block ran
    outs: list  # per layer: output, cloned
    counts: list[int]
    subs: dict  # (layer, point) -> (attribute, calls, output rows or None)
    tail: list  # (module, first arg, first output) of modules that returned after the last block
    final: torch.Tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = blocks.rows(a).float(), blocks.rows(b).float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _patched(mods: list[nn.Module], make: Callable):
    """Temporarily replace each module's forward (instance attribute) with make(i, orig)."""
    saved = [m.__dict__.get("forward") for m in mods]
    try:
        for i, m in enumerate(mods):
            m.forward = make(i, m.forward)
        yield
    finally:
        for m, f in zip(mods, saved):
            if f is None:
                del m.forward
            else:
                m.forward = f


def _record(layers: nn.ModuleList, run: Callable, width: int) -> _Record:
    n = len(layers)
    calls, outs, counts, tail = [None] * n, [None] * n, [0] * n, []
    done = [False]
    subs: dict = {}

    def make(i, orig):
        def forward(*args, **kwargs):
            counts[i] += 1
            calls[i] = (_clone(args), _clone(kwargs))  # before: some blocks add in place (Falcon)
            out = orig(*args, **kwargs)
            outs[i] = _clone(out)
            done[0] = i == n - 1
            return out
        return forward

    sub_mods, sub_keys = [], []
    for li, layer in enumerate(layers):
        for point in blocks.SUBMODULE_NAMES:
            name = blocks.sublayer_name(layer, point)
            if name is not None:
                sub_mods.append(getattr(layer, name))
                sub_keys.append((li, point, name))
                subs[(li, point)] = [name, 0, None]

    def make_sub(k, orig):
        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            entry = subs[sub_keys[k][:2]]
            entry[1] += 1
            v = blocks.sublayer_value(out)
            entry[2] = _clone(v) if blocks.is_stream_like(v, width) else None
            return out
        return forward

    def on_return(mod, args, out):
        if done[0] and args and isinstance(args[0], torch.Tensor):
            first = blocks.first_or_tensor(out)
            if isinstance(first, torch.Tensor):
                tail.append((mod, args[0].detach().clone(), first.detach().clone()))

    handle = nn.modules.module.register_module_forward_hook(on_return)
    try:
        with _patched(list(layers), make), _patched(sub_mods, make_sub):
            final = run()
    finally:
        handle.remove()
    return _Record(calls, outs, counts, subs, tail, final)


def _replaced(out, mode: str):
    """Block L's output with the stream reading in the stream slot and the second stream-shaped
    output zeroed: what the rest of the model sees if `mode` holds the whole stream."""
    v = blocks.post_value(mode, out)
    if mode == "tensor":
        return v
    rest = list(out[1:])
    if rest and isinstance(rest[0], torch.Tensor) and rest[0].shape == out[0].shape:
        rest[0] = torch.zeros_like(rest[0])
    return (v, *rest)


def _stream_tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _check_replacement(layers, run, rec: _Record, li: int, mode: str) -> float:
    """I3: the largest relative change of block li+1's outputs and of the final hidden state."""
    nxt = [None]

    def make(i, orig):
        if i == li:
            return lambda *a, **k: _replaced(orig(*a, **k), mode)
        if i == li + 1:
            def forward(*a, **k):
                out = orig(*a, **k)
                nxt[0] = _clone(out)
                return out
            return forward
        return orig

    with _patched(list(layers), make):
        final = run()
    errs = [rel(final, rec.final)]
    if li + 1 < len(layers):
        got, want = _stream_tensors(nxt[0]), _stream_tensors(rec.outs[li + 1])
        errs += [rel(g, w) for g, w in zip(got, want)] if len(got) == len(want) else [float("inf")]
    return max(errs)


def _check_final_norm(rec: _Record, post: torch.Tensor) -> float:
    """I4: the first module that returned after the last block and reproduces the final hidden
    state from its input is the final norm; it must do the same from resid_post(last). No such
    module: the final hidden state must be resid_post(last) itself."""
    best = rel(post, rec.final)
    for mod, arg, out in rec.tail:
        if rel(out, rec.final) > PROBE_TOL or arg.numel() != post.numel():
            continue
        with torch.inference_mode():
            got = blocks.first_or_tensor(mod(post.reshape(arg.shape).to(arg.dtype)))
        return rel(got, rec.final)
    return best


def _fit_embedding(pre: torch.Tensor, emb: torch.Tensor) -> float:
    """I1: pre == c * emb + (one row common to all probe rows), least squares."""
    p, e = blocks.rows(pre).float(), blocks.rows(emb).float()
    if p.shape != e.shape:
        return float("inf")
    p, e = p - p.mean(0), e - e.mean(0)
    c = (p * e).sum() / (e * e).sum().clamp_min(1e-30)
    if c <= 0:
        return float("inf")
    return float((p - c * e).norm() / p.norm().clamp_min(1e-30))


def _refuse(layer: nn.Module, li: int, inv: str, detail: str) -> TrunkRefused:
    return TrunkRefused(
        f"block {type(layer).__name__} (layer {li}) failed the block-semantics probe: invariant "
        f"{inv} ({INVARIANTS[inv]}): {detail}. Captures from this trunk would be silently wrong, "
        "so it is refused. If you have checked it by other means, load it with "
        "additional_config={'harvest_unverified_trunk': True} (the signature guess is then used) "
        "and run `harvest check-model` against the Hugging Face reference first.")


@torch.no_grad()
def decide(layers: nn.ModuleList, run: Callable, embed: Callable, width: int) -> Trunk:
    """Measure every block's semantics; raise TrunkRefused naming the first block that fails."""
    rec = _record(layers, run, width)
    n = len(layers)
    for li, c in enumerate(rec.counts):
        if c != 1:
            raise _refuse(layers[li], li, "I0", f"it ran {c} times in one forward")
    sems, report = [], []
    prev_post = None
    for li, layer in enumerate(layers):
        args, kwargs = rec.calls[li]
        stream, residual = blocks.locate_inputs(layer.forward, args, kwargs, width)
        if stream is None:
            raise _refuse(layer, li, "I0", "no argument is a [tokens, width] floating tensor")
        # Input side: which reading of the inputs is the stream (I1 at layer 0, I2 after).
        target = embed() if li == 0 else prev_post
        pre_errs = {}
        for adds in (False, True):
            r = residual.get(args, kwargs) if (adds and residual is not None) else None
            if adds and r is None:
                continue
            h = stream.get(args, kwargs)
            v = h if r is None else blocks.rows(h).float() + blocks.rows(r).float()
            pre_errs[adds] = _fit_embedding(v, target) if li == 0 else rel(v, target)
        adds = min((a for a, e in pre_errs.items() if e <= PROBE_TOL), key=pre_errs.get,
                   default=None)
        if adds is None:
            inv = "I1" if li == 0 else "I2"
            raise _refuse(layer, li, inv, "relative errors " + _fmt(
                {("stream+residual" if a else "stream"): e for a, e in pre_errs.items()}))
        # Output side: which reading of the output is the stream (I3 / I4). Every reading is
        # scored, so the report shows the margin between the kept one and the others.
        out = rec.outs[li]
        post_errs, failed = {}, {}
        for mode in blocks.post_candidates(out, width):
            errs = {}
            if mode != "tensor":  # a tensor output is the stream or nothing: I2 and I4 decide
                errs["I3"] = _check_replacement(layers, run, rec, li, mode)
            if li == n - 1:
                errs["I4"] = _check_final_norm(rec, blocks.post_value(mode, out))
            post_errs[mode] = max(errs.values(), default=0.0)
            failed[mode] = max(errs, key=errs.get) if errs else "I0"
        mode = min((m for m, e in post_errs.items() if e <= PROBE_TOL), key=post_errs.get,
                   default=None)
        if mode is None:
            if not post_errs:
                raise _refuse(layer, li, "I0", f"its output ({type(out).__name__}) holds no "
                                               "[tokens, width] tensor")
            best = min(post_errs, key=post_errs.get)
            raise _refuse(layer, li, failed[best], "relative errors " + _fmt(post_errs))
        prev_post = blocks.post_value(mode, out)
        subs, sub_notes = _check_submodules(rec, li, prev_post)
        sems.append(BlockSemantics(stream, residual, adds, mode, subs, how="probe"))
        report.append({"layer": li, "class": type(layer).__name__, **sems[-1].describe(),
                       "pre_errors": {("stream+residual" if a else "stream"): round(e, 5)
                                      for a, e in pre_errs.items()},
                       "post_errors": {m: round(e, 5) for m, e in post_errs.items()},
                       "submodule_notes": sub_notes})
    _check_one_reading_per_class(layers, sems)
    return Trunk(layers, sems, {"verified": True, "tolerance": PROBE_TOL, "blocks": report})


def _check_one_reading_per_class(layers: nn.ModuleList, sems: list[BlockSemantics]) -> None:
    """Blocks of one class share their code, so they must share their output reading. This
    carries the strong evidence of blocks 0..N-2 (I3 compares the next block's raw outputs) to the
    last block, whose only evidence (I4, through a scale-invariant final norm) is weaker: reading
    2x+b instead of x+b moves a normalised row by about |b|/(2|x|)."""
    first: dict[type, tuple[int, str]] = {}
    for li, (layer, sem) in enumerate(zip(layers, sems)):
        seen = first.setdefault(type(layer), (li, sem.post))
        if seen[1] != sem.post:
            raise _refuse(layer, li, "I3", f"its output reads as {sem.post!r} but layer {seen[0]} "
                                           f"of the same class reads as {seen[1]!r}")


def _check_submodules(rec: _Record, li: int, post: torch.Tensor) -> tuple[dict, dict]:
    """attn_out / mlp_out are served from a sub-module that ran once in its block and returned
    one row per stream row; anything else is refused when asked for, with this note."""
    subs, notes = {}, {}
    for point in blocks.SUBMODULE_NAMES:
        entry = rec.subs.get((li, point))
        if entry is None:
            continue
        name, calls, value = entry
        if calls == 1 and value is not None and blocks.rows(value).shape == blocks.rows(post).shape:
            subs[point] = name
        else:
            notes[point] = f"{name} ran {calls} times" + ("" if value is not None else
                                                          " without a [tokens, width] output")
    return subs, notes


def _fmt(errs: dict) -> str:
    return ", ".join(f"{k}: {v:.3g}" for k, v in errs.items()) or "none"


def unverified(layers: nn.ModuleList, reason: str) -> Trunk:
    """The opt-in escape hatch: signature-guessed semantics, flagged in the report."""
    log.warning("capturing from an UNVERIFIED trunk (opted in): %s", reason)
    sems = [blocks.guess(layer) for layer in layers]
    return Trunk(layers, sems, {"verified": False, "reason": reason,
                                "blocks": [s.describe() for s in sems]})


def probe_trunk(layers: nn.ModuleList, run: Callable, embed: Callable, width: int,
                allow_unverified: bool = False) -> Trunk:
    try:
        trunk = decide(layers, run, embed, width)
    except TrunkRefused as e:
        if not allow_unverified:
            raise
        return unverified(layers, str(e))
    log.info("block-semantics probe passed: %s", _summary(trunk))
    return trunk


def _summary(trunk: Trunk) -> str:
    kinds = sorted({(b["class"], b["pre"], b["post"]) for b in trunk.report["blocks"]})
    return "; ".join(f"{c}: pre={p}, post={q}" for c, p, q in kinds)
