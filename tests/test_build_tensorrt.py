"""TensorRT builder parts that run without TensorRT: segments, profile dimensions, the import guard."""

from __future__ import annotations

import importlib.util

import onnx
import pytest

from moe_export.export.backends import _value_types, plan_segments
from moe_export.export.errors import InputError
from moe_export.export.tensorrt_build import build_tensorrt_engine, profile_range, segment_input_dims
from moe_export.graphs.sharding import Mapping
from moe_export.recipes.schema import load_recipe

from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: two real tiny rank graphs)


def test_every_segment_input_has_profile_dims(tiny_graphs):  # noqa: F811
    recipe, _ = load_recipe("h100x64.yaml")
    limits = recipe.limits
    for path in tiny_graphs:
        model = onnx.load(str(path), load_external_data=False)
        dims = segment_input_dims(model, _value_types(model), Mapping(4, 1, 2, 2))
        segments = [s for s in plan_segments(model) if not isinstance(s, dict)]
        assert set(dims) == {i for s in segments for i in s.inputs}
        for name, value_dims in dims.items():
            for axis, d in enumerate(value_dims):
                low, opt, high = profile_range(name, axis, d, limits)
                assert 1 <= low <= opt <= high or low == opt == high
        pools = [v for n, v in dims.items() if n.startswith(("mla_cache.", "index_cache."))]
        assert pools and all(v[:2] == ["S", "L"] for v in pools)
    # pools follow the runtime's pool sizes, the build's tactic timing uses small opt shapes
    assert profile_range("mla_cache.3", 0, "S", limits) == (1, 4, limits.max_batch)
    assert profile_range("mla_cache.3", 1, "L", limits) == (1, 4096, limits.max_seq_len)
    assert profile_range("input_ids", 0, "T", limits) == (1, 256, limits.max_num_tokens)
    with pytest.raises(InputError, match="unknown symbolic dimension"):
        profile_range("x", 0, "Q", limits)


def test_gathered_logits_width_recovered(tiny_graphs):  # noqa: F811
    model = onnx.load(str(tiny_graphs[0]), load_external_data=False)
    dims = segment_input_dims(model, _value_types(model), Mapping(4, 1, 2, 2))
    vocab = next(d.dim_value for o in model.graph.output if o.name == "logits" for d in o.type.tensor_type.shape.dim[1:])
    assert dims["lm_head.all_gather"] == ["N", vocab]


def test_builder_without_tensorrt_is_a_clear_error(tmp_path):
    assert importlib.util.find_spec("tensorrt") is None
    recipe, _ = load_recipe("h100x64.yaml")
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        build_tensorrt_engine(tmp_path / "model.onnx", recipe, Mapping(64, 0, 8, 64), tmp_path / "rank0.engine")
    assert not any(tmp_path.iterdir())
