"""An independent Hugging Face float32 reference for the module-site points (engine/points.py):
plain forward hooks at the module names the field notes give per family, written out here by
hand and sharing no code with engine/capture/sites.py, so a wrong site rule there cannot agree with
itself.

Run in a subprocess (`references(jobs)`): once vLLM's Transformers backend has loaded a family,
its HF classes are patched in-process. Each job: {path, family, tokens, points, dtype?
(float32)}; each result: per prompt
{point: float32 [n, width]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# family -> point -> (module path under the decoder layer, how). how:
# - "in": the module's first positional (or hidden_states) input; "out": its output (first of a
#   tuple); "out/i/k": the i-th of k equal column blocks of its output (GPT-2's c_attn is
#   [q | k | v]; a fused gate_up_proj [gate | up]);
# - "rope/q", "rope/k": what the family's own `apply_rotary_pos_emb` (looked up in the
#   attention module's modeling file) returns for this layer's attention module, heads
#   concatenated: the query and key after the rotary embedding (and after QK-norm, which HF
#   applies before it).
# resid_mid is the input of the norm that starts the MLP branch; v is v_proj's output.
_QKV = {"q": ("self_attn", "rope/q"), "k": ("self_attn", "rope/k"), "v": ("self_attn.v_proj", "out")}
_GATED = {"mlp_pre": ("mlp.gate_proj", "out"), "mlp_pre_linear": ("mlp.up_proj", "out")}
_LLAMA = {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
          "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
          "mlp_act": ("mlp.down_proj", "in"), **_QKV, **_GATED}
_SANDWICH = {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
             "attn_out_post": ("post_attention_layernorm", "out"),
             "resid_mid": ("pre_feedforward_layernorm", "in"), "mlp_in": ("mlp", "in"),
             "mlp_act": ("mlp.down_proj", "in"),
             "mlp_out_post": ("post_feedforward_layernorm", "out"), **_QKV, **_GATED}
SITES = {
    "llama": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "mistral": _LLAMA, "granite": _LLAMA,
    # fused qkv_proj and gate_up_proj in HF too: down_proj's input is still mlp_act; the tiny
    # Phi-3's qkv_proj is [q: 2 heads | k: 1 | v: 1] of 64, so v is its last quarter
    "phi3": {**_LLAMA, "v": ("self_attn.qkv_proj", "out/3/4"),
             "mlp_pre": ("mlp.gate_up_proj", "out/0/2"),
             "mlp_pre_linear": ("mlp.gate_up_proj", "out/1/2")},
    "gemma2": _SANDWICH, "gemma3_text": _SANDWICH,
    # vLLM runs OLMo-2 and Starcoder2 through its Transformers backend, whose attention kernel
    # (`self_attn.attn`) gets the Hugging Face module's own post-rotary q, k, v
    "olmo2": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
              "attn_out_post": ("post_attention_layernorm", "out"),
              "resid_mid": ("mlp", "in"), "mlp_in": ("mlp", "in"),
              "mlp_act": ("mlp.down_proj", "in"),
              "mlp_out_post": ("post_feedforward_layernorm", "out"), **_QKV, **_GATED},
    "gpt2": {"attn_in": ("attn", "in"), "z": ("attn.c_proj", "in"), "resid_mid": ("ln_2", "in"),
             "mlp_in": ("mlp", "in"), "mlp_act": ("mlp.c_proj", "in"),
             "q": ("attn.c_attn", "out/0/3"), "k": ("attn.c_attn", "out/1/3"),
             "v": ("attn.c_attn", "out/2/3"), "mlp_pre": ("mlp.c_fc", "out")},
    "starcoder2": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                   "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                   "mlp_act": ("mlp.c_proj", "in"), "mlp_pre": ("mlp.c_fc", "out"), **_QKV},
    "qwen3_moe": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                  "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                  "router_logits": ("mlp.gate", "out"), **_QKV},
    "mixtral": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                "router_logits": ("mlp.gate", "out"), **_QKV},
}


def _rows(x):
    return x.detach().float().reshape(-1, x.shape[-1]).clone()


class _Rope:
    """Records what the family's `apply_rotary_pos_emb` returns, per attention module: the
    module's forward hooks say whose calls happen in between (no other module's). The function
    is replaced in the modeling module for the duration (the forward looks the name up at call
    time)."""

    def __init__(self, attn_modules: dict, seen: dict):
        import sys

        self.seen, self.current, self.handles, self.patched = seen, [{}], [], {}
        for mod, points in attn_modules.items():
            def pre(m, args, points=points):
                self.current[0] = points

            def post(m, args, out):
                self.current[0] = {}
            self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
            where = sys.modules[type(mod).__module__]
            if where not in self.patched:
                self.patched[where] = real = where.apply_rotary_pos_emb

                def rope(q, k, *args, real=real, **kwargs):
                    qe, ke = real(q, k, *args, **kwargs)
                    for which, t in (("q", qe), ("k", ke)):  # [batch, heads, tokens, head_dim]
                        if which in self.current[0]:
                            self.seen[self.current[0][which]] = _rows(t.transpose(1, 2).flatten(2))
                    return qe, ke
                where.apply_rotary_pos_emb = rope

    def remove(self):
        for h in self.handles:
            h.remove()
        for where, real in self.patched.items():
            where.apply_rotary_pos_emb = real


def _main(spec_path: str, out_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    results = []
    for job in spec["jobs"]:
        dtype = getattr(torch, job.get("dtype", "float32"))
        model = AutoModelForCausalLM.from_pretrained(job["path"], dtype=dtype).eval()
        layers = next(m for n, m in model.named_modules()
                      if n.endswith(("model.layers", "transformer.h")))
        sites = SITES[job["family"]]
        got = []
        for toks in job["tokens"]:
            seen, handles, rope = {}, [], {}
            for p in job["points"]:
                name, L = p.rsplit(".", 1)
                path, how = sites[name]
                mod = layers[int(L)].get_submodule(path)
                if how == "in":
                    def hook(m, args, kwargs, p=p, seen=seen):
                        x = args[0] if args else kwargs["hidden_states"]
                        seen[p] = _rows(x)
                    handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
                elif how.startswith("rope/"):
                    rope.setdefault(mod, {})[how[5:]] = p
                else:
                    def hook(m, args, out, p=p, seen=seen, how=how):
                        x = out[0] if isinstance(out, tuple) else out
                        if how != "out":  # out/i/k: the i-th of k column blocks
                            i, k = map(int, how.split("/")[1:])
                            w = x.shape[-1] // k
                            x = x[..., i * w:(i + 1) * w]
                        seen[p] = _rows(x)
                    handles.append(mod.register_forward_hook(hook))
            if rope:
                handles.append(_Rope(rope, seen))
            with torch.inference_mode():
                model(torch.tensor([toks]))
            for h in handles:
                h.remove()
            assert set(seen) == set(job["points"]), set(job["points"]) - set(seen)
            got.append(seen)
        results.append(got)
    torch.save(results, out_path)


def references(jobs: list[dict]) -> list[list[dict]]:
    import torch

    with tempfile.TemporaryDirectory(prefix="harvest-points-") as d:
        spec, out = Path(d) / "jobs.json", Path(d) / "ref.pt"
        spec.write_text(json.dumps({"jobs": jobs}))
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", "tests.support.hf_points", str(spec),
                               str(out)], env=env, capture_output=True, text=True, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"the Hugging Face point reference failed:\n{proc.stderr[-4000:]}")
        return torch.load(out)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
