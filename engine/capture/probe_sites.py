"""The probe's second half: record every candidate module site (engine/capture/sites.py) in the probe's
forward and keep only the sites whose readings satisfy what the point means.

Every site must run once in its block and give one row per stream row at the point's width (the
width the model's config gives, engine/points.py; a shard's width under tensor parallelism).
The stream between attention and MLP is checked against the block's own measured stream, not
taken on the module's name:

  S1  resid_mid - resid_pre  = c * (attention's output: attn_out_post where the block post-norms
      it, else attn_out), c > 0 (1 almost everywhere; Granite's residual_multiplier);
  S2  resid_post - resid_mid = c' * (mlp_out_post where the block post-norms it, else mlp_out).

A parallel block's pre-MLP norm reads resid_pre, so S1 fails (its difference is zero) and
resid_mid is refused by name there; a norm's output taken for its input would fail both. The
post-norm points are checked by the same S1/S2 (they are the terms). Errors are row medians of
the fit's relative error, like the block probe's (MoE routing ties move single rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import block_stream
from . import sites
from .sites import Site

SITE_TOL = 0.1  # bf16 cancellation in resid_mid - resid_pre stays ~1e-2; a wrong site is >= 0.5


def _clone(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def find_input(fn, args, kwargs, width: int | None):
    """(stream slot, residual slot) of a module call: the point-width floating tensor by
    parameter name (locate_inputs in engine/capture/block_stream.py); any width when the config gives none."""
    if width is None:
        for v in args:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() in (2, 3):
                width = v.shape[-1]
                break
    if width is None:
        return None, None
    return block_stream.locate_inputs(fn, args, kwargs, width)


def find_named(fn, args, kwargs, name: str):
    """The slot of parameter `name` in a module call (by position when passed positionally),
    or None when the call does not pass it."""
    if name in kwargs:
        return block_stream.Slot(None, name)
    pos, _ = block_stream.positional_names(fn)
    if name in pos and pos.index(name) < len(args):
        return block_stream.Slot(pos.index(name), name)
    return None


def read_input(site: Site, args, kwargs):
    """A site's input reading from a call, with the slots the probe located."""
    h = block_stream.arg_value(args, kwargs, *site.stream)
    if site.arg is not None and isinstance(h, torch.Tensor):
        return h.flatten(1)  # [tokens, heads, head_dim] -> [tokens, heads x head_dim]
    if site.reading == "in+res" and site.residual is not None:
        r = block_stream.arg_value(args, kwargs, *site.residual)
        if r is not None:
            return h + r
    return h


def read_output(site: Site, out):
    """A site's output reading: the module's output, or the `part` of it."""
    v = block_stream.sublayer_value(out)
    if site.part is None or v is None:
        return v
    i, k = site.part
    w = v.shape[-1] // k
    return v[..., i * w:(i + 1) * w]


def point_width(point: str, widths: dict) -> int | None:
    from ..points import BY_NAME

    return widths.get(BY_NAME[point].width)


@dataclass
class Seen:
    """What one candidate site saw in the probe forward: its calls, the value it read (None
    when no tensor of the point's width was there) and the site as located in that call."""
    calls: int
    value: torch.Tensor | None
    site: Site


class SiteRecorder:
    """Patches every candidate site of every layer for one probe forward (see probe._record).
    A module that is the site of several points (q, k and v at the attention kernel; the two
    halves of gate_up_proj) is patched once and records all of them from the same call, located
    on its own signature."""

    def __init__(self, layers: nn.ModuleList, widths: dict):
        self.widths = widths
        self.cands, self.notes = [], []
        self.mods: list[nn.Module] = []
        self.keys: list[list[tuple[int, str, Site]]] = []  # per patched module, its sites
        self.seen: dict[tuple[int, str], Seen] = {}
        for li, layer in enumerate(layers):
            c, why = sites.candidates(layer)
            self.cands.append(c)
            self.notes.append(dict(why))
            for p, site in c.items():
                mod = sites.module_at(layer, site.path)
                k = next((i for i, m in enumerate(self.mods) if m is mod), None)
                if k is None:
                    self.mods.append(mod)
                    self.keys.append([])
                    k = len(self.mods) - 1
                self.keys[k].append((li, p, site))
                self.seen[(li, p)] = Seen(0, None, site)

    def make(self, k: int, orig):
        entries = [(self.seen[(li, p)], site, point_width(p, self.widths))
                   for li, p, site in self.keys[k]]

        def forward(*args, **kwargs):
            for entry, site, width in entries:
                entry.calls += 1
                if site.reading == "out":
                    continue
                if site.arg is not None:
                    s, r = find_named(orig, args, kwargs, site.arg), None
                else:
                    s, r = find_input(orig, args, kwargs, width)
                if s is not None:
                    res = (r.index, r.name) if r is not None else None
                    located = Site(site.path, site.reading, (s.index, s.name), res, site.arg)
                    v = read_input(located, args, kwargs)
                    entry.value, entry.site = (_clone(v.float()) if isinstance(v, torch.Tensor)
                                               else None), located
            out = orig(*args, **kwargs)
            for entry, site, _ in entries:
                if site.reading == "out":
                    entry.value = _clone(read_output(site, out))
            return out
        return forward


def _fit(diff: torch.Tensor, term: torch.Tensor) -> float:
    """Median row error of diff = c * term with one c > 0 (inf when c <= 0)."""
    d, t = block_stream.rows(diff).float(), block_stream.rows(term).float()
    if d.shape != t.shape:
        return float("inf")
    c = (d * t).sum() / (t * t).sum().clamp_min(1e-30)
    if c <= 0:
        return float("inf")
    return float(((d - c * t).norm(dim=1) / d.norm(dim=1).clamp_min(1e-30)).median())


def check(rec: SiteRecorder, li: int, pre: torch.Tensor, post: torch.Tensor, subs: dict,
          width: int) -> tuple[dict, dict]:
    """The verified sites of layer `li` and the notes (reasons) of the points it cannot serve.
    `subs` maps attn_out/mlp_out to the block's recorded sublayer output (None if not served)."""
    ok, notes = {}, dict(rec.notes[li])
    n_rows = block_stream.rows(post).shape[0]
    vals = {}
    for p in rec.cands[li]:
        seen = rec.seen[(li, p)]
        calls, value, site = seen.calls, seen.value, seen.site
        want = width if point_width(p, rec.widths) is None and p in ("attn_in", "mlp_in",
                                                                     "resid_mid") else \
            point_width(p, rec.widths)
        if calls != 1 or value is None:
            notes[p] = (f"{site.path} ran {calls} times in one block forward" if calls != 1 else
                        f"{site.path} was called without a `{site.arg}` tensor argument"
                        if site.arg else f"no {want or ''}-wide tensor at {site.path} "
                                         f"({site.reading})")
            continue
        r = block_stream.rows(value)
        if r.shape[0] != n_rows or (want is not None and r.shape[1] != want):
            notes[p] = (f"{site.path} gave {tuple(r.shape)} where {n_rows} rows of width {want} "
                        "were expected")
            continue
        ok[p], vals[p] = site, r
    if "mlp_pre" in rec.cands[li]:
        _check_mlp_pre(rec, li, ok, vals, notes)
    if "resid_mid" in ok:
        attn = vals.get("attn_out_post") if "attn_out_post" in rec.cands[li] else subs.get("attn_out")
        mlp = vals.get("mlp_out_post") if "mlp_out_post" in rec.cands[li] else subs.get("mlp_out")
        mid = vals["resid_mid"]
        s1 = _fit(mid - block_stream.rows(pre).float(), attn) if attn is not None else float("inf")
        s2 = _fit(block_stream.rows(post).float() - mid, mlp) if mlp is not None else float("inf")
        if not (s1 <= SITE_TOL and s2 <= SITE_TOL):
            for p in ("resid_mid", "attn_out_post", "mlp_out_post"):
                if p in ok:
                    del ok[p]
                    notes[p] = (f"{rec.cands[li]['resid_mid'].path}'s input is not the stream "
                                "between attention and MLP (resid_mid - resid_pre ~ attention "
                                f"output: error {s1:.3g}; resid_post - resid_mid ~ MLP output: "
                                f"{s2:.3g}; bound {SITE_TOL}): a parallel block (attention and "
                                "MLP both read resid_pre) has no stream between them")
    else:
        for p in ("attn_out_post", "mlp_out_post"):
            if p in ok:  # unverifiable without the stream between them
                del ok[p]
                notes[p] = notes.get("resid_mid", "no resid_mid site to check it against")
    return ok, notes


# The activations a dense MLP applies to its pre-activation (Hugging Face's `silu`, `gelu`,
# `gelu_new` / `gelu_pytorch_tanh`, `relu`): the probe needs one of them to reproduce
# down_proj's input from mlp_pre (times mlp_pre_linear on a gated MLP).
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


def _row_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).median())


def mlp_pre_fit(pre: torch.Tensor, lin: torch.Tensor | None, act: torch.Tensor) -> tuple[float, str]:
    """(median row error, activation) of the best fit act ~ f(pre) * lin (f(pre) when `lin`
    is None) over ACTIVATIONS. The right reading fits to bf16 rounding; swapped halves of a
    fused gate_up_proj (f(up) * gate) or another tensor are off by the size of the row."""
    pre, act = pre.float(), act.float()
    best = (float("inf"), "")
    for name, f in ACTIVATIONS.items():
        got = f(pre) if lin is None else f(pre) * lin.float()
        best = min(best, (_row_err(got, act), name))
    return best


def _check_mlp_pre(rec: SiteRecorder, li: int, ok: dict, vals: dict, notes: dict) -> None:
    """Keep mlp_pre (and mlp_pre_linear) only where the activation of mlp_pre (times
    mlp_pre_linear on a gated MLP) is down_proj's input (mlp_act): that proves which half of a
    fused gate_up_proj is the gate and that no scale or other op sits between them."""
    gated = "mlp_pre_linear" in rec.cands[li]
    pts = ("mlp_pre", "mlp_pre_linear") if gated else ("mlp_pre",)
    site = rec.cands[li]["mlp_pre"]
    if not all(p in ok for p in pts) or "mlp_act" not in vals:
        missing = [p for p in (*pts, "mlp_act") if p not in vals]
        why = (f"{site.path}'s output cannot be checked against the MLP's activation: no "
               f"verified {', '.join(missing)} in this block")
    else:
        err, f = mlp_pre_fit(vals["mlp_pre"], vals.get("mlp_pre_linear") if gated else None,
                             vals["mlp_act"])
        if err <= SITE_TOL:
            return
        formula = "act(mlp_pre) x mlp_pre_linear" if gated else "act(mlp_pre)"
        why = (f"{site.path}'s output is not the MLP's pre-activation: {formula} is not "
               f"down_proj's input for any activation of {', '.join(ACTIVATIONS)} (closest "
               f"{f}: median row error {err:.3g}, bound {SITE_TOL}); the halves of a fused "
               "projection may be [up | gate], or a scale sits between projection and "
               "activation")
    for p in pts:
        if p in ok:  # a point refused already (its width) keeps its own reason
            del ok[p]
            notes[p] = why


def final_norm_module(tail, final: torch.Tensor, post: torch.Tensor, close):
    """final_norm.0's module: the first module returning after the last block (`tail`: (module,
    first input, first output)) whose output is the model's final hidden state (`close`), on an
    input of the stream's size: I4's module, which I4 checked on the last block's stream."""
    for mod, arg, out in tail:
        if arg.numel() == post.numel() and close(out, final):
            return mod
    return None
