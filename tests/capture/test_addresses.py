import pytest

from harvest.engine import Address, resolve_freeze_points
from harvest.engine.addresses import FreezePlan, FreezeSet


def addrs(name, n):
    return tuple(Address(name, i) for i in range(n))


def test_address_string_form_round_trips():
    a = Address.parse("resid_post.10")
    assert a == Address("resid_post", 10) and str(a) == "resid_post.10"


def test_unknown_point_names_the_known_ones():
    with pytest.raises(ValueError, match="known points are embeddings, resid_pre, attn_in"):
        Address.parse("resid_middle.3")
    with pytest.raises(ValueError, match="logits are vocab-wide"):
        Address.parse("lm_head.3")  # a point the field names and no engine serves: the reason
    with pytest.raises(ValueError, match="model-level point"):
        Address.parse("embeddings.2")
    assert Address.parse("resid_mid.3").spec.width == "d_model"
    assert Address.parse("z.1").spec.tp == "sharded"
    with pytest.raises(ValueError, match="'<point>.<layer>'"):
        Address.parse("resid_post")


def test_auto_reads_resid_post_everywhere_and_writes_where_it_reads():
    reads, writes, graph = resolve_freeze_points("auto", n_layers=4)
    assert reads == addrs("resid_post", 4) and writes == reads and graph is True


def test_no_list_with_enforce_eager_false_is_auto():
    assert resolve_freeze_points(None, 3, enforce_eager=False) == resolve_freeze_points("auto", 3)


def test_no_list_with_enforce_eager_unset_is_hooked_mode():
    assert resolve_freeze_points(None, 3) == FreezePlan((), (), False)
    assert resolve_freeze_points(None, 3).freeze_set() is None


def test_multi_stream_trunk_auto_reads_resid_streams():
    fs = resolve_freeze_points("auto", n_layers=2, n_streams=4)
    assert fs.reads == addrs("resid_streams", 2) and fs.writes == fs.reads


def test_freeze_writes_empty_keeps_reads_without_write_buffers():
    fs = resolve_freeze_points("auto", 3, freeze_writes=[])
    assert fs.reads == addrs("resid_post", 3) and fs.writes == () and fs.graph
    # None and [] differ only here: None means "writes == reads".
    assert resolve_freeze_points("auto", 3, freeze_writes=None).writes == fs.reads
    # ...and with enforce_eager=False and no list, which is auto too
    assert resolve_freeze_points(None, 3, freeze_writes=[], enforce_eager=False) == fs


def test_freeze_writes_empty_alone_is_not_graph_mode():
    reads, writes, graph = resolve_freeze_points(None, 3, freeze_writes=[])
    assert graph is False and reads == () and writes == ()
    assert resolve_freeze_points(None, 3, freeze_writes=[], enforce_eager=True).graph is False


def test_explicit_read_list_implies_no_writes():
    fs = resolve_freeze_points(["resid_post.1", "resid_pre.0"], 3)
    assert fs.reads == (Address("resid_post", 1), Address("resid_pre", 0)) and fs.writes == ()


def test_named_write_without_reads_stays_writes_only():
    fs = resolve_freeze_points(None, 3, freeze_writes=["resid_post.2"])
    assert fs.reads == () and fs.writes == (Address("resid_post", 2),)
    fs = resolve_freeze_points([], 3, freeze_writes=["resid_post.2"])
    assert fs.reads == () and fs.writes == (Address("resid_post", 2),)


def test_empty_list_is_graph_mode_with_no_taps():
    assert resolve_freeze_points([], 3) == FreezePlan((), (), True)
    assert resolve_freeze_points([], 3).freeze_set() == FreezeSet((), ())


def test_enforce_eager_with_freeze_set_is_refused():
    for kw in ({"freeze_points": "auto"}, {"freeze_points": ["resid_post.0"]},
               {"freeze_points": []}, {"freeze_writes": ["resid_post.0"]}):
        with pytest.raises(ValueError, match="omit freeze_points"):
            resolve_freeze_points(n_layers=2, enforce_eager=True, **kw)


def test_enforce_eager_alone_is_hooked_mode():
    reads, writes, graph = resolve_freeze_points(None, 2, enforce_eager=True)
    assert (reads, writes, graph) == ((), (), False)


def test_unknown_string_is_refused():
    with pytest.raises(ValueError, match="not understood"):
        resolve_freeze_points("all", 2)


def test_out_of_range_layer_is_refused():
    with pytest.raises(ValueError, match="layers 0..2"):
        resolve_freeze_points(["resid_post.3"], 3)


def test_frozen_set_refuses_points_outside_it():
    fs = resolve_freeze_points(["resid_post.1"], 3).freeze_set()
    fs.check_read([Address("resid_post", 1)])
    with pytest.raises(ValueError, match="cannot serve resid_post.0"):
        fs.check_read([Address("resid_post", 0)])


def test_docs_point_table_is_the_table():
    """docs/engine.md's point table is generated from engine/points.py, never edited by hand."""
    from pathlib import Path

    from harvest.engine.points import table_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    assert table_markdown() in doc


def test_point_widths_from_configs():
    """Widths per kind from a config dict: the store and `plan` size each point from these."""
    from harvest.engine.points import point_width

    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}
    assert [point_width(smol, p) for p in ("mlp_in", "z", "mlp_act")] == [576, 576, 1536]
    gpt2 = {"model_type": "gpt2", "n_embd": 128, "n_head": 2}
    assert point_width(gpt2, "mlp_act") == 512 and point_width(gpt2, "z") == 128
    qwen3 = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 64, "num_experts": 8}
    assert point_width(qwen3, "z") == 256 and point_width(qwen3, "router_logits") == 8
    with pytest.raises(ValueError, match="router_logits needs a MoE model"):
        point_width(smol, "router_logits")
    # q: every head; k and v: the KV heads (grouped-query attention); the MLP's pre-activations
    smol = {**smol, "num_key_value_heads": 3}
    assert [point_width(smol, p) for p in ("q", "k", "v", "mlp_pre", "mlp_pre_linear")] == [
        576, 192, 192, 1536, 1536]
    assert point_width(gpt2, "k") == 128 and point_width(gpt2, "mlp_pre") == 512
    falcon = {"hidden_size": 128, "num_attention_heads": 2, "multi_query": True,
              "num_kv_heads": 2, "new_decoder_architecture": False}
    assert point_width(falcon, "v") == 64  # multi-query: one KV head whatever num_kv_heads says


def test_shard_widths_under_tensor_parallelism():
    """One rank's width of each kind (what its tap writes): sharded kinds a 1/tp slice; with
    fewer KV heads than ranks, vLLM gives each rank one KV head, held alike by tp / n_kv ranks."""
    from harvest.engine.points import kv_replicas, shard_width

    gqa = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 14336}
    assert [shard_width(gqa, k, 4) for k in ("d_model", "heads", "kv_heads", "neurons")] == [
        4096, 1024, 256, 3584]
    assert kv_replicas(gqa, 4) == 1 and kv_replicas(gqa, 16) == 2
    assert shard_width(gqa, "kv_heads", 16) == 128  # one head per rank, 2 ranks each
    assert shard_width(gqa, "kv_heads", 1) == 1024
