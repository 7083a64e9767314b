"""The vision tower + projector as its own ONNX graph (opset 21), one copy per rank (the tower is replicated).

  inputs   pixel_values [L, 3*p*p] fp32 (the patches of every image of the call, image after image, each
           image's patches row-major; `ImageProcessor` order), cu_seqlens [N+1] int64 (patch offsets of the
           N images), pos_index / pos_weight [L, 4] (int64 / fp32: the bilinear taps of the resized position
           table, `graphs.vision.position_taps`), rope_cos / rope_sin [L, head_dim/2] fp32 (2-D RoPE angles,
           `graphs.vision.rope_angles`), merge_index [M, 4] int64 (the 4 patch rows of each merged token,
           (kh, kw) order)
  outputs  image_embeds [M, text hidden] fp32, images in order, each image's tokens row-major

Everything image-size dependent is geometry the runtime computes from the grids (`tower_inputs`), so the graph
has no per-image shape logic; attention runs in a Loop over the images (rows cu_seqlens[i]..cu_seqlens[i+1]),
so it never crosses images and holds one image's scores at a time. Weights are the checkpoint's bf16 tensors
in the rank's `vision.safetensors` (external data), cast to fp32 in the graph (ONNX Runtime folds the casts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from moe_export.graphs.onnx_builder import ONNX_OPSET, GraphBuilder, graph_summary
from moe_export.graphs.vision import (
    PROJECTOR_PREFIX, TOWER_PREFIX, VisionConfig, position_taps, rope_angles,
)

VISION_GRAPH = "vision.onnx"
VISION_WEIGHTS = "vision.safetensors"


def tower_inputs(vc: VisionConfig, pixel_values: np.ndarray, grids: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """The graph's feeds for images with patch grids `grids` ((t, h, w) each) and their packed patches."""
    cu, pos_i, pos_w, angles, merge = [0], [], [], [], []
    for t, h, w in grids:
        start = cu[-1]
        idx, wts = position_taps(vc, h, w)
        pos_i.append(idx)
        pos_w.append(wts)
        angles.append(rope_angles(h, w, vc.head_dim, t))
        r, c = np.meshgrid(np.arange(0, h, 2), np.arange(0, w, 2), indexing="ij")
        top = (r * w + c).reshape(-1, 1)
        merge.append(start + np.concatenate([top, top + 1, top + w, top + w + 1], axis=1))
        cu.append(start + t * h * w)
    ang = torch.cat(angles) if angles else torch.zeros(0, vc.head_dim // 2)
    return {
        "pixel_values": np.ascontiguousarray(pixel_values.reshape(pixel_values.shape[0], -1), dtype=np.float32),
        "cu_seqlens": np.asarray(cu, dtype=np.int64),
        "pos_index": torch.cat(pos_i).numpy() if pos_i else np.zeros((0, 4), np.int64),
        "pos_weight": torch.cat(pos_w).numpy() if pos_w else np.zeros((0, 4), np.float32),
        "rope_cos": ang.cos().numpy(),
        "rope_sin": ang.sin().numpy(),
        "merge_index": np.concatenate(merge).astype(np.int64) if merge else np.zeros((0, 4), np.int64),
    }


class TowerGraph:
    def __init__(self, vc: VisionConfig, weights_path: Path, norm_eps: float):
        self.vc, self.eps = vc, norm_eps
        self.g = GraphBuilder(Path(weights_path), TensorProto.FLOAT)
        self.inputs: list[onnx.ValueInfoProto] = []

    def _input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def rope(self, x: str, cos: str, sin: str, name: str) -> str:
        """x [L, H, hd]: complex pairs (2k, 2k+1) rotated by angle k."""
        g, vc = self.g, self.vc
        half = vc.head_dim // 2
        pairs = g.reshape(x, [0, vc.num_heads, half, 2], f"{name}.pairs")
        even, odd = g.op("Split", [pairs, g.const([1, 1])], f"{name}.split", n_out=2, axis=-1)
        c = g.op("Unsqueeze", [cos, g.const([1, 3])], f"{name}.cos")
        s = g.op("Unsqueeze", [sin, g.const([1, 3])], f"{name}.sin")
        re = g.op("Sub", [g.op("Mul", [even, c], f"{name}.ec"), g.op("Mul", [odd, s], f"{name}.os")], f"{name}.re")
        im = g.op("Add", [g.op("Mul", [even, s], f"{name}.es"), g.op("Mul", [odd, c], f"{name}.oc")], f"{name}.im")
        return g.reshape(g.op("Concat", [re, im], f"{name}.cat", axis=-1), [0, vc.num_heads, vc.head_dim], name)

    def attention(self, q: str, k: str, v: str, cu: str, name: str) -> str:
        """Per-image softmax(q k^T / sqrt(hd)) v in a Loop over the images: [L, H, hd] -> [L, H*hd]."""
        g, vc = self.g, self.vc
        width = vc.num_heads * vc.head_dim
        rows = g.op("Gather", [g.op("Shape", [q], f"{name}.shape"), g.const(0)], f"{name}.rows", axis=0)
        acc0 = g.op("ConstantOfShape", [g.op("Concat", [g.op("Unsqueeze", [rows, g.const([0])], f"{name}.rows1"),
                                                        g.const([width])], f"{name}.acc_shape", axis=0)],
                    f"{name}.acc0", value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
        trips = g.op("Sub", [g.op("Gather", [g.op("Shape", [cu], f"{name}.cu_shape"), g.const(0)], f"{name}.n1", axis=0),
                             g.const(1)], f"{name}.images")
        one, zero1 = g.const([1]), g.const([0])
        scale = g.const(vc.head_dim ** -0.5, np.float32, "attn_scale")
        b = f"{name}.body"
        nodes = [
            helper.make_node("Unsqueeze", ["i", zero1], [f"{b}.i1"]),
            helper.make_node("Add", [f"{b}.i1", one], [f"{b}.i2"]),
            helper.make_node("Gather", [cu, f"{b}.i1"], [f"{b}.start"], axis=0),
            helper.make_node("Gather", [cu, f"{b}.i2"], [f"{b}.end"], axis=0),
        ]
        for t in ("q", "k", "v"):
            src = {"q": q, "k": k, "v": v}[t]
            nodes.append(helper.make_node("Slice", [src, f"{b}.start", f"{b}.end", zero1], [f"{b}.{t}_rows"]))
            nodes.append(helper.make_node("Transpose", [f"{b}.{t}_rows"], [f"{b}.{t}"], perm=[1, 0, 2]))  # [H, Li, hd]
        nodes += [
            helper.make_node("Transpose", [f"{b}.k"], [f"{b}.kt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", [f"{b}.q", f"{b}.kt"], [f"{b}.scores_raw"]),
            helper.make_node("Mul", [f"{b}.scores_raw", scale], [f"{b}.scores"]),
            helper.make_node("Softmax", [f"{b}.scores"], [f"{b}.probs"], axis=-1),
            helper.make_node("MatMul", [f"{b}.probs", f"{b}.v"], [f"{b}.o"]),
            helper.make_node("Transpose", [f"{b}.o"], [f"{b}.o_rows"], perm=[1, 0, 2]),
            helper.make_node("Reshape", [f"{b}.o_rows", g.const([0, width])], [f"{b}.o_flat"]),
            helper.make_node("Squeeze", [f"{b}.start", zero1], [f"{b}.s0"]),
            helper.make_node("Squeeze", [f"{b}.end", zero1], [f"{b}.e0"]),
            helper.make_node("Range", [f"{b}.s0", f"{b}.e0", g.const(1)], [f"{b}.range"]),
            helper.make_node("Unsqueeze", [f"{b}.range", g.const([1])], [f"{b}.idx"]),
            helper.make_node("ScatterND", ["acc", f"{b}.idx", f"{b}.o_flat"], ["acc_out"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
        ]
        body = helper.make_graph(
            nodes, b,
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
             helper.make_tensor_value_info("acc", TensorProto.FLOAT, ["L", width])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, ["L", width])],
        )
        cond = g.const(True, np.bool_, "true")
        return g.op("Loop", [trips, cond, acc0], name, body=body)

    def build(self) -> onnx.ModelProto:
        g, vc, eps = self.g, self.vc, self.eps
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        p, d = vc.patch_size, vc.hidden_size
        px = self._input("pixel_values", f32, ["L", 3 * p * p])
        cu = self._input("cu_seqlens", i64, ["N_plus_1"])
        pidx = self._input("pos_index", i64, ["L", 4])
        pw = self._input("pos_weight", f32, ["L", 4])
        cos = self._input("rope_cos", f32, ["L", vc.head_dim // 2])
        sin = self._input("rope_sin", f32, ["L", vc.head_dim // 2])
        midx = self._input("merge_index", i64, ["M", 4])
        t = TOWER_PREFIX
        proj = g.reshape(g.weight(t + "patch_embed.proj.weight"), [d, 3 * p * p], "patch_embed.w")
        x = g.op("Gemm", [px, proj], "patch_embed", transB=1)
        table = g.reshape(g.weight(t + "patch_embed.pos_emb.weight"), [vc.pos_emb_height * vc.pos_emb_width, d], "pos.table")
        taps = g.op("Mul", [g.op("Gather", [table, pidx], "pos.taps", axis=0),
                            g.op("Unsqueeze", [pw, g.const([-1])], "pos.w")], "pos.weighted")
        x = g.op("Add", [x, g.op("ReduceSum", [taps, g.const([1])], "pos", keepdims=0)], "embed")
        for i in range(vc.num_layers):
            b, n = f"{t}encoder.blocks.{i}.", f"blocks.{i}"
            qkv = g.reshape(g.linear(g.rms_norm(x, b + "norm0.weight", eps, f"{n}.norm0"), b + "wqkv.weight", f"{n}.wqkv"),
                            [0, 3, vc.num_heads, vc.head_dim], f"{n}.qkv")
            q, k, v = (g.op("Gather", [qkv, g.const(j)], f"{n}.{w}", axis=1) for j, w in enumerate("qkv"))
            att = self.attention(self.rope(q, cos, sin, f"{n}.q_rope"), self.rope(k, cos, sin, f"{n}.k_rope"), v, cu, f"{n}.attn")
            x = g.op("Add", [x, g.linear(att, b + "wo.weight", f"{n}.wo")], f"{n}.attn_residual")
            h = g.linear(g.rms_norm(x, b + "norm1.weight", eps, f"{n}.norm1"), b + "mlp.fc0.weight", f"{n}.fc0")
            h = g.linear(g.op("Gelu", [h], f"{n}.gelu", approximate="tanh"), b + "mlp.fc1.weight", f"{n}.fc1")
            x = g.op("Add", [x, h], f"{n}.mlp_residual")
        x = g.rms_norm(x, t + "encoder.final_layernorm.weight", eps, "final_norm")
        merged = g.reshape(g.op("Gather", [x, midx], "merge.gather", axis=0), [0, vc.merged_dim], "merge")
        y = g.op("Gelu", [g.linear(merged, PROJECTOR_PREFIX + "proj.0.weight", "proj.0")], "proj.gelu", approximate="none")
        y = g.linear(y, PROJECTOR_PREFIX + "proj.2.weight", "proj.2")
        y = g.rms_norm(y, PROJECTOR_PREFIX + "post_norm.weight", vc.projector_eps, "post_norm")
        out = g.op("Identity", [y], "image_embeds.identity", out_names={0: "image_embeds"})
        outputs = [helper.make_tensor_value_info(out, f32, ["M", vc.text_hidden_size])]
        graph = helper.make_graph(g.nodes, "vision_tower", self.inputs, outputs, g.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], producer_name="moe-export")
        model.ir_version = 10
        return model


def write_vision_weights(src, vc: VisionConfig, out_path: Path) -> None:
    """The tower's tensors as the checkpoint stores them (bf16, never quantized) in `out_path`."""
    from safetensors.torch import save_file

    from moe_export.graphs.vision import vision_tensor_specs

    save_file({s.name: src.get(s.name).to(torch.bfloat16).contiguous() for s in vision_tensor_specs(vc)}, str(out_path))


def export_vision_graph(vc: VisionConfig, weights_path: Path, out_path: Path, norm_eps: float) -> dict:
    """Write the tower graph to `out_path` (its initializers point into `weights_path`, in the same folder)."""
    model = TowerGraph(vc, Path(weights_path), norm_eps).build()
    Path(out_path).write_bytes(model.SerializeToString(deterministic=True))
    return graph_summary(model)
