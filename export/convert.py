"""The convert stage: stream a checkpoint into one rank's `weights.safetensors`.

Non-expert tensors keep their on-disk HF names and dtypes and are sliced for this rank
(`graphs.sharding.shard_tensor`). Routed experts are stacked per MoE layer in the order of the
rank's expert ids, gate and up fused (`w13`: I gate rows then I up rows), as MXFP4:

    <layer>.block_sparse_moe.experts.w13_packed [E_local, 2I, D/2] U8   w13_scale [E_local, 2I, D/32] U8
    <layer>.block_sparse_moe.experts.w2_packed  [E_local, D, I/2]  U8   w2_scale  [E_local, D, I/32]  U8

The header is computed up front from the tensor inventory, then tensor data is written one tensor
(one expert slice) at a time, so peak memory stays near the largest single tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_export.export.errors import InputError
from moe_export.graphs.config import ModelConfig
from moe_export.graphs.sharding import Mapping, shard_tensor
from moe_export.graphs.weights import TensorSpec, all_tensor_specs, layer_prefix
from moe_export.quantize import transforms

_TORCH_TO_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}


@dataclass
class OutTensor:
    """One tensor of the rank file: its header entry and a generator of byte chunks in order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _sharded_shape(spec: TensorSpec, mapping: Mapping) -> tuple[int, ...]:
    return tuple(shard_tensor(spec, torch.empty(spec.shape, device="meta"), mapping).shape)


def expert_stack_name(cfg: ModelConfig, layer: int, what: str) -> str:
    """Name of a stacked expert tensor: what in w13_packed, w13_scale, w2_packed, w2_scale."""
    return f"{layer_prefix(cfg, layer)}block_sparse_moe.experts.{what}"


def plan_rank_tensors(reader, cfg: ModelConfig, mapping: Mapping, allow_nonfinite: bool,
                      reports: list[transforms.QuantReport]) -> list[OutTensor]:
    """Every tensor of this rank's file, in file order, with a lazy producer for its data."""
    out: list[OutTensor] = []
    for spec in all_tensor_specs(cfg, include_experts=False):

        def produce(spec=spec) -> Iterator[torch.Tensor]:
            t = reader.get(spec.name)
            if not allow_nonfinite and t.is_floating_point():
                transforms.check_finite(spec.name, t)
            yield shard_tensor(spec, t, mapping)

        out.append(OutTensor(spec.name, spec.dtype, _sharded_shape(spec, mapping), produce))
    experts = list(mapping.local_experts(cfg.num_experts)) if cfg.num_experts else []
    d, i = cfg.expert_in_dim, cfg.moe_intermediate_size
    for layer in range(cfg.num_layers):
        if not cfg.is_moe(layer):
            continue
        shapes = {
            "w13_packed": (len(experts), 2 * i, d // 2),
            "w13_scale": (len(experts), 2 * i, d // 32),
            "w2_packed": (len(experts), d, i // 2),
            "w2_scale": (len(experts), d, i // 32),
        }
        for what, shape in shapes.items():

            def produce(layer=layer, what=what) -> Iterator[torch.Tensor]:
                record = what == "w13_packed" or what == "w2_packed"
                for e in experts:
                    fused = transforms.expert_mxfp4(reader, cfg, layer, e, fuse_gate_up=what.startswith("w13"),
                                                    allow_nonfinite=allow_nonfinite)
                    if record:
                        reports.extend(fused.reports)
                    yield fused.packed if what.endswith("packed") else fused.scales

            out.append(OutTensor(expert_stack_name(cfg, layer, what), "U8", shape, produce))
    return out


def write_safetensors_stream(tensors: list[OutTensor], path: Path, metadata: dict[str, str],
                             progress: Callable[[int], None] | None = None) -> None:
    """Write a safetensors file tensor by tensor: header first (from the planned shapes), then data."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            written = 0
            for chunk in t.chunks():
                if _TORCH_TO_ST.get(chunk.dtype) != t.dtype:
                    raise InputError(f"{t.name}: produced dtype {chunk.dtype}, expected {t.dtype}")
                data = chunk.contiguous().view(torch.uint8).numpy().tobytes() if chunk.dtype != torch.uint8 \
                    else chunk.contiguous().numpy().tobytes()
                f.write(data)
                written += len(data)
                if progress:
                    progress(len(data))
            if written != t.nbytes:
                raise InputError(f"{t.name}: wrote {written} bytes, expected {t.nbytes} (shape {list(t.shape)})")
        f.flush()
        os.fsync(f.fileno())


def convert_rank(reader, cfg: ModelConfig, recipe, mapping: Mapping, out_path: Path,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Stream, shard and quantize the checkpoint into this rank's safetensors file at `out_path`.
    Returns a JSON-able quantization report: per-tensor entries and a summary."""
    if recipe.quantization.dense == "fp8" or recipe.quantization.attention == "fp8" or \
            recipe.quantization.shared_experts == "fp8":
        if recipe.backend == "onnxruntime":
            raise InputError(
                f"recipe {recipe.name}: fp8 dense/attention/shared weights need the tensorrt backend; "
                "the onnxruntime CPU backend runs them in bf16 (set quantization.dense/attention/shared_experts: bf16)"
            )
    reports: list[transforms.QuantReport] = []
    tensors = plan_rank_tensors(reader, cfg, mapping, recipe.quantization.allow_nonfinite, reports)
    meta = {"format": "moe-export-rank", "rank": str(mapping.rank), "mapping": json.dumps(mapping.to_dict(), sort_keys=True)}
    write_safetensors_stream(tensors, Path(out_path), meta, progress)
    entries = [r.to_dict() for r in reports]
    finite = [e["sqnr_db"] for e in entries if e.get("sqnr_db") is not None]
    summary = {
        "quantized_tensors": len(entries),
        "min_sqnr_db": min(finite) if finite else None,
        "mean_sqnr_db": sum(finite) / len(finite) if finite else None,
        "max_abs_err": max((e["max_abs_err"] for e in entries if e.get("max_abs_err") is not None), default=None),
    }
    return {"tensors": entries, "summary": summary}


def rank_tensor_bytes(cfg: ModelConfig, mapping: Mapping) -> int:
    """Total bytes of a rank's weights file's data section (for progress bars)."""
    return sum(t.nbytes for t in plan_rank_tensors(None, cfg, mapping, True, []))
