"""MXFP4 codec vs independent oracles: torchao's MX encoder and transformers' gpt-oss decoder."""

from __future__ import annotations

import pytest
import torch

from moe_export.export.errors import InputError
from moe_export.quantize import mxfp4


def torchao_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao MX FLOOR encode of fp32/bf16 x -> (packed uint8, scales uint8)."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, ScaleCalculationMode

    m = MXTensor.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
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


SHAPES = [(32,), (4, 64), (3, 5, 256), (257, 96), (128, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_matches_torchao(shape, dtype):
    for seed in range(3):
        x = wide_range(shape, dtype, seed)
        p, s = mxfp4.encode(x)
        p_ref, s_ref = torchao_encode(x)
        assert p.shape == (*shape[:-1], shape[-1] // 2) and s.shape == (*shape[:-1], shape[-1] // 32)
        assert torch.equal(s, s_ref)
        assert torch.equal(p, p_ref)


def test_encode_fp16_matches_torchao_via_fp32():
    x = wide_range((64, 256), torch.float32, 7, span=10).to(torch.float16)
    p, s = mxfp4.encode(x)
    p_ref, s_ref = torchao_encode(x.float())
    assert torch.equal(p, p_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_gptoss(shape):
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 255, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=g)
    assert torch.equal(mxfp4.decode(p, s), gptoss_decode(p, s))


def test_last_dim_not_multiple_of_32_is_an_error():
    with pytest.raises(InputError, match=r"\(4, 48\)"):
        mxfp4.encode(torch.zeros(4, 48))
