"""An independent Hugging Face reference of MoE routing: each layer's router (`mlp.gate`, a
transformers top-k router returning (logits, top-k weights, top-k ids)) read by a plain forward
hook on the fp32 model, and the same router class applied to given logits (`router_rule`).
Nothing here is the engine's code.

`references` runs in a subprocess, as tests/support/hf_logits.py does (vLLM's Transformers
backend patches Hugging Face classes in the process that loads such a model).
"""

from __future__ import annotations

import copy
import importlib
import sys

import torch

from tests.support.hf_logits import in_subprocess, run_jobs


@torch.inference_mode()
def routing_of(model, toks: list[int]) -> list[dict]:
    """Per layer: {"logits" [n, E], "weights" [n, k], "ids" [n, k]} as the router returned them."""
    seen: dict[int, tuple] = {}
    handles = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, li=li: seen.__setitem__(li, out))
        for li, layer in enumerate(model.model.layers)]
    try:
        model(torch.tensor([toks]))
    finally:
        for h in handles:
            h.remove()
    return [{"logits": seen[li][0].float(), "weights": seen[li][1].float(), "ids": seen[li][2].long()}
            for li in range(len(model.model.layers))]


def references(jobs: list[dict]) -> list[list[list[dict]]]:
    """jobs: [{path, tokens, dtype}] -> per job, per prompt, per layer, routing_of's dict."""
    return in_subprocess("tests.support.hf_routing", jobs, "routing")


def router_rule(path: str):
    """Hugging Face's own router of the model at `path`, as a function of router logits
    `[n, E]` -> (weights [n, k], ids [n, k]): the model type's `*TopKRouter` class built with an
    identity gate, so its forward routes the logits it is given by its own rule (softmax,
    top-k, renormalisation where the config says so)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    mod = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("TopKRouter"))
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    c = copy.deepcopy(cfg)
    c.hidden_size = n_experts
    router = cls(c).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(n_experts))

    @torch.inference_mode()
    def route(logits: torch.Tensor):
        _, w, ids = router(logits.float())
        return w.float(), ids.long()

    return route


if __name__ == "__main__":
    run_jobs(sys.argv[1], sys.argv[2], routing_of)
