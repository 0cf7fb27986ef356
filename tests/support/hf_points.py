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

# family -> point -> (module path under the decoder layer with {L} for its index, "in" | "out").
# "in": the module's first positional (or hidden_states) input; "out": its output (first of a
# tuple). resid_mid is the input of the norm that starts the MLP branch.
_LLAMA = {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
          "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
          "mlp_act": ("mlp.down_proj", "in")}
_SANDWICH = {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
             "attn_out_post": ("post_attention_layernorm", "out"),
             "resid_mid": ("pre_feedforward_layernorm", "in"), "mlp_in": ("mlp", "in"),
             "mlp_act": ("mlp.down_proj", "in"),
             "mlp_out_post": ("post_feedforward_layernorm", "out")}
SITES = {
    "llama": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "mistral": _LLAMA, "granite": _LLAMA,
    "phi3": _LLAMA,  # fused gate_up_proj in HF too: down_proj's input is still mlp_act
    "gemma2": _SANDWICH, "gemma3_text": _SANDWICH,
    "olmo2": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
              "attn_out_post": ("post_attention_layernorm", "out"),
              "resid_mid": ("mlp", "in"), "mlp_in": ("mlp", "in"),
              "mlp_act": ("mlp.down_proj", "in"),
              "mlp_out_post": ("post_feedforward_layernorm", "out")},
    "gpt2": {"attn_in": ("attn", "in"), "z": ("attn.c_proj", "in"), "resid_mid": ("ln_2", "in"),
             "mlp_in": ("mlp", "in"), "mlp_act": ("mlp.c_proj", "in")},
    "starcoder2": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                   "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                   "mlp_act": ("mlp.c_proj", "in")},
    "qwen3_moe": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                  "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                  "router_logits": ("mlp.gate", "out")},
    "mixtral": {"attn_in": ("self_attn", "in"), "z": ("self_attn.o_proj", "in"),
                "resid_mid": ("post_attention_layernorm", "in"), "mlp_in": ("mlp", "in"),
                "router_logits": ("mlp.gate", "out")},
}


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
            seen, handles = {}, []
            for p in job["points"]:
                name, L = p.rsplit(".", 1)
                path, how = sites[name]
                mod = layers[int(L)].get_submodule(path)
                if how == "in":
                    def hook(m, args, kwargs, p=p, seen=seen):
                        x = args[0] if args else kwargs["hidden_states"]
                        seen[p] = x.detach().float().reshape(-1, x.shape[-1]).clone()
                    handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
                else:
                    def hook(m, args, out, p=p, seen=seen):
                        x = out[0] if isinstance(out, tuple) else out
                        seen[p] = x.detach().float().reshape(-1, x.shape[-1]).clone()
                    handles.append(mod.register_forward_hook(hook))
            with torch.inference_mode():
                model(torch.tensor([toks]))
            for h in handles:
                h.remove()
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
