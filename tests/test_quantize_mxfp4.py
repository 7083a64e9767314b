"""MXFP4 codec vs independent oracles: torchao's MX encoder/dequantizer and transformers' gpt-oss decoder."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_export.common.errors import InputError
from moe_export.quantize import mxfp4

NAN = float("nan")
INF = float("inf")


def torchao_mx(x: torch.Tensor):
    """torchao MXTensor of fp32/bf16 x with the OCP FLOOR scale rule."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode

    return MXTensor.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)


def torchao_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = torchao_mx(x)
    return m.qdata.view(torch.uint8), m.scale.view(torch.uint8)


def gptoss_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss MXFP4 dequantizer, fp32, reshaped back to [..., n]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    nb = scales.shape[-1]
    out = convert_moe_packed_tensors(packed.reshape(1, -1, nb, 16), scales.reshape(1, -1, nb), dtype=torch.float32)
    return out.transpose(1, 2).reshape(*scales.shape[:-1], nb * 32)


def wide_range(shape: tuple[int, ...], dtype: torch.dtype, seed: int, span: int = 60) -> torch.Tensor:
    """Normal values times a random power of two per block (2^-span .. 2^span)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    k = torch.randint(-span, span, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    return (x.view(*shape[:-1], -1, 32) * torch.exp2(k)).view(shape).to(dtype)


def heavy_tailed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values spread over ~2^-100 .. 2^100 within each block (log-uniform magnitudes, random signs)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(shape, generator=g) * 200 - 100)
    return torch.where(torch.rand(shape, generator=g) < 0.5, -mag, mag)


def block(*vals: float, fill: float = 0.0) -> torch.Tensor:
    """One fp32 block [1, 32] starting with `vals`, padded with `fill`."""
    x = torch.full((1, 32), fill)
    x[0, : len(vals)] = torch.tensor(vals)
    return x


SHAPES = [(32,), (4, 64), (3, 5, 256), (257, 96), (128, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_matches_torchao(shape, dtype):
    for seed in range(3):
        x = wide_range(shape, dtype, seed)
        p, s = mxfp4.encode(x)
        p_ref, s_ref = torchao_encode(x)
        assert p.shape == (*shape[:-1], shape[-1] // 2) and s.shape == (*shape[:-1], shape[-1] // 32)
        assert p.dtype == s.dtype == torch.uint8
        assert torch.equal(s, s_ref)
        assert torch.equal(p, p_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_matches_torchao_heavy_tailed(dtype):
    x = heavy_tailed((64, 512), seed=3).to(dtype)
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x)
    assert torch.equal(s, s_ref) and torch.equal(p, p_ref)


def test_encode_fp16_matches_torchao_via_fp32():
    x = wide_range((64, 256), torch.float32, 7, span=10).to(torch.float16)
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x.float())
    assert torch.equal(p, p_ref) and torch.equal(s, s_ref)


def test_encode_non_contiguous_and_out():
    x = wide_range((96, 64), torch.float32, 11).t()  # [64, 96], non-contiguous
    p_ref, s_ref = torchao_encode(x.contiguous())
    packed = torch.full((2, 64, 48), 0xAA, dtype=torch.uint8)
    scales = torch.full((2, 64, 3), 0xAA, dtype=torch.uint8)
    p, s = mxfp4.encode(x, out=(packed[1], scales[1]))
    assert p.data_ptr() == packed[1].data_ptr() and s.data_ptr() == scales[1].data_ptr()
    assert torch.equal(packed[1], p_ref) and torch.equal(scales[1], s_ref)
    assert (packed[0] == 0xAA).all() and (scales[0] == 0xAA).all()


def test_encode_out_shape_mismatch_is_an_error():
    with pytest.raises(InputError, match="out tensors"):
        mxfp4.encode(torch.zeros(4, 64), out=(torch.empty(4, 16, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.uint8)))


@pytest.mark.parametrize(
    "x",
    [
        block(),  # all zeros
        block(-0.0, 0.0, -0.0, fill=-0.0),  # signed zeros keep their sign (code 8)
        block(6.0, -6.0, 7.0, -7.5, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25),  # saturation and RNE ties
        block(6.0 * 2.0**40, -7.99 * 2.0**40, 2.0**38 * 1.25),  # at / beyond 6*2^k
        block(8.0 * 2.0**-20, 6.0 * 2.0**-20, -1.0),  # amax exactly at a power of two
        block(1e30, 1.0, -2.0, 1e-30, fill=0.5),  # one huge outlier flushes the rest to +-0
        block(3.0e38, -3.4e38),  # near fp32 max
        block(2.0**-120, -(2.0**-140), 2.0**-149),  # a normal block with subnormal neighbours
    ],
)
def test_edge_blocks_match_torchao(x):
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        p, s = mxfp4.encode(xd)
        p_ref, s_ref = torchao_encode(xd)
        assert torch.equal(s, s_ref) and torch.equal(p, p_ref), (dtype, s, s_ref, p, p_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_block_scale_is_nan_and_finite_codes_match(dtype):
    x = torch.stack([block(NAN, 1.0, -1.0, 5.0)[0], block(2.0, -NAN)[0], block(1.0)[0]]).to(dtype)
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x)
    assert s.tolist() == s_ref.tolist() == [[255], [255], [125]]
    assert torch.equal(p[2], p_ref[2])
    codes = torch.stack([p & 0xF, p >> 4], -1).view(3, 32)
    codes_ref = torch.stack([p_ref & 0xF, p_ref >> 4], -1).view(3, 32)
    finite = torch.isfinite(x)
    assert torch.equal(codes[finite], codes_ref[finite])
    assert torch.isnan(mxfp4.decode(p, s)[:2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inf_block_matches_torchao(dtype):
    x = torch.stack([block(INF, 1.0, -2.0)[0], block(-INF, 3e38, -1e-3)[0], block(INF, -INF)[0]]).to(dtype)
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x)
    assert s.tolist() == s_ref.tolist() == [[253], [253], [253]]
    assert torch.equal(p, p_ref)
    d = mxfp4.decode(p, s)
    assert d[0, 0] == 6 * 2.0**126 and d[1, 0] == -6 * 2.0**126


def test_tiny_block_follows_spec_scale():
    """amax in [2^-125, 2^-124): shared exponent -127 exactly (E8M0 byte 0). The codes must equal those
    of the same block scaled by 2^100 (torchao, byte 100 higher): quantization is scale-equivariant.
    torchao itself clamps the divisor of byte-0 blocks to 2^-126, so it is only used on the scaled copy."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(16, 32, generator=g) * 2 - 1
    x[:, 0] = 1.9
    x = x * 2.0**-125
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x * 2.0**100)
    assert (s == 0).all() and (s_ref == 100).all()
    assert torch.equal(p, p_ref)
    assert torch.equal(mxfp4.decode(p, s) * 2.0**100, torchao_mx(x * 2.0**100).dequantize(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_scale_block_is_quantized_against_2_pow_minus_127(dtype):
    """amax = 2^-126: the shared exponent -128 clamps to E8M0 byte 0 = 2^-127, so 2^-126 encodes as 2.0
    (code 4) and decodes exactly; subnormals below 2^-129 flush to signed zero."""
    x = block(2.0**-126, -(2.0**-130), 2.0**-149, -(2.0**-127)).to(dtype)
    p, s = mxfp4.encode(x)
    assert s.item() == 0 and p[0, :2].tolist() == [0x84, 0xA0]
    assert mxfp4.decode(p, s)[0, 0] == 2.0**-126 and mxfp4.decode(p, s)[0, 3] == -(2.0**-127)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_gptoss(shape):
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 255, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=g)
    assert torch.equal(mxfp4.decode(p, s), gptoss_decode(p, s))


def test_decode_matches_torchao_dequantize_and_dtypes():
    x = wide_range((32, 256), torch.float32, 2, span=30)
    m = torchao_mx(x)
    ref = m.dequantize(torch.float32)
    d = mxfp4.decode(m.qdata, m.scale)  # float4_e2m1fn_x2 / float8_e8m0fnu views accepted
    assert torch.equal(d, ref)
    assert torch.equal(mxfp4.decode(m.qdata, m.scale, torch.bfloat16), ref.to(torch.bfloat16))
    assert torch.equal(mxfp4.decode(m.qdata, m.scale, torch.float16), ref.to(torch.float16))
    assert torch.equal(mxfp4.decode(m.qdata, m.scale, torch.float64), ref.double())


def test_decode_special_scales():
    p = torch.full((3, 16), 0x21, dtype=torch.uint8)  # even element 0.5, odd element 1.0
    s = torch.tensor([[0], [254], [255]], dtype=torch.uint8)
    d = mxfp4.decode(p, s)
    assert d[0, 0] == 2.0**-128 and d[0, 1] == 2.0**-127
    assert d[1, 0] == 2.0**126 and d[1, 1] == 2.0**127
    assert torch.isnan(d[2]).all()


def test_low_nibble_is_even_element():
    x = block(0.5, 6.0, -1.0, 0.0)
    p, s = mxfp4.encode(x)
    assert s.item() == 127 and p[0, 0].item() == 0x71 and p[0, 1].item() == 0x0A


@pytest.mark.parametrize("shape", [(4, 48), (33,), (2, 3, 16)])
def test_last_dim_not_multiple_of_32_is_an_error(shape):
    with pytest.raises(InputError, match=re_shape(shape)):
        mxfp4.encode(torch.zeros(shape))


def re_shape(shape: tuple[int, ...]) -> str:
    return "\\(" + ", ".join(map(str, shape)) + ",?\\)"


def test_bad_inputs_are_errors():
    with pytest.raises(InputError, match="dtype"):
        mxfp4.encode(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(InputError, match="do not match"):
        mxfp4.decode(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# ---- properties ----

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
scaled_blocks = st.tuples(
    st.lists(st.lists(finite32.filter(lambda v: abs(v) < 2.0**40), min_size=32, max_size=32), min_size=1, max_size=4),
    st.integers(-150, 80),
)


def step_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest error the spec allows per element: half an E2M1 step of |x|/X (0.25, 0.5, 1 for |v| < 2, 4,
    <= 6), or the saturation distance |v| - 6 above 6, times the block scale X = 2^(s-127)."""
    xs = torch.exp2(scales.double() - 127).repeat_interleave(32, -1)
    v = x.double().abs() / xs
    half = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    return torch.maximum(half, v - 6) * xs


@settings(max_examples=100, deadline=None)
@given(scaled_blocks, st.sampled_from([torch.float32, torch.bfloat16]))
def test_roundtrip_error_within_step_bound(data, dtype):
    rows, k = data
    x = (torch.tensor(rows, dtype=torch.float64) * 2.0**k).to(torch.float32).to(dtype)
    p, s = mxfp4.encode(x)
    err = (mxfp4.decode(p, s).double() - x.double()).abs()
    assert (s < 255).all()
    assert (err <= step_bound(x, s)).all()
    amax = x.double().abs().amax(-1)
    nz = amax > 0
    # The scale is the OCP one: 2^(floor(log2 amax) - 2), clamped to the E8M0 range.
    expect = torch.clamp(torch.floor(torch.log2(amax[nz])) - 2 + 127, 0, 254)
    assert torch.equal(s[..., 0][nz].double(), expect)
    assert (s[..., 0][~nz] == 0).all()


@st.composite
def valid_codes(draw):
    """Packed codes + scales (1..4 blocks) whose every block holds a code of magnitude 4 or 6, so the block
    amax pins the scale and re-encoding must reproduce the same bytes. Scales stop at 252: 4 * 2^(253-127)
    overflows fp32 and bf16."""
    nblocks = draw(st.integers(1, 4))
    codes = draw(st.lists(st.integers(0, 15), min_size=32 * nblocks, max_size=32 * nblocks))
    pins = draw(st.lists(st.tuples(st.integers(0, 31), st.sampled_from([6, 7, 14, 15])), min_size=nblocks, max_size=nblocks))
    for b, (pos, code) in enumerate(pins):
        codes[32 * b + pos] = code
    scales = draw(st.lists(st.integers(0, 252), min_size=nblocks, max_size=nblocks))
    c = torch.tensor(codes, dtype=torch.uint8).view(nblocks, 16, 2)
    return (c[..., 0] | (c[..., 1] << 4)), torch.tensor(scales, dtype=torch.uint8).view(nblocks, 1)


@settings(max_examples=100, deadline=None)
@given(valid_codes(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_encode_decode_is_identity_on_valid_codes(codes, dtype):
    p, s = codes
    p2, s2 = mxfp4.encode(mxfp4.decode(p, s, dtype))
    assert torch.equal(s2, s) and torch.equal(p2, p)


def test_e2m1_values_table():
    assert mxfp4.E2M1_VALUES[8] == 0.0 and math.copysign(1, mxfp4.E2M1_VALUES[8]) == -1
    x = torch.tensor(mxfp4.E2M1_VALUES).repeat(2).view(1, 32)
    p, s = mxfp4.encode(x)
    assert s.item() == 127
    assert p.view(-1).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
