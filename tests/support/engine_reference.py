"""Hugging Face reference activations for the engine tests (float32, one prompt at a time)."""

from __future__ import annotations

import random

import torch


def prompts(seed: int, lengths, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_hidden_states(path: str, toks: list[list[int]]):
    """Per prompt: (hidden_states tuple from output_hidden_states, final norm module, model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for t in toks:
        hs = model(torch.tensor([t]), output_hidden_states=True).hidden_states
        out.append([h[0] for h in hs])
    return out, model


def final_norm(model):
    base = getattr(model, "model", None) or getattr(model, "transformer")
    return getattr(base, "norm", None) or getattr(base, "ln_f")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm())


# bf16 keeps 8 significant bits (relative step 2^-8 ≈ 0.4%); a few layers of bf16 arithmetic
# against a float32 reference stay near 1%. A wrong row, layer or missing residual add is > 30%.
BF16_REL_TOL = 0.03
