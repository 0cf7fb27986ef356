"""Module-site points (engine/points.py, sites.py, probe_sites.py) on small pure-torch trunks: the
probe keeps the sites whose readings are what the point means and refuses the rest by name; the
freeze taps then write each point at its own width. The true tensors are recorded by the trunk
itself (`truth`), not read back through the engine's sites."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harvest.engine.capture import probe
from harvest.engine.capture import taps
from harvest.engine.addresses import Address, FreezeSet

W, H, F, T = 16, 24, 40, 12  # stream, heads x head_dim, MLP width, tokens


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(W, H, bias=False)
        self.o_proj = nn.Linear(H, W, bias=False)

    def forward(self, positions, hidden_states):
        return self.o_proj(torch.tanh(self.qkv(hidden_states)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(W, F, bias=False)
        self.down_proj = nn.Linear(F, W, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_up_proj(x)))


class Norm(nn.Module):
    """vLLM's fused add-norm: norm(x) or, with a residual, (norm(x + residual), x + residual)."""

    def forward(self, x, residual=None):
        if residual is None:
            return x / x.norm(dim=-1, keepdim=True)
        s = x + residual
        return s / s.norm(dim=-1, keepdim=True), s


class Layer(nn.Module):
    """Llama-style fused block (returns (delta, stream_in)); `parallel`: GPT-NeoX-style, the MLP
    norms the block's input instead of the stream after attention."""

    def __init__(self, seed: int, parallel: bool, truth: dict, li: int):
        super().__init__()
        torch.manual_seed(seed)
        self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
        self.self_attn, self.mlp = Attn(), MLP()
        self.parallel, self.truth, self.li = parallel, truth, li

    def forward(self, positions, hidden_states, residual=None):
        s = hidden_states if residual is None else hidden_states + residual
        a = self.self_attn(positions, self.input_layernorm(s))
        if self.parallel:
            m_in, _ = self.post_attention_layernorm(s, torch.zeros_like(s))
            return a + self.mlp(m_in), s
        m_in, mid = self.post_attention_layernorm(a, s)
        self.truth[("resid_mid", self.li)] = mid.detach().clone()
        self.truth[("mlp_act", self.li)] = torch.relu(self.mlp.gate_up_proj(m_in)).detach().clone()
        return self.mlp(m_in), mid


class Model(nn.Module):
    def __init__(self, parallel: bool = False, n: int = 3):
        super().__init__()
        self.truth: dict = {}
        self.layers = nn.ModuleList(Layer(i, parallel, self.truth, i) for i in range(n))
        self.embed = nn.Embedding(50, W)
        self.norm = nn.LayerNorm(W)

    def embed_ids(self, ids):
        return self.embed(ids)

    def forward(self, ids):
        h, r = self.embed_ids(ids), None
        for layer in self.layers:
            h, r = layer(torch.zeros_like(ids), h, r)
        return self.norm(h + r)


WIDTHS = {"heads": H, "neurons": F}


def _probe(m: Model):
    ids = torch.arange(T) % 50
    with torch.no_grad():
        return probe.decide(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W, WIDTHS), ids


def test_sequential_block_sites_are_verified_and_tapped_at_their_widths():
    m = Model()
    trunk, ids = _probe(m)
    sites = trunk.semantics[1].sites
    assert {"attn_in", "z", "resid_mid", "mlp_in", "mlp_act"} <= set(sites)
    assert sites["resid_mid"].reading == "in+res" and sites["mlp_act"].path == "mlp.down_proj"
    assert trunk.final_norm is m.norm  # the module whose output is the model's final state
    reads = (Address("resid_mid", 1), Address("mlp_act", 2), Address("resid_post", 0),
             Address("final_norm", 0), Address("embeddings", 0))
    ts = taps.allocate(FreezeSet(reads, ()), T, W, torch.float32, "cpu", (W, F, W, W, W))
    taps.install_freeze(trunk, ts)
    assert ts.buf.shape == (5, T, F)
    m.truth.clear()
    with torch.no_grad():
        final = m(ids)
    assert torch.allclose(ts.buf[0, :, :W], m.truth[("resid_mid", 1)])
    assert torch.allclose(ts.buf[1, :, :F], m.truth[("mlp_act", 2)])
    assert torch.equal(ts.buf[3, :, :W], final)
    assert torch.equal(ts.buf[4, :, :W], m.embed_ids(ids).detach())
    # refusals on a block that has the other points: named, with the reason
    with pytest.raises(ValueError, match="no sublayer post-norms"):
        taps.check_supported(trunk, [Address("mlp_out_post", 0)])
    with pytest.raises(ValueError, match="dense MLP"):
        taps.check_supported(trunk, [Address("router_logits", 0)])


def test_parallel_block_refuses_resid_mid_by_name():
    trunk, _ = _probe(Model(parallel=True))
    assert "resid_mid" not in trunk.semantics[1].sites and "mlp_in" in trunk.semantics[1].sites
    with pytest.raises(ValueError, match="resid_mid.1: block Layer .*parallel block"):
        taps.check_supported(trunk, [Address("resid_mid", 1)])


def test_a_site_of_the_wrong_width_is_refused():
    """The config says the MLP is wider than the module the probe found: never a different
    tensor; the point is refused with what was seen."""
    m = Model()
    ids = torch.arange(T) % 50
    with torch.no_grad():
        trunk = probe.decide(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W,
                             {"heads": H, "neurons": F + 1})
    assert "mlp_act" not in trunk.semantics[0].sites
    with pytest.raises(ValueError, match="serves no mlp_act: no 41-wide tensor"):
        taps.check_supported(trunk, [Address("mlp_act", 0)])


def test_check_model_expands_every_layer_of_any_point():
    """`harvest check-model --points mlp_in.* mlp_act.* embeddings.*`: each layer, model-level once."""
    from harvest.engine.model_check import expand_points

    assert expand_points(["mlp_in.*", "mlp_act.1", "embeddings.*"], 2) == [
        "mlp_in.0", "mlp_in.1", "mlp_act.1", "embeddings.0"]
