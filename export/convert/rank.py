"""The convert stage: stream a checkpoint into one rank's `weights.safetensors`.

Non-expert tensors keep their on-disk HF names and dtypes; each rank reads only its tensor-parallel slice
of them (`graphs.sharding.shard_range`, safetensors slices of the memory map). Routed experts are stacked per MoE layer in the order of the
rank's expert ids, gate and up fused (`w13`: I gate rows then I up rows), as MXFP4:

    <layer>.block_sparse_moe.experts.w13_packed [E_local, 2I, D/2] U8   w13_scale [E_local, 2I, D/32] U8
    <layer>.block_sparse_moe.experts.w2_packed  [E_local, D, I/2]  U8   w2_scale  [E_local, D, I/32]  U8

For TensorRT engines (recipe backend `tensorrt`, whose MoE plugin runs the Triton kernels) the `*_packed` bytes are
in the kernel's layout (`plugins/moe_mxfp4/layout.py`: the bits of each 32-bit word placed for a cheap bf16 decode,
same shape and dtype, scales untouched and at most 2); the file's metadata says which (`mxfp4_layout`).

With `quantization.{dense,attention,shared_experts}: fp8`, those classes' 2-D weights are stored
FP8 E4M3 with fp32 128x128 block scales `<name>_scale_inv`, quantized per rank shard.

The header is computed up front from the tensor inventory, then tensor data is written one tensor
(one expert) at a time at its offset, so peak memory stays near the largest single tensor and each
source tensor is read once.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.sharding import Mapping, shard_range, shard_tensor
from moe_export.graphs.weights import (
    TensorSpec,
    all_tensor_specs,
    expert_tensor_specs,
    layer_prefix,
)
from moe_export.export.convert import transforms
from moe_export.plugins.moe_mxfp4 import layout as mxfp4_layout
from moe_export.quantize import fp8

_TORCH_TO_ST = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the rank file: its header entry (data offsets are assigned in list order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[self.dtype]
        for d in self.shape:
            n *= d
        return n


# A producer yields (tensor name, byte offset inside that tensor, data) pieces, in any order.
Producer = Callable[[], Iterator[tuple[str, int, torch.Tensor]]]


@dataclass
class Job:
    """A producer and the source tensors it reads (to order jobs by storage and release shards early)."""

    produce: Producer
    sources: list[str]


def _sharded_shape(spec: TensorSpec, mapping: Mapping) -> tuple[int, ...]:
    return tuple(shard_tensor(spec, torch.empty(spec.shape, device="meta"), mapping).shape)


def expert_stack_name(cfg: ModelConfig, layer: int, what: str) -> str:
    """Name of a stacked expert tensor: what in w13_packed, w13_scale, w2_packed, w2_scale."""
    return f"{layer_prefix(cfg, layer)}block_sparse_moe.experts.{what}"


def fp8_weight_classes(recipe) -> set[str]:
    """Weight classes whose 2-D bf16 weights the recipe stores as FP8 E4M3 with 128x128 block scales."""
    q = recipe.quantization
    chosen = {"dense": q.dense, "shared_experts": q.shared_experts, "kda": q.attention, "mla": q.attention,
              "indexer": q.attention}
    return {cls for cls, choice in chosen.items() if choice == "fp8"}


def fp8_scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv` (the DeepSeek / HF fine-grained FP8 convention)."""
    return name + "_scale_inv"


def plan_rank_tensors(reader, cfg: ModelConfig, mapping: Mapping, allow_nonfinite: bool,
                      reports: list[transforms.QuantReport], fp8_classes: frozenset[str] = frozenset(),
                      kernel_layout: bool = False) -> tuple[list[OutTensor], list[Job]]:
    """This rank's tensors in file order, and the producers that fill them (each source tensor read once).
    2-D BF16 weights of `fp8_classes` are quantized per shard to FP8 + `_scale_inv` block scales. With
    `kernel_layout` the experts' packed bytes are in the Triton kernel's layout (`mxfp4_layout.kernel_experts`,
    ValueError naming the tensor on a block scale above 2)."""
    tensors: list[OutTensor] = []
    jobs: list[Job] = []
    for spec in all_tensor_specs(cfg, include_experts=False):
        shape = _sharded_shape(spec, mapping)
        to_fp8 = spec.weight_class in fp8_classes and spec.dtype == "BF16" and len(shape) == 2

        def produce(spec=spec, to_fp8=to_fp8) -> Iterator[tuple[str, int, torch.Tensor]]:
            shard = reader.get_part(spec.name, shard_range(spec, mapping))  # only this rank's slice is read
            if not allow_nonfinite and shard.is_floating_point():
                transforms.check_finite(spec.name, shard)
            if to_fp8:
                q, scale_inv, report = transforms.quantize_fp8(spec.name, shard, allow_nonfinite)
                reports.append(report)
                yield spec.name, 0, q
                yield fp8_scale_name(spec.name), 0, scale_inv
            else:
                yield spec.name, 0, shard

        if to_fp8:
            grid = tuple(-(-d // fp8.FP8_BLOCK) for d in shape)
            tensors += [OutTensor(spec.name, "F8_E4M3", shape), OutTensor(fp8_scale_name(spec.name), "F32", grid)]
        else:  # a float tensor stored in another dtype keeps it (or is widened): see checkpoint.load_dtype
            tensors.append(OutTensor(spec.name, reader.load_dtype(spec.name), shape))
        jobs.append(Job(produce, [spec.name]))
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
        tensors.extend(OutTensor(expert_stack_name(cfg, layer, w), "U8", shape) for w, shape in shapes.items())

        def produce_experts(layer=layer, shapes=shapes) -> Iterator[tuple[str, int, torch.Tensor]]:
            for slot, e in enumerate(experts):
                for fused, what in ((True, "w13"), (False, "w2")):
                    q = transforms.expert_mxfp4(reader, cfg, layer, e, fuse_gate_up=fused,
                                                allow_nonfinite=allow_nonfinite)
                    reports.extend(q.reports)
                    packed = q.packed
                    if kernel_layout:
                        mxfp4_layout.check_scales(q.scales, f"layer {layer} expert {e} {what}")
                        packed = mxfp4_layout.to_kernel_layout(packed)
                    for part, data in (("packed", packed), ("scale", q.scales)):
                        yield expert_stack_name(cfg, layer, f"{what}_{part}"), slot * data.numel(), data

        sources = [s.name for e in experts for s in expert_tensor_specs(cfg, layer, e)]
        jobs.append(Job(produce_experts, sources))
    return tensors, jobs


def rank_source_bytes(reader, cfg: ModelConfig, mapping: Mapping) -> int:
    """Checkpoint bytes a rank's weights come from: its tensor-parallel slice of every non-expert tensor and
    its whole routed experts (what a converter of that rank must read at least)."""
    from moe_export.export.convert.checkpoint import SAFETENSORS_DTYPES

    total = 0
    for spec in all_tensor_specs(cfg, include_experts=False):
        part = shard_range(spec, mapping)
        numel = spec.numel if part is None else spec.numel // spec.shape[part[0]] * (part[2] - part[1])
        total += numel * SAFETENSORS_DTYPES[reader.stored(spec.name).dtype]
    for layer in range(cfg.num_layers):
        if cfg.is_moe(layer):
            for e in mapping.local_experts(cfg.num_experts):
                total += sum(reader.nbytes(s.name) for s in expert_tensor_specs(cfg, layer, e))
    return total


def storage_order(reader, jobs: list[Job]) -> Iterator[Job]:
    """Jobs in the order their first source is stored, closing each shard's memory map once every tensor
    this rank reads from it has been read (bounds file-backed memory to about one shard)."""
    files = {f: i for i, f in enumerate(reader.files)}

    def where(name: str) -> tuple[int, int]:
        stored = reader.stored(name)
        return files.get(stored.file, len(files)), stored.start

    remaining: dict[str, int] = {}
    for job in jobs:
        for name in job.sources:
            remaining[reader.stored(name).file] = remaining.get(reader.stored(name).file, 0) + 1
    for job in sorted(jobs, key=lambda j: min(where(n) for n in j.sources)):
        yield job
        for name in job.sources:
            file = reader.stored(name).file
            remaining[file] -= 1
            if remaining[file] == 0:
                reader.release(file)


def write_safetensors_stream(tensors: list[OutTensor], producers: Iterable[Producer], path: Path,
                             metadata: dict[str, str], progress: Callable[[int], None] | None = None) -> None:
    """Write a safetensors file piece by piece: the header (from the planned shapes) first, then each
    producer's pieces at their offsets. Every byte of every tensor must be written exactly once."""
    header: dict = {"__metadata__": metadata}
    offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offsets[t.name] = (offset, t.nbytes)
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    base = 8 + len(blob)
    dtypes = {t.name: t.dtype for t in tensors}
    written = dict.fromkeys(offsets, 0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(base + offset)
        fd = f.fileno()
        for produce in producers:
            for name, start, chunk in produce():
                if _TORCH_TO_ST.get(chunk.dtype) != dtypes[name]:
                    raise InputError(f"{name}: produced dtype {chunk.dtype}, expected {dtypes[name]}")
                data = memoryview(chunk.contiguous().view(torch.uint8).numpy()).cast("B")
                t_off, t_len = offsets[name]
                if start + len(data) > t_len:
                    raise InputError(f"{name}: piece at {start}+{len(data)} overflows the tensor's {t_len} bytes")
                os.pwrite(fd, data, base + t_off + start)
                written[name] += len(data)
                if progress:
                    progress(len(data))
        short = {n: (w, offsets[n][1]) for n, w in written.items() if w != offsets[n][1]}
        if short:
            raise InputError(f"{path}: tensors not completely written (written, expected bytes): {short}")
        os.fsync(fd)


def convert_rank(reader, cfg: ModelConfig, recipe, mapping: Mapping, out_path: Path,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Stream, shard and quantize the checkpoint into this rank's safetensors file at `out_path`.
    Returns a JSON-able quantization report: per-tensor entries and a summary."""
    reports: list[transforms.QuantReport] = []
    kernel_layout = recipe.backend == "tensorrt"  # the MoE plugin runs the Triton kernels
    tensors, jobs = plan_rank_tensors(reader, cfg, mapping, recipe.quantization.allow_nonfinite, reports,
                                      frozenset(fp8_weight_classes(recipe)), kernel_layout)
    producers = (job.produce for job in storage_order(reader, jobs))
    meta = {"format": "moe-export-rank", "rank": str(mapping.rank), "mapping": json.dumps(mapping.to_dict(), sort_keys=True),
            "mxfp4_layout": mxfp4_layout.KERNEL if kernel_layout else mxfp4_layout.STANDARD}
    write_safetensors_stream(tensors, producers, Path(out_path), meta, progress)
    entries = [r.to_dict() for r in reports]
    finite = [e["sqnr_db"] for e in entries if e.get("sqnr_db") is not None]
    summary = {
        "quantized_tensors": len(entries),
        "min_sqnr_db": min(finite) if finite else None,
        "mean_sqnr_db": sum(finite) / len(finite) if finite else None,
        "max_abs_err": max((e["max_abs_err"] for e in entries if e.get("max_abs_err") is not None), default=None),
    }
    return {"tensors": entries, "summary": summary, "source_dtypes": reader.dtype_report()}

