"""Every earlier public import path that other tools rely on (issue 26's list, README) still imports and names the
same object as its new home."""

from __future__ import annotations

import importlib

import pytest

ALIASES = [  # (module, name, where it lives now or None)
    ("moe_export.runtime.sampling", "SamplingParams", None),
    *[("moe_export.runtime.chat", name, None) for name in ("render", "render_ids", "render_segments",
                                                            "segments_to_ids", "parse_output", "OutputParser",
                                                            "prompt_starts_in_reasoning")],
    ("moe_export.runtime.tokenizer", "load_tokenizer", None),
    ("moe_export.runtime.formats.template", "ChatTemplate", None),
    ("moe_export.runtime.formats.common", "Segment", None),
    ("moe_export.quantize.mxfp4", None, None),
    ("moe_export.export.checkpoint", "open_checkpoint", "moe_export.export.convert.checkpoint"),
    ("moe_export.export.convert", "convert_rank", "moe_export.export.convert.rank"),
    ("moe_export.export.synth", "write_synthetic_checkpoint", "moe_export.export.convert.synth"),
    ("moe_export.export.synth", "write_synthetic_tokenizer", "moe_export.export.convert.synth"),
    ("moe_export.export.build", "build", "moe_export.export.build.driver"),
    ("moe_export.graphs.onnx_export", "export_rank_graph", None),
    ("moe_export.graphs.sharding", "Mapping", None),
    ("moe_export.recipes.schema", "load_recipe", None),
    *[(f"moe_export.plugins.{op}.{part}", None, None)
      for op in ("gated_delta_scan", "short_conv", "sparse_mla_attention", "dsa_indexer", "moe_mxfp4",
                 "paged_cache_write")
      for part in ("onnx_schema",)],  # (`.tensorrt_plugin` needs TensorRT; tensorrt_plugin_checks imports it)
]


@pytest.mark.parametrize(("module", "name", "home"), ALIASES, ids=lambda v: str(v))
def test_alias_imports(module, name, home):
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name), f"{module} lost {name}"
    if home is not None:
        assert getattr(mod, name) is getattr(importlib.import_module(home), name)


def test_sharding_mapping_keeps_its_signature():
    from moe_export.graphs.sharding import Mapping

    m = Mapping(4, 1, 2, 2)
    assert (m.world_size, m.rank, m.tp, m.ep, m.attention) == (4, 1, 2, 2, "tp")
