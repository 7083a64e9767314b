"""FP8 cache rows (`quantize/fp8_cache.py`): E4M3 codes + one E8M0 scale byte per row.

Oracles: ml_dtypes' float8_e4m3fn (the OCP E4M3 "fn" format, nobody here wrote it) for the code values and for
rounding; the exponent rule is checked by its definition; the graph's ONNX rounding is run in ONNX Runtime and
must equal `round_rows` bit for bit, because the runtime stores what the graph rounded.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper
from safetensors.torch import save_file

from moe_export.quantize import fp8_cache


def rows_of_every_magnitude(seed: int = 0, n: int = 400, dim: int = 72) -> torch.Tensor:
    """[n, dim] fp32 rows, each N(0, 1) scaled by 2^k with k in [-140, 120], plus edge rows: all zero, one
    subnormal, exactly 448, just above 448, a single non-zero value."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=gen) * torch.exp2(torch.randint(-140, 121, (n, 1), generator=gen).float())
    rows[0] = 0.0
    rows[1] = 0.0
    rows[1, 3] = 1e-42  # an fp32 subnormal
    rows[2] = 448.0
    rows[3] = 448.0001
    rows[4] = 0.0
    rows[4, -1] = -3.0
    return rows


def test_code_table_is_ocp_e4m3fn():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = fp8_cache.code_table()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2  # 0x7F, 0xFF
    assert np.array_equal(np.nan_to_num(got), np.nan_to_num(want)) and np.nanmax(got) == 448.0
    scales = fp8_cache.scale_table()
    assert np.isnan(scales[255]) and all(scales[b] == np.float32(2.0 ** (b - 127)) for b in range(255))


def test_exponent_is_the_smallest_that_fits_the_row():
    rows = rows_of_every_magnitude()
    e = fp8_cache.row_exponents(rows).double()[:, 0]
    amax = rows.abs().amax(dim=-1).double()
    assert ((-127 <= e) & (e <= 127)).all()
    assert (amax <= 448 * torch.exp2(e)).all(), "a row would saturate"
    assert ((e == -127) | (amax > 448 * torch.exp2(e - 1))).all(), "a smaller exponent would fit"
    assert e[0] == -127 and e[2] == 0 and e[3] == 1


def test_encode_rounds_like_ml_dtypes_and_packs_the_scale_byte():
    rows = rows_of_every_magnitude(seed=1)
    packed = fp8_cache.encode_rows(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (rows.shape[0], rows.shape[1] + 1)
    e = fp8_cache.row_exponents(rows)
    assert torch.equal(packed[:, -1:].to(torch.int32), e + 127)
    scaled = (rows * torch.exp2(-e.float())).numpy()
    want_codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(packed[:, :-1].numpy(), want_codes)
    want = want_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.exp2(e.numpy().astype(np.float32))
    assert np.array_equal(fp8_cache.decode_rows(packed).numpy(), want)


def test_rounded_rows_are_stored_exactly_and_errors_are_e4m3_sized():
    rows = rows_of_every_magnitude(seed=2)
    rounded = fp8_cache.round_rows(rows)
    assert torch.equal(fp8_cache.round_rows(rounded), rounded)  # the runtime re-encodes what the graph rounded
    unclamped = fp8_cache.row_exponents(rows) > -127  # rows whose exponent is not at the bottom of E8M0
    big = (rows.abs() >= rows.abs().amax(dim=-1, keepdim=True) / 64) & unclamped  # E4M3 normals: >= 2^-6 of the max
    rel = ((rounded - rows).abs() / rows.abs())[big]
    assert big.sum() > 10_000
    assert float(rel.max()) <= 2.0**-4  # half a step of 3 mantissa bits
    assert torch.equal(rounded[0], torch.zeros_like(rounded[0]))


def test_non_finite_rows_decode_as_nan():
    rows = torch.ones(3, 8)
    rows[1, 2] = float("nan")
    rows[2, 5] = float("inf")
    packed = fp8_cache.encode_rows(rows)
    assert packed[0, -1] == 127 - 8 and packed[1, -1] == packed[2, -1] == fp8_cache.E8M0_NAN
    decoded = fp8_cache.decode_rows(packed)
    assert torch.equal(decoded[0], rows[0]) and decoded[1:].isnan().all()


def test_graph_rounding_equals_round_rows_bit_for_bit(tmp_path):
    """The exporter's ONNX rounding of new cache rows (`RankGraph.round_to_storage` for kv_cache fp8), run in
    ONNX Runtime, gives exactly `round_rows`: Log's inexact log2 is corrected to the exact exponent."""
    from moe_export.export.convert.synth import preset_config
    from moe_export.graphs.onnx_export import ONNX_OPSET, RankGraph
    from moe_export.graphs.sharding import Mapping

    save_file({}, str(tmp_path / "weights.safetensors"))
    graph = RankGraph(preset_config("tiny-k3"), Mapping(1, 0, 1, 1), tmp_path / "weights.safetensors", kv_cache="fp8")
    out = graph.round_to_storage("rows", "rounded")
    model = helper.make_model(
        helper.make_graph(graph.g.nodes, "round", [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["T", "D"])],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["T", "D"])], graph.g.initializers),
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
    )  # fmt: skip
    onnx.checker.check_model(model, full_check=True)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rows = torch.cat([rows_of_every_magnitude(seed=3), torch.exp2(torch.arange(-126.0, 120.0))[:, None] * 448 * torch.ones(1, 72)])
    got = torch.from_numpy(sess.run(None, {"rows": rows.numpy()})[0])
    want = fp8_cache.round_rows(rows)
    assert torch.equal(got, want), float((got - want).abs().max())


@pytest.mark.parametrize("shape", [(5, 577), (2, 3, 4, 129)])
def test_decode_keeps_leading_dims(shape):
    packed = torch.randint(0, 256, shape, dtype=torch.int32).to(torch.uint8)
    packed[..., -1] = torch.randint(100, 150, shape[:-1], dtype=torch.int32).to(torch.uint8)
    decoded = fp8_cache.decode_rows(packed)
    assert decoded.shape == (*shape[:-1], shape[-1] - 1) and decoded.dtype == torch.float32
    table = torch.from_numpy(fp8_cache.code_table())[packed[..., :-1].long()]
    scale = torch.exp2(packed[..., -1:].float() - 127)
    assert torch.equal(decoded.nan_to_num(), (table * scale).nan_to_num())
