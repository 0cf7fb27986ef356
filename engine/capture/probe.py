"""The block-semantics probe: measure how each block carries the residual stream, or refuse.

Run once at load, on the eager model, before anything is compiled or tapped. For every block it
tries the readings of engine/capture/block_stream.py and keeps the one that satisfies invariants any correct tap
satisfies:

  I0  each block runs once per forward, with a stream-shaped argument and output;
  I1  resid_pre(0) is the token embedding as the model scales it (c * embed + a row common to all
      probe rows: the position-0 embedding of learned-position trunks);
  I2  resid_pre(L+1) == resid_post(L);
  I3  resid_post(L) put back as the *whole* stream (second output zeroed) leaves block L+1's
      outputs and the model's final hidden state unchanged (checked for all blocks of a class in
      one forward: blocks of one class share their code, so they share their reading);
  I4  the model's final norm applied to resid_post(last) gives the model's final hidden state.

I2 alone would be tautological: block L+1's inputs are block L's outputs, so any reading applied
to both sides agrees (Cohere/EXAONE-4 return (full_stream, input_stream): "sum" reads 2x the
stream at both ends). I3 and I4 are not: they drop the information a wrong reading leaves out and
check that the model's own computation notices. I1 anchors the input side.

Errors are medians over the probe's rows: on MoE trunks a bf16 rounding difference can flip the
top-k experts of a row near a routing tie, which changes that row and is no sign of a wrong
reading; a wrong reading moves every row. The right reading still moves block L+1 by however much
that block amplifies one bf16 rounding of its input (the replacement rounds the stream where the
model's fused add kept float32): 2.5% median on SmolLM2's middle layers with the probe's
one-token rows. So each block's I3 bound is calibrated: a control forward jitters the class's
outputs by one rounding step (relative 2^-8) and the bound is max(PROBE_TOL, 4 x that change),
capped at MAX_TOL; wrong readings move block L+1 by 30% and more.

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

from . import block_stream
from . import probe_sites
from .block_stream import BlockSemantics, Trunk

log = logging.getLogger("harvest.engine")

# bf16 everywhere: the right reading differs from the model's own path only by where one bf16
# rounding of the fused add happens (measured <= 0.004 on the tiny families and SmolLM2); a wrong
# reading drops or doubles a whole stream or block output (measured >= 0.3).
PROBE_TOL = 0.02
NOISE = 2.0 ** -8  # one bf16 rounding step, relative: the control perturbation
CONTROL_FACTOR = 4.0
MAX_TOL = 0.15  # a block whose bf16 noise floor needs more cannot be told from a wrong reading

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
    sites: "probe_sites.SiteRecorder | None" = None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median over rows of the per-row relative error (see the module docstring: MoE rows)."""
    a, b = block_stream.rows(a).float(), block_stream.rows(b).float()
    if a.shape != b.shape:
        return float("inf")
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).median())


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


def _record(layers: nn.ModuleList, run: Callable, width: int, widths: dict | None = None) -> _Record:
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
        for point in block_stream.SUBMODULE_NAMES:
            name = block_stream.sublayer_name(layer, point)
            if name is not None:
                sub_mods.append(getattr(layer, name))
                sub_keys.append((li, point, name))
                subs[(li, point)] = [name, 0, None]

    def make_sub(k, orig):
        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            entry = subs[sub_keys[k][:2]]
            entry[1] += 1
            v = block_stream.sublayer_value(out)
            entry[2] = _clone(v) if block_stream.is_stream_like(v, width) else None
            return out
        return forward

    def on_return(mod, args, out):
        if done[0] and args and isinstance(args[0], torch.Tensor):
            first = block_stream.first_or_tensor(out)
            if isinstance(first, torch.Tensor):
                tail.append((mod, args[0].detach().clone(), first.detach().clone()))

    site_rec = probe_sites.SiteRecorder(layers, {"d_model": width, **(widths or {})})
    handle = nn.modules.module.register_module_forward_hook(on_return)
    try:
        with _patched(list(layers), make), _patched(sub_mods, make_sub), \
                _patched(site_rec.mods, site_rec.make):
            final = run()
    finally:
        handle.remove()
    return _Record(calls, outs, counts, subs, tail, final, site_rec)


def _jittered(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, t.shape, generator=g).to(t.device, torch.float32) * 2 - 1
    return (t.float() * (1 + NOISE * sign)).to(t.dtype)


def _replaced(out, mode: str):
    """Block L's output with the stream reading in the stream slot and the second stream-shaped
    output zeroed: what the rest of the model sees if `mode` holds the whole stream. The
    "control" mode instead jitters every stream-shaped output by one rounding step."""
    if mode == "control":
        if isinstance(out, torch.Tensor):
            return _jittered(out, 0)
        return type(out)(_jittered(t, i) if isinstance(t, torch.Tensor) and t.is_floating_point()
                         else t for i, t in enumerate(out))
    v = block_stream.post_value(mode, out)
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


def _check_replacement(layers, run, rec: _Record, members: list[int], mode: str) -> dict[int, float]:
    """I3 for every block in `members` at once: replace each one's output, then per member L the
    smallest change among block L+1's stream-shaped outputs (the final hidden state's change for
    the last block).

    The smallest, because under the right reading one of them is the stream block L+1 saw, which
    comes out bit-equal or within one bf16 rounding, while its update can amplify that rounding
    (SmolLM2's middle layers: 2.5% median); under a wrong reading block L+1 saw a different
    stream, so every output moves (>= 30% measured)."""
    n, outs = len(layers), [None] * len(layers)
    member = set(members)

    def make(i, orig):
        def forward(*a, **k):
            out = orig(*a, **k)
            outs[i] = _clone(out)
            return _replaced(out, mode) if i in member else out
        return forward

    with _patched(list(layers), make):
        final = run()
    errs = {}
    for li in members:
        if li + 1 == n:
            errs[li] = rel(final, rec.final)
            continue
        got, want = _stream_tensors(outs[li + 1]), _stream_tensors(rec.outs[li + 1])
        errs[li] = (min(rel(g, w) for g, w in zip(got, want)) if len(got) == len(want)
                    else float("inf"))
    return errs


def _check_final_norm(rec: _Record, post: torch.Tensor) -> float:
    """I4: the first module that returned after the last block and reproduces the final hidden
    state from its input is the final norm; it must do the same from resid_post(last). No such
    module: the final hidden state must be resid_post(last) itself."""
    best = rel(post, rec.final)
    for mod, arg, out in rec.tail:
        if rel(out, rec.final) > PROBE_TOL or arg.numel() != post.numel():
            continue
        with torch.inference_mode():
            got = block_stream.first_or_tensor(mod(post.reshape(arg.shape).to(arg.dtype)))
        return rel(got, rec.final)
    return best


def _fit_embedding(pre: torch.Tensor, emb: torch.Tensor) -> float:
    """I1: pre == c * emb + (one row common to all probe rows), least squares."""
    p, e = block_stream.rows(pre).float(), block_stream.rows(emb).float()
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


def _post_readings(layers, run, rec: _Record, width: int):
    """The output reading of every block (I3, I4), one class of blocks at a time, and the first
    failure as (layer, invariant, detail), or None: raised by `decide` only if no earlier layer
    fails on its input side, so the refusal names the first block that is wrong."""
    n = len(layers)
    classes: dict[type, list[int]] = {}
    for li, layer in enumerate(layers):
        classes.setdefault(type(layer), []).append(li)
    modes: list = [None] * n
    errs, failures = [dict() for _ in range(n)], []
    for members in classes.values():
        cands = block_stream.post_candidates(rec.outs[members[0]], width)
        for li in members:
            if block_stream.post_candidates(rec.outs[li], width) != cands or not cands:
                raise _refuse(layers[li], li, "I0", f"its output ({type(rec.outs[li]).__name__})"
                              " holds no [tokens, width] stream, or not like its class's others")
        noise = ({li: 0.0 for li in members} if cands == ["tensor"] else
                 _check_replacement(layers, run, rec, members, "control"))
        bound = {li: min(MAX_TOL, max(PROBE_TOL, CONTROL_FACTOR * noise[li])) for li in members}
        scores = {}  # mode -> {layer: error / bound}
        for mode in cands:
            # a tensor output is the stream or nothing: I2 (next block) and I4 decide
            scores[mode] = (_check_replacement(layers, run, rec, members, mode)
                            if mode != "tensor" else {li: 0.0 for li in members})
            if n - 1 in members:
                last = _check_final_norm(rec, block_stream.post_value(mode, rec.outs[n - 1]))
                scores[mode][n - 1] = max(scores[mode][n - 1], last)
        worst = {m: max(e / bound[li] for li, e in scores[m].items()) for m in cands}
        mode = min((m for m in cands if worst[m] <= 1), key=worst.get, default=None)
        if mode is None:
            mode = min(cands, key=worst.get)
            li = next(li for li in members if scores[mode][li] > bound[li])
            inv = "I4" if li == n - 1 and mode == "tensor" else "I3"
            failures.append((li, inv, "median row errors " +
                             _fmt({m: scores[m][li] for m in cands}) +
                             f" against a bound of {bound[li]:.3g} (bf16 noise floor "
                             f"{noise[li]:.3g})"))
        for li in members:
            modes[li] = mode
            errs[li] = {"post_errors": {m: round(scores[m][li], 5) for m in cands},
                        "noise_floor": round(noise[li], 5), "post_bound": round(bound[li], 5)}
    return modes, errs, min(failures, default=None)


@torch.no_grad()
def decide(layers: nn.ModuleList, run: Callable, embed: Callable, width: int,
           widths: dict | None = None) -> Trunk:
    """Measure every block's semantics; raise TrunkRefused naming the first block that fails.
    `widths` maps the width kinds of engine/points.py to this rank's widths (module sites)."""
    rec = _record(layers, run, width, widths)
    for li, c in enumerate(rec.counts):
        if c != 1:
            raise _refuse(layers[li], li, "I0", f"it ran {c} times in one forward")
    modes, post_errs, post_failure = _post_readings(layers, run, rec, width)
    sems, report = [], []
    for li, layer in enumerate(layers):
        args, kwargs = rec.calls[li]
        stream, residual = block_stream.locate_inputs(layer.forward, args, kwargs, width)
        if stream is None:
            raise _refuse(layer, li, "I0", "no argument is a [tokens, width] floating tensor")
        # Input side: which reading of the inputs is the stream (I1 at layer 0, I2 after).
        target = embed() if li == 0 else block_stream.post_value(modes[li - 1], rec.outs[li - 1])
        pre_errs = {}
        for adds in (False, True):
            r = residual.get(args, kwargs) if (adds and residual is not None) else None
            if adds and r is None:
                continue
            h = stream.get(args, kwargs)
            v = h if r is None else block_stream.rows(h).float() + block_stream.rows(r).float()
            pre_errs[adds] = _fit_embedding(v, target) if li == 0 else rel(v, target)
        adds = min((a for a, e in pre_errs.items() if e <= PROBE_TOL), key=pre_errs.get,
                   default=None)
        names = {a: ("stream+residual" if a else "stream") for a in pre_errs}
        if adds is None:
            raise _refuse(layer, li, "I1" if li == 0 else "I2", "row errors " +
                          _fmt({names[a]: e for a, e in pre_errs.items()}))
        if post_failure is not None and post_failure[0] == li:
            raise _refuse(layer, *post_failure)
        post = block_stream.post_value(modes[li], rec.outs[li])
        subs, sub_notes = _check_submodules(rec, li, post)
        h = stream.get(args, kwargs)
        pre = block_stream.rows(h).float() + block_stream.rows(residual.get(args, kwargs)).float() if adds else h
        sub_vals = {p: rec.subs[(li, p)][2] for p in subs}
        site_ok, site_notes = probe_sites.check(rec.sites, li, pre, post, sub_vals, width)
        sub_notes.update(site_notes)
        sems.append(BlockSemantics(stream, residual, adds, modes[li], subs, how="probe",
                                   sites=site_ok))
        report.append({"layer": li, "class": type(layer).__name__, **sems[-1].describe(),
                       "pre_errors": {names[a]: round(e, 5) for a, e in pre_errs.items()},
                       **post_errs[li], "submodule_notes": sub_notes})
    trunk = Trunk(layers, sems, {"verified": True, "tolerance": PROBE_TOL, "blocks": report})
    trunk.final_norm = probe_sites.final_norm_module(rec.tail, rec.final, block_stream.post_value(
        modes[-1], rec.outs[-1]), lambda a, b: rel(a, b) <= PROBE_TOL)
    trunk.report["final_norm"] = type(trunk.final_norm).__name__ if trunk.final_norm else None
    return trunk



def _check_submodules(rec: _Record, li: int, post: torch.Tensor) -> tuple[dict, dict]:
    """attn_out / mlp_out are served from a sub-module that ran once in its block and returned
    one row per stream row; anything else is refused when asked for, with this note."""
    subs, notes = {}, {}
    for point in block_stream.SUBMODULE_NAMES:
        entry = rec.subs.get((li, point))
        if entry is None:
            continue
        name, calls, value = entry
        if calls == 1 and value is not None and block_stream.rows(value).shape == block_stream.rows(post).shape:
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
    sems = [block_stream.guess(layer) for layer in layers]
    return Trunk(layers, sems, {"verified": False, "reason": reason,
                                "blocks": [s.describe() for s in sems]})


def probe_trunk(layers: nn.ModuleList, run: Callable, embed: Callable, width: int,
                allow_unverified: bool = False, widths: dict | None = None) -> Trunk:
    try:
        trunk = decide(layers, run, embed, width, widths)
    except TrunkRefused as e:
        if not allow_unverified:
            raise
        return unverified(layers, str(e))
    log.info("block-semantics probe passed: %s", _summary(trunk))
    return trunk


def _summary(trunk: Trunk) -> str:
    kinds = sorted({(b["class"], b["pre"], b["post"]) for b in trunk.report["blocks"]})
    return "; ".join(f"{c}: pre={p}, post={q}" for c, p, q in kinds)
