"""The dp decode-step model `plan` prints (`export/plan/decode_model.py`) against the code it describes: the expert op's
chunks, kernel launches and programs counted through `moe_mxfp4_triton` itself on CPU (its kernels replaced
by recorders), and the per-layer Casts,
dispatches and receive bound read from a real dp rank graph."""

from __future__ import annotations

import math
import onnx
import torch
from moe_export.common.recipe import load_recipe
from moe_export.export.plan.decode_model import counted_moe_op, dp_decode_step, full_buffer_moe_op
from moe_export.export.plan.planner import make_plan, moe_all_to_all_bytes
from moe_export.export.convert.synth import preset_config
from moe_export.graphs.sharding import Mapping
from moe_export.plugins.moe_mxfp4 import sizes as moe_sizes
from moe_export.plugins.moe_mxfp4 import triton_kernel
from test_tensorrt_plugins import tiny_graphs  # noqa: F401  (module fixture: real tiny rank graphs)


class Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, grid))


def record_launches(monkeypatch, rows, k, dim, inter, local, budget, **counted):
    """[(kernel, grid)] of one `moe_mxfp4_triton` call over `rows` rows, its kernels replaced by recorders."""
    log: list = []
    for name in ("_pair_layout_kernel", "_moe_up_kernel", "_moe_act_kernel", "_moe_down_kernel", "_combine_kernel"):
        monkeypatch.setattr(triton_kernel, name, Recorder(log, name))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (rows, k), generator=gen)
    ids[:, 0] = torch.arange(rows) % local  # every chunk has pairs of this rank's experts
    weights = [torch.zeros(local, 2 * inter, dim // 2, dtype=torch.uint8), torch.zeros(local, 2 * inter, dim // 32, dtype=torch.uint8),
               torch.zeros(local, dim, inter // 2, dtype=torch.uint8), torch.zeros(local, dim, inter // 32, dtype=torch.uint8)]  # fmt: skip
    triton_kernel.moe_mxfp4_triton(torch.randn(rows, dim, generator=gen).bfloat16(), ids, torch.rand(rows, k, generator=gen),
                                   *weights, expert_offset=0, budget_bytes=budget, **counted)  # fmt: skip
    return log


def programs(log):
    return sum(math.prod(g) for _, g in log)


def test_expert_op_model_counts_what_moe_mxfp4_triton_does(monkeypatch):
    rows, k, dim, inter, local = 40, 2, 64, 32, 2
    budget = 4 * k * (dim + inter) * 8  # chunks of 8 rows
    log = record_launches(monkeypatch, rows, k, dim, inter, local, budget)
    model = full_buffer_moe_op(rows, k, dim, inter, local, budget)
    assert model["chunks"] == 5 == sum(e[0] == "_combine_kernel" for e in log)
    assert model["kernel_launches"] == len(log)
    assert model["kernel_programs"] == programs(log)
    assert model["partial_sum_bytes"] == 2 * rows * k * dim * 4


def test_counted_expert_op_model_counts_what_moe_mxfp4_triton_does(monkeypatch):
    """recv_counts mode: the launches and their grids depend on row_bound alone, not on the buffer's rows, and
    are what `counted_moe_op` says; the full-buffer op over the big buffer launches far more."""
    k, dim, inter, local, bound = 2, 64, 32, 4, 20
    budget = 4 * k * (dim + inter) * 8  # chunks of 8 rows
    counted = dict(recv_counts=torch.tensor([3, 0, 4]), row_bound=bound)
    logs = {rows: record_launches(monkeypatch, rows, k, dim, inter, local, budget, **counted) for rows in (24, 400)}
    assert logs[24] == logs[400]
    model = counted_moe_op(bound, k, dim, inter, local, budget)
    log = logs[400]
    assert model["chunks"] == 3 == sum(e[0] == "_combine_kernel" for e in log)
    # per chunk: pair layout, up (K split in two: 2 experts x 1 N tile < 132 SMs), its activation, down, combine
    assert model["kernel_launches"] == len(log) == 15 and model["kernel_programs"] == programs(log)
    up = [g for name, g in log if name == "_moe_up_kernel"]
    assert up[0][0] == min(local, moe_sizes.pair_capacity(8 * k, local, 16) // 16)  # one program row per expert
    assert model["full_buffer_passes"] == 0 and model["output_bytes"] == bound * dim * 2
    full = full_buffer_moe_op(400, k, dim, inter, local, budget)
    assert full["kernel_programs"] == programs(record_launches(monkeypatch, 400, k, dim, inter, local, budget))
    assert full["kernel_programs"] > 10 * model["kernel_programs"] and full["kernel_launches"] > 10 * len(log)


def test_dp_step_model_matches_the_dp_graph_and_buffer_sizes(tiny_graphs):  # noqa: F811
    recipe, _ = load_recipe("tiny-cpu.yaml")
    recipe = recipe.model_copy(update={
        "backend": "tensorrt", "target": recipe.target.model_copy(update={"gpu": "h100", "gpus_per_node": 8, "memory_gib": 4.0}),
        "parallel": recipe.parallel.model_copy(update={"tp": 2, "ep": 8, "attention": "dp"})})  # fmt: skip
    cfg, mapping = preset_config("tiny-k3"), Mapping(8, 3, 2, 8, "dp")
    model = dp_decode_step(cfg, recipe, mapping)
    graph = onnx.load(str(tiny_graphs[4]), load_external_data=False)  # tiny-k3, rank 3 of the same mapping
    nodes = {n.name: n for n in graph.graph.node}
    producers = {o: n for n in graph.graph.node for o in n.output}
    consumers = {i: n for n in graph.graph.node for i in n.input}
    dispatches = [n for n in graph.graph.node if n.op_type == "MoEDispatch"]
    assert model["moe_layers"] == len(dispatches) > 0
    for d in dispatches:
        assert {a.name: a.i for a in d.attribute}["max_recv_rows"] == model["per_layer"]["receive_rows"]
    for n in nodes.values():  # the expert op reads the received rows as they are, their count from the dispatch
        if n.op_type == "MoEMXFP4":
            dispatch = producers[n.input[0]]
            assert dispatch.op_type == "MoEDispatch" and n.input[7] == dispatch.output[5]
            assert consumers[n.output[0]].op_type == "MoECombine"
    layer = model["per_layer"]
    rows, dim, k = layer["receive_rows"], cfg.expert_in_dim, cfg.num_experts_per_token
    assert rows == mapping.max_recv_rows(recipe.limits.max_num_tokens)
    assert layer["block_rows"] == -(-recipe.limits.max_batch // 2) and layer["rows_bound"] == 8 * layer["block_rows"]
    local = len(mapping.local_experts(cfg.num_experts))
    assert layer["expert_op"] == counted_moe_op(layer["rows_bound"], k, dim, cfg.moe_intermediate_size, local)
    # the all-to-all workspace the planner sets aside holds the received rows and the bf16 partial sums at R rows
    assert moe_all_to_all_bytes(cfg, mapping, recipe.limits.max_num_tokens) >= rows * dim * (2 + 2) + rows * k * 12
    step = model["per_step"]
    assert layer["host_syncs"] == 0 and layer["full_buffer_passes"] == 0 and step["full_buffer_passes"] == 0
    assert step["host_syncs"] == 1 <= 2 and model["eager_step_host_syncs"] == model["moe_layers"] + 1
    assert make_plan(recipe).to_dict()["dp_decode_step"] == dp_decode_step(cfg, recipe, Mapping(8, 0, 2, 8, "dp"))


def test_h100x64_dp_decode_step_has_no_host_sync_per_layer_and_no_full_buffer_pass(capsys):
    """`plan --recipe h100x64.yaml --json`: a dp decode step waits once, passes over no full receive buffer, and its
    expert op launches what `counted_moe_op` says at blocks of ceil(24 / 8) = 3 rows from 64 ranks."""
    import json

    from conftest import run_cli

    code, out, err = run_cli(capsys, "plan", "--recipe", "h100x64.yaml", "--json")
    assert code in (0, None), err
    step = json.loads(out)["dp_decode_step"]
    layer = step["per_layer"]
    assert step["per_step"]["host_syncs"] <= 2 and step["per_step"]["full_buffer_passes"] == 0
    assert layer["rows_bound"] == 64 * 3 == 192 and layer["receive_rows"] == 65536
    assert layer["expert_op"]["kernel_launches"] == 4 and layer["expert_op"]["chunks"] == 1
    # the expert op's 4, the transport's 5 Triton kernels (route, pack, unpack; expand, sum), 1 aten copy (the
    # routed counts) and 3 collectives
    assert layer["launches_at_most"] == 4 + 5 + 3


def test_gpu_dp_step_check_dry_run_counts_the_transport_the_model_names(tmp_path):
    """`benchmarks/gpu_dp_step_check.py --device cpu` (gloo, Triton's interpreter): the dp MoE layer in the block
    transport reads no tensor on the host, equals the counted transport, leaves padding tokens' rows 0, and its
    dispatch and combine launch the Triton kernels, device ops and collectives `decode_model.TRANSPORT_OPS` counts."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from moe_export.export.plan.decode_model import TRANSPORT_OPS

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "dp.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(repo / "benchmarks" / "gpu_dp_step_check.py"), "--device", "cpu",
                          "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not [k for k in result if k.endswith("_error")], result  # every stage ran
    assert result["dp_layer_no_host_sync"] and result["dp_layer_padding_rows_zero"]
    # exact: at ep = 1 both transports hand the same rows, in the same order and tiles, to the same kernels
    assert result["dp_layer_vs_counted_max_err"] == 0.0
    counted = {key: value for key, value in result["dp_layer_transport_ops"].items() if key != "names"}
    assert counted == TRANSPORT_OPS
    assert result["dp_layer_transport_ops"]["names"]["kernels"] == ["_route_kernel", "_pack_kernel", "_unpack_kernel",
                                                                    "_expand_kernel", "_sum_kernel"]


def test_gpu_trt_check_dry_run_on_cpu(tmp_path):
    """The prepared GPU measurement (`benchmarks/gpu_trt_check.py`) runs its code at tiny shapes on CPU (Triton's
    interpreter) and writes the keys the GPU run reports."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "trt.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(repo / "benchmarks" / "gpu_trt_check.py"), "--device", "cpu",
                          "--repeats", "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not [k for k in result if k.endswith("_error")], result  # every stage ran
    assert result["dp_moe_full_buffer_ms"] > 0 and result["model"]["chunks"] == 1
    assert result["model_pass_bytes"] == 64 * 2 * 64 * 4 * 2 + 64 * 64 * 2  # fp32 partial sums, bf16 output
    assert result["dp_moe_counted_ms"] > 0
    assert result["dp_moe_counted_decode_tiles_ms"] > 0 and result["decode_tiles"]["block_m"] == 16
    assert result["dp_moe_counted_speedup"] == result["dp_moe_full_buffer_ms"] / result["dp_moe_counted_ms"]
    assert result["counted_model"] == counted_moe_op(8, 2, 64, 32, 2) and result["shapes"]["row_bound"] == 8
    # both runs bf16 in and out: only the order of the fp32 partial sums may differ, then one bf16 rounding (2^-8)
    assert 0 <= result["dp_moe_counted_max_rel_diff"] < 2e-2
