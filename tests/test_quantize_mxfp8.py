"""MXFP8 codec vs torchao's MX encoder / dequantizer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_export.common.errors import InputError
from moe_export.quantize import mxfp8

NAN = float("nan")
INF = float("inf")


def torchao_mx8(x: torch.Tensor):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode

    return MXTensor.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)


def wide_range(shape: tuple[int, ...], seed: int, span: int = 60) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    k = torch.randint(-span, span, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    return (x.view(*shape[:-1], -1, 32) * torch.exp2(k)).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32,), (5, 64), (2, 3, 256), (129, 512)])
def test_encode_decode_match_torchao(shape, dtype):
    for seed in range(2):
        x = wide_range(shape, seed).to(dtype)
        d, s = mxfp8.encode(x)
        m = torchao_mx8(x)
        assert d.dtype == torch.float8_e4m3fn and d.shape == x.shape and s.shape == (*shape[:-1], shape[-1] // 32)
        assert torch.equal(s, as_bytes(m.scale))
        assert torch.equal(as_bytes(d), as_bytes(m.qdata))
        assert torch.equal(mxfp8.decode(d, s), m.dequantize(torch.float32))


def test_fp16_matches_torchao_via_fp32():
    x = wide_range((16, 128), 3, span=8).to(torch.float16)
    d, s = mxfp8.encode(x)
    m = torchao_mx8(x.float())
    assert torch.equal(as_bytes(d), as_bytes(m.qdata)) and torch.equal(s, as_bytes(m.scale))


def test_edge_blocks_match_torchao():
    rows = torch.zeros(5, 32)
    rows[1, :4] = torch.tensor([-0.0, 448.0, 500.0, -511.0])  # saturation, signed zero
    rows[2, :3] = torch.tensor([1e30, 1.0, -1e-30])  # huge outlier
    rows[3, :3] = torch.tensor([INF, -2.0, 3.0])
    rows[4, :3] = torch.tensor([2.0**-100, -(2.0**-110), 2.0**-149])
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype)
        d, s = mxfp8.encode(x)
        m = torchao_mx8(x)
        assert torch.equal(s, as_bytes(m.scale)) and torch.equal(as_bytes(d), as_bytes(m.qdata))
        assert s[3].item() == 247


def test_nan_block():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([NAN, 1.0, -1.0])
    x[1, 0] = 1.0
    d, s = mxfp8.encode(x)
    m = torchao_mx8(x)
    assert s.view(-1).tolist() == [255, 119] and torch.equal(s, as_bytes(m.scale))
    finite = torch.isfinite(x)
    assert torch.equal(as_bytes(d)[finite], as_bytes(m.qdata)[finite])
    assert torch.isnan(mxfp8.decode(d, s)[0]).all()


def test_tiny_block_follows_spec_scale():
    """amax in [2^-119, 2^-118): E8M0 byte 0 unclamped; codes equal torchao's for the block scaled by 2^100."""
    x = torch.rand(8, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x[:, 0] = 1.5
    x = x * 2.0**-119
    d, s = mxfp8.encode(x)
    m = torchao_mx8(x * 2.0**100)
    assert (s == 0).all() and (as_bytes(m.scale) == 100).all()
    assert torch.equal(as_bytes(d), as_bytes(m.qdata))


def test_errors():
    with pytest.raises(InputError, match=r"\(3, 40\)"):
        mxfp8.encode(torch.zeros(3, 40))
    with pytest.raises(InputError, match="do not match"):
        mxfp8.decode(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**60), max_value=2.0**60), min_size=32, max_size=32),
    st.integers(-80, 60),
)
def test_roundtrip_relative_error(vals, k):
    """E4M3 keeps 3 mantissa bits: |err| <= 2^-4 |x| for normal scaled values, <= 2^-10 * X (half the
    subnormal step) below them, and |x| - 448 X for the values in (448 X, 512 X) that saturate."""
    x = torch.tensor(vals, dtype=torch.float64).mul(2.0**k).float().view(1, 32)
    d, s = mxfp8.encode(x)
    xs = torch.exp2(s.double() - 127)
    err = (mxfp8.decode(d, s).double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, 2.0**-10 * xs)
    bound = torch.maximum(bound, x.double().abs() - 448 * xs)
    assert (err <= bound).all()
