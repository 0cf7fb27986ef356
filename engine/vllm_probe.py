"""Run the block-semantics probe (engine/probe.py) inside vLLM's worker, right after the weights
load and before vLLM compiles or warms up the model, in every capture mode (freeze and hooked).

vLLM internals this file touches, all checked against vLLM 0.32.0 (CPU and CUDA builds); the
engine's other vLLM internals live in engine/harvest.py and engine/vllm_backend.py:
- `vllm.forward_context.set_forward_context(None, vllm_config, num_tokens=n, skip_compiled=True)`:
  with `skip_compiled` a `@support_torch_compile` model runs its plain forward instead of
  compiling (compilation/decorators.py `__call__`), so the probe neither triggers the compile nor
  leaves its temporary wrappers in a traced graph. The context also carries what MoE layers look
  up by name (`no_compile_layers`).
- `vllm.model_executor.layers.attention.Attention` (`num_heads`, `num_kv_heads`, `head_size_v`;
  `forward(query, key, value, output_shape=None, ...)`): at load time there is no KV cache and no
  attention metadata, and with metadata None the CPU kernel returns an uninitialised buffer
  (v1/attention/backends/cpu_attn.py "For warming-up"). The probe therefore swaps each instance's
  forward for the exact attention of one-token sequences (softmax over one key is 1, so each
  query head's output is its own token's value head), and feeds one-token sequences at position 0.
  Vllm's Transformers backend routes HF attention through the same `Attention` instances.
- the runner's `vllm_config` (`additional_config` for the opt-in) and
  `model_config.get_vocab_size()`, and the model's `forward(input_ids, positions)` /
  `embed_input_ids(ids)`; width and device come from engine/compat.py (`runner_geometry`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from . import compat, probe
from .blocks import Trunk
from .taps import find_layers

PROBE_TOKENS = 16
OPT_IN_KEY = "harvest_unverified_trunk"  # additional_config key: capture from a refused trunk


def _one_token_attention(self, query, key, value, output_shape=None, output_dtype=None, **_):
    n = query.shape[0]
    shape = output_shape or (n, self.num_heads * self.head_size_v)
    dtype = output_dtype or query.dtype
    if value is None or value.numel() != n * self.num_kv_heads * self.head_size_v:
        return torch.zeros(shape, dtype=dtype, device=query.device)  # no value to pass through
    v = value.reshape(n, self.num_kv_heads, self.head_size_v)
    v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
    return v.reshape(shape).to(dtype)


@contextlib.contextmanager
def _probe_attention(model: torch.nn.Module):
    from vllm.model_executor.layers.attention import Attention

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    for m in attns:
        m.forward = _one_token_attention.__get__(m)
    try:
        yield
    finally:
        for m in attns:
            del m.forward


def probed_trunk(runner, model: torch.nn.Module, n_layers: int, cfg: dict) -> Trunk:
    """The decoder layers of the runner's model, with each block's measured semantics.

    Raises probe.TrunkRefused (at engine load) unless the engine was opted in with
    `additional_config={"harvest_unverified_trunk": True}`.
    """
    from vllm.forward_context import set_forward_context

    layers = find_layers(model, n_layers)
    extra = getattr(runner.vllm_config, "additional_config", None) or {}
    allow = bool(cfg.get("unverified_trunk") or (isinstance(extra, dict) and extra.get(OPT_IN_KEY)))
    geometry = compat.runner_geometry(runner)
    vocab = runner.model_config.get_vocab_size()
    ids = torch.linspace(3, vocab - 1, PROBE_TOKENS).long().to(geometry["device"])
    positions = torch.zeros_like(ids)

    forwards: list[float] = []

    def run() -> torch.Tensor:
        t = time.perf_counter()
        with set_forward_context(None, runner.vllm_config, num_tokens=len(ids), skip_compiled=True):
            out = model(input_ids=ids, positions=positions)
        forwards.append(round(time.perf_counter() - t, 3))
        return out[0] if isinstance(out, (tuple, list)) else out

    def embed() -> torch.Tensor:
        return model.embed_input_ids(ids)

    width = geometry["width"]
    t0 = time.perf_counter()
    with torch.inference_mode(), _probe_attention(model):
        trunk = probe.probe_trunk(layers, run, embed, width, allow_unverified=allow)
    trunk.report.update(seconds=round(time.perf_counter() - t0, 3), forward_seconds=forwards)
    return trunk
