"""fp8 cache rows rounded in ONNX ops (the exporter's `kv_cache: fp8`): the graph's new cache rows are rounded to
what the pool stores (`moe_export.quantize.fp8_cache`: E4M3 codes times a per-row power of two), so the step's
readers see the same rows as later steps read back.

The E4M3 rounding is a QuantizeLinear / DequantizeLinear pair of unit per-tensor scale and a float8e4m3fn zero
point, never a Cast to FLOAT8E4M3FN: TensorRT refuses casts to FP8 and Q/DQ scales of dynamic shape (contracts
CAST_TO_FP8_REJECTED and QDQ_STATIC_SYMMETRIC, `plugins/tensorrt_contracts.py`), so the per-row scale 2^e is a
Mul on either side (exact for powers of two). ONNX Runtime rounds both forms the same (saturating, nearest even).
"""

from __future__ import annotations

import numpy as np
from moe_export.quantize import fp8_cache


def round_to_fp8_rows(g, rows: str, name: str) -> str:
    """`fp8_cache.round_rows` in ONNX ops appended to `g` (`onnx_builder.GraphBuilder`): rows [T, D] fp32 ->
    E4M3(rows / 2^e) * 2^e with the row exponent e [T, 1] = the smallest integer in [-127, 127] with
    max|row| <= 448 * 2^e (Log's rounding corrected by one exact step either way)."""

    def f32(v: float) -> str:
        return g.const(v, np.float32, "fp8_rows")

    def pow2(e: str, tag: str) -> str:
        return g.op("Pow", [f32(2.0), e], f"{name}.{tag}")

    amax = g.op("ReduceMax", [g.op("Abs", [rows], f"{name}.abs"), g.const([-1])], f"{name}.amax", keepdims=1)
    limit = f32(fp8_cache.E4M3_MAX)
    e = g.op("Ceil", [g.op("Div", [g.op("Log", [g.op("Div", [amax, limit], f"{name}.over_max")], f"{name}.ln"),
                                  f32(float(np.log(2.0)))], f"{name}.log2")], f"{name}.e_guess")
    e = g.op("Clip", [e, f32(-127.0), f32(127.0)], f"{name}.e_clipped")
    lower = g.op("Sub", [e, f32(1.0)], f"{name}.e_lower")
    step_down = g.op("And", [g.op("Greater", [e, f32(-127.0)], f"{name}.above_min"),
                             g.op("LessOrEqual", [amax, g.op("Mul", [limit, pow2(lower, "lower_scale")], f"{name}.lower_max")],
                                  f"{name}.fits_lower")], f"{name}.step_down")
    e = g.op("Where", [step_down, lower, e], f"{name}.e_down")
    higher = g.op("Add", [e, f32(1.0)], f"{name}.e_higher")
    step_up = g.op("And", [g.op("Less", [e, f32(127.0)], f"{name}.below_max"),
                           g.op("Greater", [amax, g.op("Mul", [limit, pow2(e, "scale_guess")], f"{name}.max_guess")],
                                f"{name}.overflows")], f"{name}.step_up")
    e = g.op("Where", [step_up, higher, e], f"{name}.e")
    scaled = g.op("Mul", [rows, pow2(g.op("Neg", [e], f"{name}.neg_e"), "inv_scale")], f"{name}.scaled")
    # E4M3 rounding: a Q/DQ pair of unit scale (see the module docstring)
    unit = f32(1.0)
    zero = g.fp8_zero_point()
    codes = g.op("QuantizeLinear", [scaled, unit, zero], f"{name}.codes", saturate=1)
    values = g.op("DequantizeLinear", [codes, unit, zero], f"{name}.values")
    return g.op("Mul", [values, pow2(e, "scale")], name)
