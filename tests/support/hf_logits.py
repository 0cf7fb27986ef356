"""An independent Hugging Face reference of logprob/entropy (engine/capture/scores.py), written
from the definitions and not from the engine's code: `logits = model(ids).logits` (Hugging Face
applies a configured final softcapping in its forward), `log_softmax`, the next token's entry
gathered, `entropy = -(p * log p).sum()`; a prompt's last position has no next token (NaN).

Run in a subprocess (`references`), before or beside engines: once vLLM loads some families
through its Transformers backend, their classes are patched in the loading process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


@torch.inference_mode()
def scores_of(model, toks: list[int]) -> dict:
    ids = torch.tensor([toks])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    lp = torch.full((len(toks),), float("nan"))
    if len(toks) > 1:
        lp[:-1] = logp[torch.arange(len(toks) - 1), ids[0, 1:]]
    return {"logprob": lp, "entropy": ent}


def references(jobs: list[dict]) -> list[list[dict]]:
    """jobs: [{path, tokens, dtype}] -> per job, per prompt, {"logprob": [n], "entropy": [n]}."""
    return in_subprocess("tests.support.hf_logits", jobs, "logits")


def in_subprocess(module: str, jobs: list[dict], what: str):
    """`python -m module JOBS OUT` on `jobs` (a module whose main is `run_jobs`), its result."""
    with tempfile.TemporaryDirectory(prefix=f"harvest-{what}-") as d:
        spec, out = Path(d) / "jobs.json", Path(d) / "ref.pt"
        spec.write_text(json.dumps(jobs))
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", module, str(spec), str(out)],
                              env=env, capture_output=True, text=True, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"the Hugging Face {what} reference failed:\n{proc.stderr[-4000:]}")
        return torch.load(out)


def run_jobs(spec: str, out: str, per_prompt) -> None:
    """Each job's model (path, dtype) loaded in turn, `per_prompt(model, tokens)` of each prompt."""
    from transformers import AutoModelForCausalLM

    results = []
    for job in json.loads(Path(spec).read_text()):
        model = AutoModelForCausalLM.from_pretrained(job["path"],
                                                     dtype=getattr(torch, job["dtype"])).eval()
        results.append([per_prompt(model, t) for t in job["tokens"]])
    torch.save(results, out)


if __name__ == "__main__":
    run_jobs(sys.argv[1], sys.argv[2], scores_of)
