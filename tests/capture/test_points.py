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
        if isinstance(self.mlp, MLP):
            self.truth[("mlp_act", self.li)] = torch.relu(
                self.mlp.gate_up_proj(m_in)).detach().clone()
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


# q/k/v at an attention kernel module and the MLP's pre-activations: a block shaped like vLLM's
# (qkv_proj, then attn(query, key, value), then o_proj; gate_up_proj, then act(gate) * up, then
# down_proj). The query, key and value are equally wide here, so only their parameter names
# tell them apart; the query arrives as [tokens, heads, head_dim].
KV = H


class Kernel(nn.Module):
    """vLLM's Attention: `forward(query, key, value)`; a stand-in that mixes all three."""

    def forward(self, query, key, value):
        return torch.tanh(query.flatten(1)) * torch.sigmoid(key) + value


class QKVAttn(nn.Module):
    def __init__(self, truth: dict, li: int):
        super().__init__()
        self.qkv_proj = nn.Linear(W, H + 2 * KV, bias=False)
        self.attn = Kernel()
        self.o_proj = nn.Linear(H, W, bias=False)
        self.truth, self.li = truth, li

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([H, KV, KV], dim=-1)
        q, k = q * 1.5, k.flip(-1)  # "the rotary embedding": q and k change after the split
        for name, t in (("q", q), ("k", k), ("v", v)):
            self.truth[(name, self.li)] = t.detach().clone()
        # `.forward` called directly, as vLLM's Transformers backend calls its kernel: no hooks run
        return self.o_proj(self.attn.forward(q.reshape(-1, 2, H // 2), k, v))


class GatedMLP(nn.Module):
    """gate_up_proj -> [gate | up] -> silu(gate) * up -> down_proj; `swapped`: the fused output
    is [up | gate] (a family whose halves are the other way round: not what mlp_pre means)."""

    def __init__(self, truth: dict, li: int, swapped: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(W, 2 * F, bias=False)
        self.down_proj = nn.Linear(F, W, bias=False)
        self.truth, self.li, self.swapped = truth, li, swapped

    def forward(self, x):
        a, b = self.gate_up_proj(x).chunk(2, dim=-1)
        gate, up = (b, a) if self.swapped else (a, b)
        self.truth[("mlp_pre", self.li)] = gate.detach().clone()
        self.truth[("mlp_pre_linear", self.li)] = up.detach().clone()
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class PlainMLP(nn.Module):
    """GPT-2's: c_fc -> gelu (tanh) -> c_proj, no linear branch."""

    def __init__(self, truth: dict, li: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(W, F), nn.Linear(F, W)
        self.truth, self.li = truth, li

    def forward(self, x):
        pre = self.c_fc(x)
        self.truth[("mlp_pre", self.li)] = pre.detach().clone()
        return self.c_proj(torch.nn.functional.gelu(pre, approximate="tanh"))


def _qkv_model(mlp: str) -> Model:
    m = Model()
    for li, layer in enumerate(m.layers):
        torch.manual_seed(100 + li)
        layer.self_attn = QKVAttn(m.truth, li)
        layer.mlp = (PlainMLP(m.truth, li) if mlp == "plain" else
                     GatedMLP(m.truth, li, swapped=mlp == "swapped"))
    return m


def _decide(m: Model):
    ids = torch.arange(T) % 50
    with torch.no_grad():
        return probe.decide(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W,
                            {"heads": H, "kv_heads": KV, "neurons": F}), ids


def test_qkv_and_mlp_pre_are_located_by_name_and_tapped_exactly():
    """q, k, v are the attention kernel's query/key/value inputs, told apart by parameter name
    although all three are as wide (the query flattened from [tokens, heads, head_dim]); mlp_pre
    and mlp_pre_linear are the halves of gate_up_proj, kept because silu(mlp_pre) x
    mlp_pre_linear is down_proj's input. Freeze taps and hooks read the same tensors."""
    m = _qkv_model("gated")
    trunk, ids = _decide(m)
    sites = trunk.semantics[1].sites
    assert {"q", "k", "v", "mlp_pre", "mlp_pre_linear", "mlp_act"} <= set(sites), \
        trunk.report["blocks"][1]["submodule_notes"]
    assert [sites[p].stream for p in "qkv"] == [(0, "query"), (1, "key"), (2, "value")]
    assert sites["mlp_pre"].part == (0, 2) and sites["mlp_pre_linear"].part == (1, 2)
    names = ("q", "k", "v", "mlp_pre", "mlp_pre_linear")
    reads = tuple(Address(n, li) for n in names for li in (0, 2))
    widths = tuple(F if n.startswith("mlp") else H for n in names for _ in (0, 2))
    for install in (taps.install_freeze, taps.install_hooks):
        mm = _qkv_model("gated")
        tr, _ = _decide(mm)
        ts = taps.allocate(FreezeSet(reads, ()), T, W, torch.float32, "cpu", widths)
        install(tr, ts)
        mm.truth.clear()
        with torch.no_grad():
            mm(ids)
        for k, a in enumerate(reads):
            assert torch.equal(ts.buf[k, :, :widths[k]], mm.truth[(a.name, a.layer)]), \
                (install.__name__, a)


def test_mlp_pre_is_refused_where_the_halves_are_not_gate_then_up():
    """A fused projection whose output is [up | gate]: its first half is not the gate, and the
    probe measures that (silu(first) x second is not down_proj's input), so both points are
    refused with the reason rather than served swapped."""
    trunk, _ = _decide(_qkv_model("swapped"))
    assert "mlp_pre" not in trunk.semantics[0].sites and "mlp_act" in trunk.semantics[0].sites
    for p in ("mlp_pre.0", "mlp_pre_linear.2"):
        with pytest.raises(ValueError, match="not the MLP's pre-activation.*closest"):
            taps.check_supported(trunk, [Address.parse(p)])


def test_an_ungated_mlp_serves_mlp_pre_and_refuses_mlp_pre_linear():
    """GPT-2's MLP: mlp_pre is c_fc's output (gelu of it is down_proj's input); there is no
    linear branch, so mlp_pre_linear is refused by name."""
    m = _qkv_model("plain")
    trunk, ids = _decide(m)
    assert "mlp_pre" in trunk.semantics[1].sites
    with pytest.raises(ValueError, match="mlp_pre_linear.1: .*not a gated MLP"):
        taps.check_supported(trunk, [Address("mlp_pre_linear", 1)])
    ts = taps.allocate(FreezeSet((Address("mlp_pre", 1),), ()), T, W, torch.float32, "cpu", (F,))
    taps.install_freeze(trunk, ts)
    with torch.no_grad():
        m(ids)
    assert torch.equal(ts.buf[0], m.truth[("mlp_pre", 1)])


def test_qkv_are_refused_by_name_without_an_attention_kernel_module():
    """The first trunk's attention has no `attn` kernel module (as vLLM's Transformers backend):
    q/k/v are never a module's input there, refused with that reason."""
    trunk, _ = _probe(Model())
    with pytest.raises(ValueError, match="k.0: .*no attention kernel module"):
        taps.check_supported(trunk, [Address("k", 0)])
