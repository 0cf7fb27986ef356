"""gpu_torch_check part 1: harvest's freeze taps inside a torch.compile'd trunk replayed as CUDA graphs.

What vLLM does on a GPU, rebuilt from torch alone (the GPU host has no vLLM): the taps are
installed by `taps.install_freeze` on the decoder layers *before* the model is compiled (the
runner's `load_model` order), the trunk is compiled once with dynamic shapes (inductor,
fullgraph), and one `torch.cuda.CUDAGraph` is captured per batch shape from that compiled callable
with static inputs, as vLLM captures one graph per capture size. Replays change the inputs in
place. For every replay, every tapped row (all points, real rows only) is compared with an eager
reference taken by harvest's hooked mode (`taps.install_hooks`: Python forward hooks, which never
run on the compiled path) on the same model and inputs:

- NaN-poisoned tap buffer before each replay: a row a tap did not write stays NaN and fails;
- relative error per row <= TOL (0.03) against the eager rows (compiled kernels round differently from
  eager bf16 ones, so "equal" means within bf16 rounding, not bitwise), while the same rows
  against the *previous* input's reference are ~1 apart: a stale row (a graph that kept reading
  its capture-time input, a tap that wrote a capture-time copy) cannot pass;
- bitwise comparison with the same compiled callable run without the graph (the same kernels):
  reported, not gated (a nondeterministic kernel would differ without anything being wrong).

The step-time overhead of the taps is measured side by side in one run: the same trunk compiled
and captured without taps (before the taps are installed) and with them, replays alternated.

On CPU (the dry mode) the same compile and comparisons run on a tiny trunk, called through the
compiled callable directly; CUDA graphs are reported as "skipped: needs CUDA".
"""

from __future__ import annotations

import time

import torch

NEEDS_CUDA = "skipped: needs CUDA"
# Max relative error per row, compiled vs eager bf16: inductor fuses ops and rounds once where
# eager rounds after each op (measured on CPU, tiny trunk: <= 0.016, mlp_out the worst). A stale
# row (another input's) is ~0.7-1.4 away; STALE_MIN keeps the two apart by a wide margin.
TOL = 0.03
STALE_MIN = 0.2

# A Llama-8B-shaped layer (width 4096, MLP 14336, GQA 32/8), 6 of them + embeddings = 1.44 B
# parameters in the trunk: the 8B per-layer work and tap width, with compile time kept in budget.
GPU_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=6,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32768)
DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
# (sequences, tokens), up to 8,192 rows. No 1-sequence batch: dynamic=True still specialises a
# size of 1, which would cost a second compile.
GPU_BATCHES = [(2, 256), (4, 512), (2, 2048), (8, 1024)]
DRY_BATCHES = [(2, 16), (3, 24), (4, 8)]


def build_trunk(shape: dict, device: torch.device):
    """A random-init Llama trunk (LlamaModel: no LM head) in bf16, from a config, no download."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(max_position_embeddings=4096, attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg)
    return model.to(torch.bfloat16).eval(), cfg


def tap_points(n_layers: int):
    """resid_post at every layer, plus one of each other kind (resid_pre, attn_out, mlp_out)."""
    from ...engine.addresses import Address

    mid = n_layers // 2
    return tuple(Address("resid_post", i) for i in range(n_layers)) + (
        Address("resid_pre", 0), Address("attn_out", mid), Address("mlp_out", mid))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ||a - b|| / ||b|| in fp32; NaN rows (never written) give NaN, which fails a <= test."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


class Variant:
    """One compiled trunk and, on CUDA, one captured graph per batch shape (static input ids)."""

    def __init__(self, forward, batches, device, pool=None):
        # inductor on CUDA (Triton, what the GPU run measures); on CPU (the dry mode) dynamo and
        # AOTAutograd trace the same taps (the mutating custom op functionalised, fullgraph) but
        # skip inductor's C++ codegen, which no GPU run uses and vLLM's CPU tests already cover
        # (it cost the dry run ~16 s with a cold cache)
        self.fn = torch.compile(forward, dynamic=True, fullgraph=True,
                                backend="inductor" if device.type == "cuda" else "aot_eager")
        self.device, self.graphs, self.static = device, {}, {}
        for b in batches:
            ids = torch.zeros(b, dtype=torch.long, device=device)
            self.static[b] = ids
            self.fn(ids)                                          # compile (first shape) / warm
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):                         # warm-up off the default stream
                for b in batches:
                    for _ in range(2):
                        self.fn(self.static[b])
            torch.cuda.current_stream(device).wait_stream(side)
            for b in batches:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.fn(self.static[b])
                self.graphs[b] = g
                pool = g.pool()
        self.pool = pool

    def run(self, b, ids: torch.Tensor, graph: bool = True) -> None:
        self.static[b].copy_(ids)
        if graph and self.graphs:
            self.graphs[b].replay()
        else:
            self.fn(self.static[b])


def _eager_rows(model, trunk, points, ids, width):
    """The hooked-mode reference: forward hooks fill their own buffer on an eager forward."""
    from ...engine.capture import taps as tapmod

    n = ids.numel()
    ref = tapmod.TapSet(points, (), torch.full((len(points), n, width), float("nan"),
                                               dtype=torch.bfloat16, device=ids.device), {}, width)
    handles = tapmod.install_hooks(trunk, ref)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return ref.buf


def _time_alternating(variants, batches, device, reps: int) -> dict:
    """Median step ms per variant per shape, replays alternated (same clocks, same heat)."""
    out = {}
    for b in batches:
        ids = torch.randint(3, 500, b, device=device)
        times = {k: [] for k in variants}
        for _ in range(reps):
            for k, v in variants.items():
                _sync(device)
                t = time.perf_counter()
                v.run(b, ids)
                _sync(device)
                times[k].append((time.perf_counter() - t) * 1e3)
        out[f"{b[0]}x{b[1]}"] = {k: round(sorted(t)[len(t) // 2], 3) for k, t in times.items()}
    return out


def run(dry: bool, replays: int = 6, reps: int = 20) -> dict:
    # one inference-mode region: tensors made inside it (the tap buffer) are inference tensors,
    # which cannot be written in place outside it
    with torch.inference_mode():
        return _run(dry, replays, reps)


def _run(dry: bool, replays: int, reps: int) -> dict:
    from ...engine.capture import block_stream
    from ...engine.capture import taps as tapmod
    from ...engine.addresses import FreezeSet

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    shape, batches = (GPU_SHAPE, GPU_BATCHES) if cuda else (DRY_SHAPE, DRY_BATCHES)
    t0 = time.perf_counter()
    model, cfg = build_trunk(shape, device)
    params = sum(p.numel() for p in model.parameters())
    W, L = cfg.hidden_size, cfg.num_hidden_layers
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "params": params,
           "layers": L, "width": W, "batches": [list(b) for b in batches], "tol": TOL,
           "cuda_graphs": "explicit torch.cuda.CUDAGraph per shape" if cuda else NEEDS_CUDA}
    t = time.perf_counter()
    # Two `def`s, two code objects: dynamo caches compiled code per code object, and one
    # shared function would let the tapped variant hit the plain variant's cache entry.
    def plain_forward(ids):
        return model(input_ids=ids, use_cache=False).last_hidden_state

    def tapped_forward(ids):
        return model(input_ids=ids, use_cache=False).last_hidden_state

    plain = Variant(plain_forward, batches, device)
    out["compile_plain_s"] = round(time.perf_counter() - t, 1)
    if not cuda:  # without graphs the plain callable re-traces once taps exist: time it now
        plain_times = _time_alternating({"plain": plain}, batches, device, reps)
    layers = tapmod.find_layers(model, L)
    trunk = block_stream.Trunk(layers, [block_stream.hf_semantics(x) for x in layers])
    points = tap_points(L)
    max_tokens = max(b[0] * b[1] for b in batches)
    ts = tapmod.allocate(FreezeSet(points, ()), max_tokens, W, torch.bfloat16, device)
    tapmod.install_freeze(trunk, ts)       # before the compile, as the vLLM runner does
    t = time.perf_counter()
    tapped = Variant(tapped_forward, batches, device, pool=plain.pool)
    out["compile_tapped_s"] = round(time.perf_counter() - t, 1)

    worst = [0.0] * len(points)
    min_stale, checked, bitwise, n_bitwise = float("inf"), 0, 0, 0
    failures: list[str] = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    for r in range(replays):
        for b in batches:
            ids = torch.randint(3, cfg.vocab_size - 3, b, generator=gen).to(device)
            n = ids.numel()
            ts.buf.fill_(float("nan"))
            tapped.run(b, ids)
            _sync(device)
            got = ts.buf[:, :n].clone()
            ref = _eager_rows(model, trunk, points, ids, W)
            err = _rel_err(got, ref)                             # [P, n]
            # a NaN row (never written) counts as an infinite error
            per_point = torch.nan_to_num(err, nan=float("inf")).max(dim=1).values.tolist()
            worst = [max(w, e) for w, e in zip(worst, per_point)]
            if not bool((err <= TOL).all()):
                bad = (~(err <= TOL)).nonzero()[0].tolist()
                failures.append(f"replay {r} shape {b}: {points[bad[0]]} row {bad[1]} rel err "
                                f"{float(err[bad[0], bad[1]]):.4g} > {TOL}")
            # the rows against another input's reference: what a stale row would score (ids + 1:
            # every position differs, so no row of `other` can coincide with one of `ids`)
            other = ids + 1
            min_stale = min(min_stale, float(_rel_err(got, _eager_rows(model, trunk, points,
                                                                       other, W)).min()))
            if cuda:  # same kernels without the graph: bitwise equal expected, reported
                ts.buf.fill_(float("nan"))
                tapped.run(b, ids, graph=False)
                _sync(device)
                n_bitwise += 1
                bitwise += int(torch.equal(got.view(torch.int16), ts.buf[:, :n].view(torch.int16)))
            checked += 1
    timing = _time_alternating({"plain": plain, "tapped": tapped} if cuda else
                               {"tapped": tapped}, batches, device, reps)
    if not cuda:
        for k, v in plain_times.items():
            timing[k].update(v)
    overhead = {k: round(v["tapped"] / v["plain"] - 1, 4) for k, v in timing.items()}
    out.update(points=[str(p) for p in points], replays=checked,
               worst_rel_err={str(p): round(w, 5) if w < float("inf") else "NaN: row not written"
                              for p, w in zip(points, worst)},
               min_rel_dist_to_other_input=round(min_stale, 3),
               step_ms=timing, tap_overhead=overhead,
               overhead_note="alternated replays in one run" if cuda else
               "CPU, compiled without graphs, timed one after the other: not a GPU figure",
               failures=failures[:10], seconds=round(time.perf_counter() - t0, 1))
    if cuda:
        out["graph_vs_no_graph_bitwise"] = f"{bitwise}/{n_bitwise}"
    else:
        out["graph_vs_no_graph_bitwise"] = NEEDS_CUDA
    out["ok"] = not failures and min_stale > STALE_MIN and checked == replays * len(batches)
    return out
