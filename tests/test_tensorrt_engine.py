"""The TensorRT runtime's CPU-checkable parts: the engine file's plan and segments, the import guard.
(Execution needs TensorRT and a GPU; nothing here runs an engine.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from moe_export.export.errors import InputError
from moe_export.export.tensorrt_build import PLAN_KEY
from moe_export.runtime.engine.tensorrt import TensorRTEngine, read_engine_file


def test_engine_file_round_trip_and_errors(tmp_path):
    plan = {"steps": [{"segment": "segment.000", "inputs": ["input_ids"], "outputs": ["h"]},
                      {"collective": "AllReduce", "input": "h", "output": "h2", "group": "tp"},
                      {"segment": "segment.001", "inputs": ["h2"], "outputs": ["logits"]}],
            "graph_outputs": ["logits"], "rank": 0}  # fmt: skip
    blobs = {"segment.000": np.frombuffer(b"engine-zero", np.uint8), "segment.001": np.frombuffer(b"one", np.uint8)}
    path = tmp_path / "rank0.engine"
    save_file(blobs, str(path), metadata={PLAN_KEY: json.dumps(plan)})
    got_plan, got_blobs = read_engine_file(path)
    assert got_plan == plan and got_blobs == {"segment.000": b"engine-zero", "segment.001": b"one"}
    save_file({"segment.000": blobs["segment.000"]}, str(path), metadata={PLAN_KEY: json.dumps(plan)})
    with pytest.raises(InputError, match="segment.001"):
        read_engine_file(path)
    save_file(blobs, str(path))
    with pytest.raises(InputError, match="not a moe-export TensorRT engine"):
        read_engine_file(path)


def test_engine_needs_tensorrt_and_the_tensorrt_backend(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"backend": "onnxruntime"}))
    with pytest.raises(InputError, match="not tensorrt"):
        TensorRTEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"backend": "tensorrt", "recipe": {"name": "k3"}}))
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        TensorRTEngine(tmp_path)


def test_open_engine_picks_the_runner_of_the_built_backend(tmp_path):
    """`LLM` and `moe-export generate` open engines through `open_engine`: a tensorrt build goes to the
    TensorRT runner (here: its clear import error), anything else to the ONNX Runtime runner."""
    from moe_export.runtime.engine import open_engine

    (tmp_path / "config.json").write_text(json.dumps({"backend": "tensorrt", "recipe": {"name": "k3"}}))
    with pytest.raises(InputError, match="needs the TensorRT Python package"):
        open_engine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"backend": "onnxruntime"}))
    with pytest.raises(InputError, match="no rank"):
        open_engine(tmp_path)
