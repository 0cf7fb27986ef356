"""The block-semantics probe and the taps it drives, on small pure-torch trunks (no engine).

Each trunk below reproduces one calling/returning convention found in vLLM 0.32's model code; the
true stream is computed independently by the trunk itself (`stream_after`), so the probe's
choice and the taps' rows are checked against it, not against the probe's own readings.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harvest.engine.capture import block_stream
from harvest.engine.capture import probe
from harvest.engine.capture import taps
from harvest.engine.addresses import Address, FreezeSet

W, T = 16, 12


class Block(nn.Module):
    """style: 'fused' (Llama: returns (delta, stream_in), stream = sum), 'cohere' (returns
    (stream_out, stream_in), ignores its residual argument), 'stablelm' (layer(positions, h)
    returns (stream_out, mid)), 'plain' (layer(h) returns the stream), 'hf' ([1, T, W] layout,
    keyword call), 'two_stream' (the next block reads h + 0.5 * residual: no single stream)."""

    def __init__(self, style: str, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.style = style
        self.self_attn = nn.Linear(W, W, bias=False)
        self.mlp = nn.Linear(W, W, bias=False)
        with torch.no_grad():
            self.self_attn.weight.copy_(torch.randn(W, W, generator=g) * 0.4)
            self.mlp.weight.copy_(torch.randn(W, W, generator=g) * 0.4)

    def delta(self, s):
        n = s / s.norm(dim=-1, keepdim=True)
        return self.self_attn(n) + self.mlp(torch.tanh(n))

    def forward(self, positions, hidden_states, residual=None, t_cond=None):
        if self.style == "fused":
            s = hidden_states if residual is None else hidden_states + residual
            return self.delta(s), s
        if self.style == "cohere":
            return hidden_states + self.delta(hidden_states), hidden_states
        if self.style == "two_stream":
            s = hidden_states if residual is None else hidden_states + 0.5 * residual
            return self.delta(s), s
        raise AssertionError(self.style)


class StableLM(Block):
    def forward(self, positions, hidden_states):
        mid = hidden_states + self.self_attn(hidden_states / hidden_states.norm(dim=-1, keepdim=True))
        return mid + self.mlp(torch.tanh(mid / mid.norm(dim=-1, keepdim=True))), mid


class Plain(Block):
    def forward(self, hidden_states):
        return hidden_states + self.delta(hidden_states)


class HFLayer(Block):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        return hidden_states + self.delta(hidden_states)


class Model(nn.Module):
    def __init__(self, style: str, n: int = 3):
        super().__init__()
        cls = {"stablelm": StableLM, "plain": Plain, "hf": HFLayer}.get(style, Block)
        self.style = style
        self.layers = nn.ModuleList(cls(style, i) for i in range(n))
        self.embed = nn.Embedding(50, W)
        self.norm = nn.LayerNorm(W)
        with torch.no_grad():
            self.embed.weight.normal_(0, 1.0)

    def embed_ids(self, ids):
        return self.embed(ids) * 3.0  # scaled like Gemma/Granite

    def streams(self, ids) -> list[torch.Tensor]:
        """The true stream after each block, computed by the model's own rule."""
        out = []
        self.forward(ids, record=out)
        return out

    def forward(self, ids, record=None):
        h, r = self.embed_ids(ids), None
        for layer in self.layers:
            if self.style in ("fused", "two_stream"):
                h, r = layer(torch.zeros_like(ids), h, r, t_cond=None)
                s = h + r
            elif self.style == "cohere":
                h, r = layer(torch.zeros_like(ids), h, r)
                s = h
            elif self.style == "stablelm":
                h, r = layer(torch.zeros_like(ids), h)
                s = h
            elif self.style == "plain":
                h = s = layer(h)
            else:  # hf: batch dim and keyword call
                h = layer(hidden_states=h[None] if h.dim() == 2 else h, attention_mask=None)
                s = h[0]
            if record is not None:
                record.append(s.detach().clone())
        return self.norm(s)


def _probe(m: Model):
    ids = torch.arange(T) % 50
    return probe.decide(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W)


@pytest.mark.parametrize("style,pre,post", [
    ("fused", [False, True, True], "sum"), ("cohere", [False, False, False], "first"),
    ("stablelm", [False] * 3, "first"), ("plain", [False] * 3, "tensor"),
    ("hf", [False] * 3, "tensor")])
def test_probe_measures_each_convention(style, pre, post):
    trunk = _probe(Model(style))
    assert [s.post for s in trunk.semantics] == [post] * 3
    assert [s.pre_adds_residual for s in trunk.semantics] == pre
    assert trunk.report["verified"] is True
    # margins: the kept reading is exact (float32 here), the rejected one far off; the last
    # block's margin is the smallest (its evidence goes through the scale-invariant final norm)
    for b in trunk.report["blocks"]:
        kept = b["post_errors"][post]
        assert kept < 1e-5
        assert all(e > 0.05 for m, e in b["post_errors"].items() if m != post)


def test_two_stream_trunk_is_refused_naming_class_and_invariant():
    with pytest.raises(probe.TrunkRefused) as e:
        _probe(Model("two_stream"))
    msg = str(e.value)
    assert "block Block (layer 0)" in msg and "invariant I3" in msg
    assert "harvest_unverified_trunk" in msg


def test_block_returning_its_update_only_is_refused():
    class Delta(Plain):
        def forward(self, hidden_states):
            return self.delta(hidden_states)

    m = Model("plain")
    m.layers = nn.ModuleList(Delta("plain", i) for i in range(3))
    orig = Model.forward

    def fwd(self, ids, record=None):  # the model adds the update itself
        h = self.embed_ids(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)

    Model.forward = fwd
    try:
        with pytest.raises(probe.TrunkRefused, match=r"layer 1\).*invariant I2"):
            _probe(m)
    finally:
        Model.forward = orig


def test_opt_in_keeps_the_refusal_reason_in_the_report():
    m = Model("two_stream")
    ids = torch.arange(T) % 50
    trunk = probe.probe_trunk(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W,
                              allow_unverified=True)
    assert trunk.report["verified"] is False and "invariant I3" in trunk.report["reason"]
    assert all(s.how == "guess" for s in trunk.semantics)


@pytest.mark.parametrize("style", ["fused", "cohere", "stablelm", "plain", "hf"])
@pytest.mark.parametrize("hooked", [False, True])
def test_taps_read_the_true_stream(style, hooked):
    """Freeze wrappers and hooks, driven by the probe's semantics, against the model's own
    streams: resid_post at every layer, resid_pre(L+1) == stream(L), resid_pre(0) == embedding,
    and the sub-module outputs."""
    m = Model(style)
    ids = torch.arange(T) % 50
    trunk = _probe(m)
    want = m.streams(ids)
    reads = ([Address("resid_post", i) for i in range(3)] + [Address("resid_pre", i) for i in range(3)]
             + [Address("mlp_out", 1)] * (style != "stablelm"))
    ts = taps.allocate(FreezeSet(tuple(reads), ()), T, W, torch.float32, "cpu")
    if hooked:
        handles = taps.install_hooks(trunk, ts)
    else:
        taps.install_freeze(trunk, ts)
    with torch.no_grad():
        m(ids)
    for i in range(3):
        torch.testing.assert_close(ts.buf[ts.slot(Address("resid_post", i))], want[i])
    torch.testing.assert_close(ts.buf[ts.slot(Address("resid_pre", 0))], m.embed_ids(ids))
    for i in (1, 2):
        torch.testing.assert_close(ts.buf[ts.slot(Address("resid_pre", i))], want[i - 1])
    if style != "stablelm":
        s0 = want[0]
        mlp = m.layers[1].mlp(torch.tanh(s0 / s0.norm(dim=-1, keepdim=True)))
        torch.testing.assert_close(ts.buf[ts.slot(Address("mlp_out", 1))], mlp)
    if hooked:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("style", ["fused", "cohere", "hf"])
def test_steering_shifts_the_true_stream(style):
    m = Model(style)
    ids = torch.arange(T) % 50
    trunk = _probe(m)
    base = m.streams(ids)
    a = Address("resid_post", 0)
    ts = taps.allocate(FreezeSet((a,), (a, Address("resid_pre", 2))), T, W, torch.float32, "cpu")
    taps.install_freeze(trunk, ts)
    vec = torch.linspace(-1, 1, W)
    ts.steer[a].copy_(vec)
    with torch.no_grad():
        m(ids)
    torch.testing.assert_close(ts.buf[0], base[0] + vec)  # read after write at the same site
    # ...and the next block sees exactly the shifted stream (its own rule, not the tap's)
    steered = m.streams(ids)
    torch.testing.assert_close(steered[0], base[0] + vec)
    assert (steered[1] - base[1]).norm() / base[1].norm() > 0.01


def test_block_without_a_known_mlp_name_refuses_mlp_out_on_both_backends():
    """A block whose MLP sits under another name (here `experts`, which in vLLM holds the routed
    experts only) serves attn_out but refuses mlp_out, with the probe's trunk and with the HF
    reference backend's rule alike."""
    class Renamed(Plain):
        def __init__(self, style, seed):
            super().__init__(style, seed)
            self.experts = self._modules.pop("mlp")

        def delta(self, s):
            n = s / s.norm(dim=-1, keepdim=True)
            return self.self_attn(n) + self.experts(torch.tanh(n))

    m = Model("plain")
    m.layers = nn.ModuleList(Renamed("plain", i) for i in range(3))
    ids = torch.arange(T) % 50
    probed = probe.decide(m.layers, lambda: m(ids), lambda: m.embed_ids(ids), W)
    hf = block_stream.Trunk(m.layers, [block_stream.hf_semantics(layer) for layer in m.layers])
    for trunk in (probed, hf):
        taps.check_supported(trunk, [Address("attn_out", 1)])
        with pytest.raises(ValueError, match="block Renamed serves no mlp_out .*block_sparse_moe"):
            taps.check_supported(trunk, [Address("mlp_out", 1)])
