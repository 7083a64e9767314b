"""The collectives of a TensorRT rank graph run in one order on every rank (NCCL requires each communicator's
collectives in the same order on all its ranks; a rank that enqueues another communicator's collective first
waits on one its peers have not reached: a hang). TensorRT orders the layers of an engine by their data
dependencies only (contract TRT_ORDERS_BY_DATA_DEPENDENCIES, plugins/tensorrt_contracts.py), and each of the
world's engines is built on its own, so every two collectives of a graph must be ordered by a path between them;
then the order is the graph's, the same program on every rank. The MoE layer's shared-expert all-reduce and its
dispatch / combine / all-gather were independent before the `after` inputs (`GraphBuilder.collective`)."""

from __future__ import annotations


import pytest
from moe_export.common.recipe import load_recipe
from moe_export.export.backends import backend_for
from moe_export.export.convert.checkpoint import open_checkpoint
from moe_export.export.convert.rank import convert_rank
from moe_export.export.convert.synth import write_synthetic_checkpoint
from moe_export.graphs.onnx_export import export_rank_graph
from moe_export.graphs.sharding import Mapping
from moe_export.plugins import DOMAIN
from moe_export.plugins.collectives.onnx_schema import COLLECTIVE_OPS

import onnx

LAYOUTS = {  # name -> mappings of the ranks exported (the dp layout's: two attention groups' ranks)
    "tp": [Mapping(4, 1, 2, 2)],
    "dp": [Mapping(8, r, 2, 8, "dp") for r in (0, 3)],
}


@pytest.fixture(scope="module")
def trt_graphs(tmp_path_factory) -> dict[str, list[onnx.ModelProto]]:
    cpu, _ = load_recipe("tiny-cpu.yaml")
    recipe = cpu.model_copy(update={"backend": "tensorrt"})
    root = tmp_path_factory.mktemp("collective-order")
    reader = open_checkpoint(write_synthetic_checkpoint("tiny-k3", root / "ckpt", 0))
    graphs: dict[str, list[onnx.ModelProto]] = {}
    for layout, mappings in LAYOUTS.items():
        for m in mappings:
            out = root / f"{layout}{m.rank}"
            out.mkdir()
            convert_rank(reader, reader.config, recipe, m, out / "weights.safetensors")
            export_rank_graph(reader.config, recipe, m, out / "weights.safetensors", out / "model.onnx",
                              backend_for(recipe).graph_form)
            graphs.setdefault(layout, []).append(onnx.load(str(out / "model.onnx"), load_external_data=False))
    return graphs


def collectives_in_dependency_order(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(op, group) of the graph's collectives, asserting that every two are ordered by a data path (so the order
    below, the nodes' topological one, is the only one an engine can run them in)."""
    producer = {out: i for i, node in enumerate(model.graph.node) for out in node.output}
    ancestors: list[set[int]] = []
    for node in model.graph.node:  # ONNX nodes are topologically sorted
        seen: set[int] = set()
        for name in node.input:
            if name in producer:
                seen |= {producer[name]} | ancestors[producer[name]]
        ancestors.append(seen)
    found = [i for i, n in enumerate(model.graph.node) if n.domain == DOMAIN and n.op_type in COLLECTIVE_OPS]
    unordered = [(model.graph.node[a].name, model.graph.node[b].name)
                 for k, a in enumerate(found) for b in found[k + 1:] if a not in ancestors[b]]
    assert not unordered, f"{len(unordered)} pairs of collectives with no data path between them, e.g. {unordered[:3]}"
    return [(model.graph.node[i].op_type, attr_text(model.graph.node[i], "group")) for i in found]


def attr_text(node: onnx.NodeProto, name: str) -> str:
    return next(a.s.decode() for a in node.attribute if a.name == name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_two_collectives_of_a_rank_graph_are_ordered_by_data(trt_graphs, layout):
    orders = [collectives_in_dependency_order(model) for model in trt_graphs[layout]]
    assert orders[0], "no collectives exported"
    assert all(order == orders[0] for order in orders), "ranks run their collectives in different orders"
    if layout == "dp":  # the MoE layer's four: dispatch, combine, the token all-gather, the shared experts'
        assert ("MoEDispatch", "ep") in orders[0] and ("AllGather", "tp") in orders[0]
