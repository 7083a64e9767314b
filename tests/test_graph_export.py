"""Exported per-rank graphs: onnx.checker, strict shape inference, plugin nodes, collectives, segments."""

from __future__ import annotations

import json

import onnx
import pytest
from moe_export.common.recipe import load_recipe
from moe_export.export.backends.onnxruntime import lower_for_onnxruntime
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.rank import convert_rank
from moe_export.export.convert.synth import write_synthetic_checkpoint
from moe_export.export.backends import backend_for
from moe_export.graphs.onnx_export import export_rank_graph
from moe_export.graphs.sharding import Mapping
from moe_export.plugins import DOMAIN
from moe_export.plugins.registry import register_all_schemas


@pytest.fixture(scope="module", params=["tiny-k3", "tiny-k3-dsa", "tiny-kimi-linear"])
def rank_graph(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    reader = open_checkpoint(write_synthetic_checkpoint(request.param, root / "ckpt", 0))
    recipe, _ = load_recipe("tiny-cpu.yaml")
    mapping = Mapping(4, 1, 2, 2)
    out = root / "rank1"
    out.mkdir()
    convert_rank(reader, reader.config, recipe, mapping, out / "weights.safetensors")
    summary = export_rank_graph(reader.config, recipe, mapping, out / "weights.safetensors", out / "model.onnx",
                                backend_for(recipe).graph_form)
    return reader.config, out, summary


def test_checker_and_strict_shape_inference(rank_graph):
    cfg, out, _ = rank_graph
    register_all_schemas()
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    outputs = {o.name: o for o in inferred.graph.output}
    logits = [d.dim_param or d.dim_value for d in outputs["logits"].type.tensor_type.shape.dim]
    assert logits == ["N", cfg.vocab_size]
    assert model.opset_import[0].version >= 21


def test_plugin_nodes_collectives_and_names(rank_graph):
    cfg, out, summary = rank_graph
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    plugins = summary["plugin_nodes"]
    assert plugins[f"{DOMAIN}::GatedDeltaScan"] == len(cfg.kda_layers)
    assert plugins[f"{DOMAIN}::ShortConv"] == len(cfg.kda_layers)
    assert plugins[f"{DOMAIN}::SparseMLAAttention"] == len(cfg.mla_layers)
    assert plugins.get(f"{DOMAIN}::DSAIndexer", 0) == sum(cfg.has_indexer(i) for i in cfg.mla_layers)
    assert plugins[f"{DOMAIN}::MoEMXFP4"] == sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert plugins[f"{DOMAIN}::AllGather"] == 1  # vocab-parallel logits
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names)) and all(names)
    # every plugin node follows TensorRT's lookup rule: op type = plugin name, domain = namespace, version
    for node in model.graph.node:
        if node.domain == DOMAIN:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["plugin_version"] == b"1"
            assert attrs["plugin_namespace"] == node.domain.encode()
    # the experts' partial sums are reduced over the ep group before the latent norm
    reduce_groups = [onnx.helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "AllReduce"
                     for a in n.attribute if a.name == "group"]
    assert reduce_groups.count(b"ep") == sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    # states in, states out
    ins = {v.name for v in model.graph.input}
    outs = {v.name for v in model.graph.output}
    for i in cfg.kda_layers:
        assert {f"kda_state.{i}", f"conv_state.{i}"} <= ins and {f"kda_state.{i}.out", f"conv_state.{i}.out"} <= outs
    for i in cfg.mla_layers:
        assert f"mla_cache.{i}" in ins and f"mla_cache.{i}.out" in outs
    # weights are external data pointing into the rank's safetensors file
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if t.name.startswith(cfg.weight_prefix + "model."))


def test_ort_segments_cover_graph(rank_graph):
    _, out, _ = rank_graph
    files = lower_for_onnxruntime(out / "model.onnx", out)
    plan = json.loads((out / "ort_plan.json").read_text())["steps"]
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    collectives = [n for n in model.graph.node if n.op_type in ("AllReduce", "AllGather")]
    assert sum("collective" in s for s in plan) == len(collectives)
    seg_nodes = 0
    for name in (f for f in files if f.endswith(".onnx")):
        seg = onnx.load(str(out / name), load_external_data=False)
        onnx.checker.check_model(str(out / name), full_check=True)
        assert all(n.domain != DOMAIN or n.op_type in {f.name for f in seg.functions} for n in seg.graph.node)
        seg_nodes += len(seg.graph.node)
    assert seg_nodes == len(model.graph.node) - len(collectives)
