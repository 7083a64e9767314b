"""FP8 128x128 block codec vs transformers' fine-grained FP8 quantizer / dequantizer."""

from __future__ import annotations

import types

import pytest
import torch
from moe_export.common.errors import InputError
from moe_export.quantize import fp8


def hf_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = types.SimpleNamespace(weight_block_size=[128, 128], scale_fmt="float")
    r = Fp8Quantize(types.SimpleNamespace(quantization_config=cfg))._quantize_one("m.weight", w)
    return r["m.weight"], r["m.weight_scale_inv"]


def hf_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(q, scale_inv, [128, 128], torch.float32)


def weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, (shape[0], 1), generator=g).float())
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128)])
def test_whole_blocks_match_transformers(shape, dtype):
    w = weight(shape, dtype, 0)
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    q, si = fp8.encode(w)
    q_ref, si_ref = hf_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and si.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(si, si_ref)
    assert torch.equal(fp8.decode(q, si), hf_dequantize(q, si))


@pytest.mark.parametrize("shape", [(200, 300), (96, 7168 // 8), (576, 200), (1, 5), (129, 129)])
def test_partial_edge_blocks(shape):
    """Edge blocks cover only the remaining rows / columns: their scale comes from those elements only, so
    the result equals quantizing that sub-block on its own; decoding matches transformers' dequantizer."""
    w = weight(shape, torch.float32, 1)
    q, si = fp8.encode(w)
    gr, gc = -(-shape[0] // 128), -(-shape[1] // 128)
    assert si.shape == (gr, gc)
    r0, c0 = (gr - 1) * 128, (gc - 1) * 128
    edge = w[r0:, c0:]
    amax = edge.abs().max()
    assert si[-1, -1] == 1.0 / (448.0 / amax)
    assert torch.equal(q[r0:, c0:].float(), torch.clamp(edge * (448.0 / amax), -448, 448).to(torch.float8_e4m3fn).float())
    d = fp8.decode(q, si)
    assert torch.equal(d, hf_dequantize(q, si))
    assert ((d - w).abs() <= w.abs() * 2.0**-4 + 2.0**-10 * si.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]).all()


def test_zero_block_and_dtypes():
    w = torch.zeros(130, 260)
    w[:128, 128:256] = 1.0
    q, si = fp8.encode(w)
    assert si[0, 0] == 1.0 and si[1, 2] == 1.0 and torch.equal(fp8.decode(q, si), w)
    assert fp8.decode(q, si, torch.bfloat16).dtype == torch.bfloat16


def test_errors():
    with pytest.raises(InputError, match="2-D"):
        fp8.encode(torch.zeros(4, 4, 4))
    with pytest.raises(InputError, match="scale_inv shape"):
        fp8.decode(torch.zeros(130, 10, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
