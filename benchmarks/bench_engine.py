"""Engine throughput, every mode on the same prompts in one invocation, as ratios to plain vLLM.

Capture tok/s counts only rows delivered to the caller in host memory, every layer, aligned to
their request: each mode's timed loop ends with every request's `[layers, n, width]` rows in hand.
Plain vLLM runs first and last; each mode's ratio uses the mean of the plain runs next to it, so
drift on a noisy machine shows up as a gap between plain runs rather than as a fake speed-up.
`--rounds N` alternates the modes N times (plain, freeze, plain, freeze, ..., plain) and reports
the median of the paired ratios: the figure for the freeze target (>= 0.95x plain).

    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.bench_engine \
        [--model PATH] [--prompts 32] [--len 256] [--modes plain freeze] [--rounds 3] [--tp 1 2]

Freeze delivers into one destination block reused by every pass, as the pipeline's writers
reuse their block buffers (at TP > 1 the block is in the engine's shared arena, so the rank
writes the rows in place: engine/capture/shmdest.py); fresh memory per pass would time page faults.

`--tp 1 2` runs plain and freeze at each tensor-parallel size (TP > 1: vLLM's multiprocessing
executor) and reports host memory (PSS of this process and the rank processes it started)
beside tok/s, the all-reduce fusion each engine resolved, and for TP > 1 freeze where the rows'
path spent its time (`ring`, `rows_placed`, `rows_copied`). `--modes plain_nofuse freeze` adds
plain vLLM with capture's compile settings (fusion off) at TP > 1: on GPUs where vLLM fuses the
all-reduce, it separates that cost from the taps'.

`--modes freeze_transcoder` captures mlp_in and mlp_out at every layer (twice the rows of
freeze's resid_post; a cross-layer transcoder's training pairs). Target: >= 0.9x plain.
`--modes freeze freeze_scores` adds logprob.0 and entropy.0 to freeze's points (the final logits of
every row, engine/capture/scores.py); its cost is freeze_scores' ratio against freeze's.
`--modes freeze freeze_routing` (a MoE model) adds expert_indices and expert_weights at every layer
to freeze's resid_post (the router's top-k choice, docs/engine.md "MoE routing"); its cost is
freeze_routing's ratio against freeze's. Target: >= 0.95x freeze. `--interleave PAIRS` with two
freeze modes loads both engines side by side (a process each) and alternates their passes, so
each pair meets the same load: the steady figure for one mode's cost over another's on a box
whose load swings.

`--runners v1 v2` runs the whole schedule on each of vLLM's model runners in turn (ratios paired
within a runner; default: the one vLLM picks, `auto`). On a CPU build V2 runs its kernels in
Triton's interpreter (testing/triton_interpreter.py), which costs both plain and freeze the same
fixed time per step, so the ratio still compares the taps; it needs `TRITON_INTERPRET=1` in the
environment from the start (the process imports triton early).

`--generate N` measures generation instead (engine/vllm/generate.py): every prompt completed with N
new tokens (greedy, no stop: the same work in every mode), tok/s = generated tokens per second;
plain is plain vLLM generating, freeze generates with every layer's rows (prompt and decode)
delivered. Target: freeze >= 0.9x plain.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


# CPU seconds of this process in the best pass of the last _timed_capture: at TP=1 the engine
# core runs here (in-process), so it is the engine's work, far steadier than wall time on a
# loaded box (other processes take wall time, not this process's CPU time)
LAST_CPU: dict[str, "float | None"] = {"seconds": None}


def _timed_capture(model, prompts, points, repeats: int, destinations=None) -> tuple[float, int]:
    """Best of `repeats` passes (the first pass also warms caches)."""
    best = best_cpu = float("inf")
    rows = 0
    for i in range(repeats + 1):
        t, c = time.perf_counter(), time.process_time()
        rows = 0
        for req in model.capture([prompts], points, destinations=destinations):
            assert req.acts.shape[0] == len(points or ()) or not points
            rows += len(req)
        best = min(best, time.perf_counter() - t)
        if i:   # the first pass warms caches
            best_cpu = min(best_cpu, time.process_time() - c)
    LAST_CPU["seconds"] = best_cpu if repeats else None
    return best, rows


def host_memory_mb() -> tuple[float, float]:
    """(this process and every process it started, those started processes alone): proportional
    set size in MB, shared pages split fairly. The second is a TP engine's rank processes; the
    first also holds whatever earlier modes of this invocation left in this process (RSS rarely
    shrinks after an engine closes), so compare the rank figures across TP sizes."""
    import psutil

    me = psutil.Process()
    own = kids = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            pss = p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        own += pss if p.pid == me.pid else 0
        kids += pss if p.pid != me.pid else 0
    return (own + kids) / 1e6, kids / 1e6


def _timed_generate(model, prompts, points, repeats: int, new_tokens: int) -> tuple[float, int]:
    """Best of `repeats` generation passes; returns (seconds, rows delivered)."""
    from ..engine import GenerateParams

    gp = GenerateParams(max_new_tokens=new_tokens, temperature=0.0, stop_at_eos=False)
    best, rows = float("inf"), 0
    for _ in range(repeats + 1):
        t = time.perf_counter()
        rows = 0
        for req in model.generate([prompts], points, gp):
            assert len(req.generated) == new_tokens
            rows += len(req) if points is None or points else 0
        best = min(best, time.perf_counter() - t)
    return best, rows


def _same_engine_generate(path, prompts, rounds: int, max_batched: int, generate: int) -> dict:
    """One freeze engine generating the same prompts with every layer captured and with nothing
    captured (taps still in the graph), alternated `rounds` times in one process: the capture's
    own cost (copies, row checks) without engine reloads between the two, which on a loaded
    machine move the plain-vs-freeze pairs by more than the difference they measure."""
    from ..engine import load_model

    m = load_model(path, backend="vllm", freeze_points="auto", freeze_writes=[],
                   max_num_batched_tokens=max_batched)
    ratios, best = [], {"captured": 0.0, "uncaptured": 0.0}
    try:
        _timed_generate(m, prompts, [], 0, generate)  # warm-up
        for _ in range(rounds):
            cap, _ = _timed_generate(m, prompts, None, 0, generate)
            off, _ = _timed_generate(m, prompts, [], 0, generate)
            ratios.append(off / cap)
            best = {"captured": max(best["captured"], 1 / cap), "uncaptured": max(best["uncaptured"], 1 / off)}
    finally:
        m.close()
    tokens = len(prompts) * generate
    ratios.sort()
    return {"mode": "freeze_same_engine", "tok_s": tokens * best["captured"],
            "uncaptured_tok_s": tokens * best["uncaptured"], "rounds": rounds,
            "ratio_to_uncaptured": ratios[len(ratios) // 2], "ratios": [round(r, 3) for r in ratios],
            "layers": "all"}


def writer_destinations(model, prompts):
    """Where a freeze capture's rows go, as in the pipeline: one block [points, all tokens,
    width] reused by every pass, like the writers' pooled block buffers; at TP > 1 it comes from
    the engine's shared arena, so the rank writes rows in place (engine/capture/shmdest.py). Fresh
    tensors per request would time first-touch page faults, which the pipeline does not pay."""
    import numpy as np

    alloc = model.shared_allocator() or (lambda shape, dtype: np.empty(shape, dtype))
    raw = {2: np.int16, 4: np.int32}[torch.empty(0, dtype=model.dtype).element_size()]
    offs = np.cumsum([0, *map(len, prompts)]).tolist()
    block = alloc((len(model.frozen.reads), offs[-1], model.width), raw)
    view = torch.from_numpy(block).view(model.dtype)
    view.zero_()  # touch every page once, before timing
    return lambda i, n: view[:, offs[i]:offs[i] + n]


FREEZE_MODES = ("freeze", "freeze_transcoder", "freeze_scores", "freeze_routing")


def _freeze_points(path: str, mode: str) -> "str | list[str]":
    """The frozen reads of a freeze mode (FREEZE_MODES)."""
    if mode == "freeze":
        return "auto"
    from ..engine.checkpoint import read_model_info

    n = read_model_info(path).n_layers
    if mode == "freeze_transcoder":  # a (cross-layer) transcoder's pair at every layer
        return [f"{p}.{i}" for i in range(n) for p in ("mlp_in", "mlp_out")]
    if mode == "freeze_scores":   # freeze's rows plus the model's next-token scores
        return [f"resid_post.{i}" for i in range(n)] + ["logprob.0", "entropy.0"]
    if mode == "freeze_routing":   # freeze's rows plus the MoE routing at every layer
        return [f"{p}.{i}" for i in range(n)
                for p in ("resid_post", "expert_indices", "expert_weights")]
    raise ValueError(mode)


def _pass_server(conn, path: str, mode: str, prompts, max_batched: int) -> None:
    """One engine of `interleaved`, in its own process: loads, says "ready", then times one
    capture pass per "pass" it is sent (wall and this process's CPU seconds) until "stop"."""
    from ..engine import load_model

    m = load_model(path, backend="vllm", freeze_points=_freeze_points(path, mode),
                   freeze_writes=[], max_num_batched_tokens=max_batched)
    try:
        dests = writer_destinations(m, prompts)
        conn.send("ready")
        while conn.recv() == "pass":
            t, c = time.perf_counter(), time.process_time()
            for _ in m.capture([prompts], None, destinations=dests):
                pass
            conn.send((time.perf_counter() - t, time.process_time() - c))
    finally:
        m.close()


def interleaved(path: str, prompts, modes=("freeze", "freeze_routing"), pairs: int = 20,
                max_batched: int = 2048) -> dict:
    """Two freeze modes' engines loaded side by side (one process each, loaded one after the
    other) and their capture passes alternated A B B A ..., so each pair of passes meets the same
    load: the median of the pairs' time ratios is the cost of the second mode's points over the
    first's, steady on a box whose load swings (separate engines run minutes apart are not)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ends = []   # by position: `--modes freeze freeze` is the A/A control of the method
    procs = []
    try:
        for mode in modes:
            here, there = ctx.Pipe()
            p = ctx.Process(target=_pass_server, args=(there, path, mode, prompts, max_batched))
            p.start()
            procs.append(p)
            if here.recv() != "ready":
                raise RuntimeError(f"{mode}: the engine did not start")
            ends.append(here)

        def one(i):
            ends[i].send("pass")
            return ends[i].recv()

        for i in (0, 1):   # a warm-up pass each
            one(i)
        wall, cpu = [], []
        for k in range(pairs):
            order = (0, 1) if k % 2 == 0 else (1, 0)
            got = {i: one(i) for i in order}
            wall.append(got[0][0] / got[1][0])
            cpu.append(got[0][1] / got[1][1])
        for end in ends:
            end.send("stop")
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.terminate()
    return {"modes": list(modes), "pairs": pairs, "wall_ratio": _median(wall),
            "cpu_ratio": _median(cpu), "wall_ratios": [round(x, 3) for x in wall]}


def _vllm_mode(path, prompts, repeats, mode, max_batched, tp: int = 1, generate: int = 0):
    from ..engine import load_model
    from ..engine.vllm import compat

    kw = dict(max_num_batched_tokens=max_batched)
    if tp > 1:
        kw["tensor_parallel_size"] = tp
    dests = None
    if mode in ("plain", "plain_nofuse"):
        if mode == "plain_nofuse":  # plain with capture's compile settings (fusion off)
            kw["compilation_config"] = compat.tp_compilation_config(None)
        m = load_model(path, backend="vllm", freeze_points=[], **kw)
        points = []
    elif mode in FREEZE_MODES:
        m = load_model(path, backend="vllm", freeze_points=_freeze_points(path, mode),
                       freeze_writes=[], **kw)
        points = None
        if not generate:
            dests = writer_destinations(m, prompts)
    else:
        m = load_model(path, backend="vllm", enforce_eager=True, **kw)
        points = [f"resid_post.{i}" for i in range(m.n_layers)]
    try:
        if generate:
            secs, rows = _timed_generate(m, prompts, points, repeats, generate)
        else:
            secs, rows = _timed_capture(m, prompts, points, repeats, dests)
        mem = host_memory_mb()
        extra = {"fuse_allreduce_rms": compat.engine_settings(m.llm).get("fuse_allreduce_rms")}
        if tp == 1 and not generate:
            extra["cpu_seconds"] = LAST_CPU["seconds"]
        if tp > 1 and mode == "freeze":
            s = m.state.summary()  # where the rows' path spent its time (engine/vllm/remote.py)
            extra.update(rows_placed=s["rows_placed"], rows_copied=s["rows_copied"],
                         ring=s["ring"])
    finally:
        m.close()
    return secs, rows, mem, extra


VLLM_MODES = ("plain", "plain_nofuse", "freeze", "hooked", "freeze_transcoder", "freeze_scores",
              "freeze_routing")


def _runner(runner: str):
    """The model runner's context (testing/triton_interpreter.model_runner); `auto`: vLLM's pick."""
    import contextlib

    if runner == "auto":
        return contextlib.nullcontext()
    from ..testing.triton_interpreter import model_runner

    return model_runner(runner)


def _eager_mode(path, prompts, repeats):
    from ..engine import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    m = load_model(path, backend="eager", dtype="bfloat16", max_num_batched_tokens=4096)
    return _timed_capture(m, prompts, None, max(1, repeats - 1))


def _extract_hidden_states(path, prompts, repeats, n_layers):
    """vLLM's own extraction: speculative `extract_hidden_states` + a KV connector writing one
    safetensors file per request. Layer id L is the *input* of layer L (resid_post of L-1), so
    resid_post of every layer is ids 1..n. Its docs say chunked prefill must be off."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    longest = max(len(p) for p in prompts) + 1
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            model=path, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False,
            enable_chunked_prefill=False, max_model_len=longest, max_num_batched_tokens=max(longest, 2048),
            kv_cache_memory_bytes=512 << 20,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(range(1, n_layers + 1))}}},
            kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector",
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": tmp}})
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        best, rows = float("inf"), 0
        try:
            for _ in range(repeats + 1):
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                rows = 0
                for o in outs:
                    hs = load_hidden_states(o.kv_transfer_params["hidden_states_path"])["hidden_states"]
                    rows += hs.shape[0]
                best = min(best, time.perf_counter() - t)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return best, rows


def schedule(modes, rounds: int) -> list[str]:
    """plain first and last, the other modes alternating with plain runs `rounds` times."""
    others = [m for m in modes if m != "plain"]
    if rounds <= 1:
        return ["plain", *others, "plain"]
    out = ["plain"]
    for _ in range(rounds):
        for m in others:
            out += [m, "plain"]
    return out


def _group(r: dict) -> tuple:
    """Rows whose ratios pair with each other: the same TP size and model runner."""
    return r.get("tp", 1), r.get("runner", "auto")


def _paired_base(rows: list[dict], i: int) -> float | None:
    """Mean tok/s of the nearest plain runs (same TP size and runner) before and after row i
    (either one if only one)."""
    near = []
    g = _group(rows[i])
    for rng in (range(i - 1, -1, -1), range(i + 1, len(rows))):
        for j in rng:
            if rows[j]["mode"] == "plain" and _group(rows[j]) == g:
                if rows[j].get("tok_s"):
                    near.append(rows[j]["tok_s"])
                break
    return sum(near) / len(near) if near else None


def run(model: str | None = None, n_prompts: int = 32, prompt_len: int = 256, repeats: int = 2,
        max_batched: int = 2048, modes=("plain", "freeze", "hooked", "extract_hidden_states",
                                        "hf_eager"),
        prompts: list[list[int]] | None = None, rounds: int = 1, tps=(1,),
        generate: int = 0, runners=("auto",)) -> list[dict]:
    from ..engine.checkpoint import read_model_info
    from ..engine.models import smollm2_path

    path = model or smollm2_path()
    info = read_model_info(path)
    if prompts is None:
        prompts = make_prompts(n_prompts, prompt_len, info.vocab_size)
    # generation: the figure is generated tokens per second (every mode does the same work)
    tokens = len(prompts) * generate if generate else sum(len(p) for p in prompts)
    if generate:
        modes = [m for m in modes if m in ("plain", "freeze", "hooked")]
    rows_out: list[dict] = []
    # --tp 1 2: the whole schedule at each TP size in turn, ratios paired within a size
    # --runners v1 v2: and at each model runner; modes that use no capture runner run once
    plan = [(mode, tp, runner) for runner in runners for tp in tps
            for mode in schedule(modes, rounds)
            if (tp == 1 and mode != "plain_nofuse" or tp > 1 and mode in ("plain", "plain_nofuse",
                                                                          "freeze"))
            and (runner == runners[0] or mode in VLLM_MODES)]
    if any(r != "auto" for r in runners):
        from ..testing import triton_interpreter

        if "v2" in runners and triton_interpreter.needs_interpreter():
            triton_interpreter.prime()   # before any V1 engine (its docstring says why)
    for mode, tp, runner in plan:
        try:
            mem, extra = None, {}
            if mode in VLLM_MODES:
                with _runner(runner):
                    secs, rows, mem, extra = _vllm_mode(path, prompts, repeats, mode, max_batched,
                                                        tp, generate)
            elif mode == "hf_eager":
                secs, rows = _eager_mode(path, prompts, repeats)
            elif mode == "extract_hidden_states":
                secs, rows = _extract_hidden_states(path, prompts, repeats, info.n_layers)
            else:
                raise ValueError(mode)
            rows_out.append({"mode": mode, "tp": tp, "runner": runner, "tok_s": tokens / secs,
                             "seconds": secs,
                             "rows": rows, "layers": 0 if mode == "plain" else info.n_layers,
                             "host_mb": round(mem[0], 1) if mem else None,
                             "ranks_mb": round(mem[1], 1) if mem else None, **extra})
        except Exception as e:  # a mode this build cannot run is reported, not fatal
            rows_out.append({"mode": mode, "tp": tp, "runner": runner, "tok_s": None,
                             "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows_out[-1]), flush=True)
    if generate and "freeze" in modes:
        try:
            rows_out.append(_same_engine_generate(path, prompts, max(3, rounds * 2), max_batched,
                                                  generate))
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            rows_out.append({"mode": "freeze_same_engine", "tok_s": None,
                             "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows_out[-1]), flush=True)
    for i, r in enumerate(rows_out):
        if r["mode"] == "freeze_same_engine":
            r["ratio_to_plain"] = None  # its own ratio: ratio_to_uncaptured
            r.update(model=os.path.basename(path), tokens=tokens, task="generate")
            continue
        plain = [x["tok_s"] for x in rows_out
                 if x["mode"] == "plain" and x["tok_s"] and _group(x) == _group(r)]
        mean_plain = sum(plain) / len(plain) if plain else None
        base = mean_plain if r["mode"] == "plain" else _paired_base(rows_out, i)
        r["ratio_to_plain"] = (r["tok_s"] / base) if (base and r.get("tok_s")) else None
        r.update(model=os.path.basename(path), tokens=tokens, task="generate" if generate else "prefill",
                 device="cuda" if torch.cuda.is_available() else "cpu")
    return rows_out


def _median(xs: list) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1]
                                                                      + xs[len(xs) // 2]) / 2)


def median_ratio(rows: list[dict], mode: str, tp: int = 1, runner: str = "auto") -> float | None:
    vals = sorted(r["ratio_to_plain"] for r in rows if r["mode"] == mode
                  and _group(r) == (tp, runner) and r.get("ratio_to_plain"))
    if not vals:
        return None
    k = len(vals) // 2
    return vals[k] if len(vals) % 2 else (vals[k - 1] + vals[k]) / 2


def table(rows: list[dict]) -> str:
    lines = ["| mode | runner | TP | tok/s | × plain | layers captured | host MB (PSS) "
             "| rank processes MB | note |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tok = f"{r['tok_s']:.0f}" if r.get("tok_s") else "—"
        ratio = f"{r['ratio_to_plain']:.2f}" if r.get("ratio_to_plain") else "—"
        mem = f"{r['host_mb']:.0f}" if r.get("host_mb") else "—"
        ranks = f"{r['ranks_mb']:.0f}" if r.get("ranks_mb") else "—"
        lines.append(f"| {r['mode']} | {r.get('runner', 'auto')} | {r.get('tp', 1)} | {tok} "
                     f"| {ratio} | {r.get('layers', '')} "
                     f"| {mem} | {ranks} | {r.get('error', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or hub name (default: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", default=None,
                    help="modes besides plain (default: freeze hooked extract_hidden_states hf_eager)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the modes with plain N times")
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes, each running plain and freeze (e.g. --tp 1 2)")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="measure generation of N new tokens per prompt (plain vs freeze)")
    ap.add_argument("--interleave", type=int, default=0, metavar="PAIRS",
                    help="with two freeze modes (e.g. --modes freeze freeze_routing): load both "
                         "engines side by side and alternate their passes PAIRS times instead")
    ap.add_argument("--runners", nargs="+", default=["auto"], choices=("auto", "v1", "v2"),
                    help="vLLM model runners, the schedule on each (e.g. --runners v1 v2)")
    a = ap.parse_args()
    if a.interleave:
        modes = [m for m in (a.modes or ()) if m in FREEZE_MODES]
        if len(modes) != 2:
            ap.error("--interleave compares two freeze modes: e.g. --modes freeze freeze_routing")
        from ..engine.checkpoint import read_model_info
        from ..engine.models import smollm2_path

        path = a.model or smollm2_path()
        prompts = make_prompts(a.prompts, a.len, read_model_info(path).vocab_size)
        r = interleaved(path, prompts, tuple(modes), a.interleave, a.max_batched)
        print(json.dumps(r))
        print(f"prefill, interleaved: {modes[1]} / {modes[0]} throughput = {r['wall_ratio']:.3f} "
              f"(median of {r['pairs']} alternated pairs; by CPU seconds {r['cpu_ratio']:.3f})")
        print(f"load average at the end: {os.getloadavg()}")
        return
    kw = {"modes": a.modes} if a.modes else {}
    rows = run(a.model, a.prompts, a.len, a.repeats, a.max_batched, rounds=a.rounds,
               tps=tuple(a.tp), generate=a.generate, runners=tuple(a.runners), **kw)
    print(table(rows))
    target = 0.9 if a.generate else 0.95
    what = f"generation of {a.generate} tokens" if a.generate else "prefill"
    for runner in a.runners:
        for tp in a.tp:
            for mode, want in (("freeze", target), ("freeze_transcoder", 0.9)):
                ratio = median_ratio(rows, mode, tp, runner)
                if ratio is not None:
                    n = sum(1 for r in rows if r["mode"] == mode and _group(r) == (tp, runner)
                            and r.get("ratio_to_plain"))
                    print(f"{what}, runner {runner}, TP={tp}: {mode} / plain = {ratio:.3f} "
                          f"(median of {n} paired runs; target >= {want})")
            scored, frozen = (median_ratio(rows, "freeze_scores", tp, runner),
                              median_ratio(rows, "freeze", tp, runner))
            if scored is not None and frozen:
                print(f"{what}, runner {runner}, TP={tp}: freeze_scores / plain = {scored:.3f}, "
                      f"freeze_scores / freeze = {scored / frozen:.3f} (logprob + entropy's cost)")
            routed = median_ratio(rows, "freeze_routing", tp, runner)
            if routed is not None and frozen:
                print(f"{what}, runner {runner}, TP={tp}: freeze_routing / plain = {routed:.3f}, "
                      f"freeze_routing / freeze = {routed / frozen:.3f} (expert routing's cost; "
                      "target >= 0.95)")
            best = {m: min([r["seconds"] for r in rows if r["mode"] == m
                            and _group(r) == (tp, runner) and r.get("seconds")], default=None)
                    for m in ("freeze", "freeze_routing")}
            if best["freeze"] and best["freeze_routing"]:
                print(f"{what}, runner {runner}, TP={tp}: best pass of all rounds (the least "
                      f"disturbed by other load): freeze {best['freeze']:.3f} s, freeze_routing "
                      f"{best['freeze_routing']:.3f} s; freeze_routing / freeze = "
                      f"{best['freeze'] / best['freeze_routing']:.3f} (throughput)")
            cpu = {m: _median([r["cpu_seconds"] for r in rows if r["mode"] == m
                               and _group(r) == (tp, runner) and r.get("cpu_seconds")])
                   for m in ("plain", "freeze", "freeze_scores", "freeze_routing")}
            for m in ("freeze_scores", "freeze_routing"):
                if cpu[m] and cpu["freeze"]:
                    print(f"{what}, runner {runner}, TP={tp}: engine CPU seconds per pass (median "
                          f"of the best passes): plain {cpu['plain']:.3f}, freeze "
                          f"{cpu['freeze']:.3f}, {m} {cpu[m]:.3f}; freeze / {m} = "
                          f"{cpu['freeze'] / cpu[m]:.3f} (throughput by CPU time)")
    print(f"load average at the end: {os.getloadavg()}")
    same = next((r for r in rows if r["mode"] == "freeze_same_engine" and r.get("tok_s")), None)
    if same:
        print(f"{what}: one freeze engine, captured / uncaptured = {same['ratio_to_uncaptured']:.3f} "
              f"(median of {same['rounds']} alternations {same['ratios']})")


if __name__ == "__main__":
    main()
