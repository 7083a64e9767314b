"""GPU check of the TensorRT AOT plugin kernels, launched the way TensorRT launches them (lent GPU only).

TensorRT is not installable on the lent GPU image either, so this reproduces what TensorRT does with an
`aot_impl`'s result using cuda-python (`cuda.bindings.driver`): load the code the plugin module returns (the PTX
whose entry takes exactly TensorRT's parameters, `plugins.aot_contract.tensorrt_ptx` as
`aot_kernel_code` makes it; the 48 KiB refusal left out so that the SparseMLA kernel is launched too) with
`cuModuleLoadData`,
opt the kernel into more than 48 KiB of dynamic shared memory when it needs it
(`cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)`), and `cuLaunchKernel` it with TensorRT's argument
order: input pointers, the int32 extra arguments, output pointers, and nothing after them (Triton's two scratch
pointers are not in the entry). The pools are reached as in an engine: through a pool table (`plugins/pool_table.py`) made and checked
on the host before anything is launched (`pool_table_for`: a null or misaligned pool address, or a slot / block
beyond its pool, is a PoolTableError), written in place by the kernels. Each kernel's outputs are compared with the JIT launch (Triton's own launcher, the `impl` path)
and with the fp32 PyTorch reference; launch errors are reported, not raised.

Kernels (K3 shapes per tp-8 rank where it matters): GatedDeltaScan (bf16 q/k/v, H=12, K=V=128),
ShortConv (bf16, C=3*12*128, W=4), SparseMLAAttention (fp32, H=12, Dc=512, Dr=64: ~110 KiB shared memory),
PagedCacheWrite (fp8 pool of 577-byte K3 latent rows; bit-exact against the JIT launch and the reference).
`--json PATH` writes the outcome as one flat object, after every kernel (`<check>_error` where one failed).
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch
from cuda.bindings import driver
from device_figures import Figures  # benchmarks/, the script's folder, is sys.path[0]

from moe_export.plugins.gated_delta_scan import reference as gds_ref
from moe_export.plugins.pool_table import check_pool_offsets, pool_table
from moe_export.plugins.aot_contract import tensorrt_ptx
from moe_export.plugins.gated_delta_scan import triton_kernel as gds
from moe_export.plugins.short_conv import reference as conv_ref
from moe_export.plugins.short_conv import triton_kernel as conv
from moe_export.plugins.sparse_mla_attention import reference as mla_ref
from moe_export.plugins.sparse_mla_attention import triton_kernel as mla

DEFAULT_SHARED_LIMIT = 48 * 1024
H200_CAPABILITY = 90  # sm_90, where the device stage could not ask


def _check(result) -> object:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def launch_like_tensorrt(kernel, grid, inputs, extras, outputs) -> dict:
    """cuModuleLoadData + cuLaunchKernel of a Triton CompiledKernel with TensorRT's parameters."""
    num_params = len(inputs) + len(extras) + len(outputs)
    code = tensorrt_ptx(kernel, kernel.metadata.name, num_params).encode() + b"\0"  # what aot_impl hands TensorRT
    module = _check(driver.cuModuleLoadData(code))
    func = _check(driver.cuModuleGetFunction(module, kernel.metadata.name.encode()))
    shared = int(kernel.metadata.shared)
    if shared > DEFAULT_SHARED_LIMIT:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(func, attr, shared))
    values = [t.data_ptr() for t in inputs] + [int(e) for e in extras] + [t.data_ptr() for t in outputs]
    kinds = [ctypes.c_void_p] * len(inputs) + [ctypes.c_int32] * len(extras) + [ctypes.c_void_p] * len(outputs)
    stream = torch.cuda.current_stream().cuda_stream
    block = kernel.metadata.num_warps * 32
    _check(driver.cuLaunchKernel(func, *grid, block, 1, 1, shared, stream, (tuple(values), tuple(kinds)), 0))
    torch.cuda.synchronize()
    return {"shared_bytes": shared, "block": block, "grid": list(grid)}


def pool_table_for(pool: torch.Tensor, *, slot_ids=None, block_tables=None) -> torch.Tensor:
    """The one-pool table an engine's plugin would get, checked on the host before any launch."""
    table = pool_table([pool])
    check_pool_offsets(table, 0, slot_ids=None if slot_ids is None else slot_ids.cpu().numpy(),
                       block_tables=None if block_tables is None else block_tables.cpu().numpy())  # fmt: skip
    return torch.from_numpy(table).to(pool.device)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _ragged(dev, lengths, num_slots):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    slots = torch.randperm(num_slots, device=dev)[: len(lengths)]
    return cu, slots


def check_gated_delta_scan(fig: dict, capability: int) -> None:
    dev, H, K, V, S = "cuda", 12, 128, 128, 8
    cu, slots = _ragged(dev, [40, 1, 17, 6], S)
    T = int(cu[-1])
    q, k = (torch.randn(T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, H, V, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(T, H, K, device=dev)
    beta = torch.rand(T, H, device=dev)
    pool0 = torch.randn(S, H, V, K, device=dev) * 0.1
    kernel = gds.aot_compile("bf16", H, K, V, K**-0.5, True, True, capability)
    o_aot, pool_aot = torch.empty_like(v), pool0.clone()
    fig["gds_launch"] = launch_like_tensorrt(
        kernel, (-(-V // gds.block_sizes(K, V)[1]), H, slots.numel()),
        [q, k, v, g, beta, pool_table_for(pool_aot, slot_ids=slots), cu, slots], [0, T], [o_aot],
    )  # fmt: skip
    pool_jit = pool0.clone()
    o_jit = gds.gated_delta_scan_pool(q, k, v, g, beta, pool_jit, cu, slots, K**-0.5, True)
    o_ref, pool_ref = gds_ref.gated_delta_scan_node(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), pool0.cpu(),
                                                    cu.cpu(), slots.cpu(), K**-0.5, True)  # fmt: skip
    fig["gds_aot_vs_jit"] = max(_max_diff(o_aot, o_jit), _max_diff(pool_aot, pool_jit))
    fig["gds_aot_vs_reference"] = max(_max_diff(o_aot.cpu(), o_ref), _max_diff(pool_aot.cpu(), pool_ref))


def check_short_conv(fig: dict, capability: int) -> None:
    dev, C, W, S = "cuda", 3 * 12 * 128, 4, 8
    cu, slots = _ragged(dev, [40, 1, 17, 6], S)
    T = int(cu[-1])
    x = torch.randn(T, C, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(C, W, device=dev) * 0.5
    pool0 = torch.randn(S, C, W - 1, device=dev)
    kernel = conv.aot_compile("bf16", C, W, capability)
    y_aot, pool_aot = torch.empty_like(x), pool0.clone()
    fig["conv_launch"] = launch_like_tensorrt(
        kernel, (-(-C // conv.block_sizes(C, W)[1]), slots.numel(), 1),
        [x, weight, pool_table_for(pool_aot, slot_ids=slots), cu, slots], [0, T], [y_aot],
    )  # fmt: skip
    pool_jit = pool0.clone()
    y_jit = conv.short_conv_pool(x, weight, pool_jit, cu, slots)
    y_ref, pool_ref = conv_ref.short_conv_node(x.cpu(), weight.cpu(), pool0.cpu(), cu.cpu(), slots.cpu())
    fig["conv_aot_vs_jit"] = max(_max_diff(y_aot, y_jit), _max_diff(pool_aot, pool_jit))
    fig["conv_aot_vs_reference"] = max(_max_diff(y_aot.cpu(), y_ref), _max_diff(pool_aot.cpu(), pool_ref))


def check_sparse_mla(fig: dict, capability: int) -> None:
    """Decode: one query token per sequence over a paged pool (blocks of 64 positions, shuffled tables)."""
    dev, H, DC, DR, BS, L, K, N = "cuda", 12, 512, 64, 64, 4096, 256, 3
    B = L // BS
    tables = torch.randperm(N * B, device=dev).view(N, B)
    pool = torch.randn(N * B, BS, DC + DR, device=dev)
    cu = torch.arange(N + 1, device=dev)
    pos = torch.randint(K, L, (N,), device=dev)
    q = torch.randn(N, H, DC + DR, device=dev)
    new = torch.randn(N, DC + DR, device=dev)
    idx = torch.stack([torch.randperm(int(p) + 1, device=dev)[:K] for p in pos])
    scale = 192**-0.5
    kernel = mla.aot_compile(H, DC, DR, scale, capability, block_h=16)
    out = torch.empty(N, H, DC, device=dev)
    fig["mla_launch"] = launch_like_tensorrt(
        kernel, (N, -(-H // 16), 1), [q, pool_table_for(pool, block_tables=tables), new, cu, tables, pos, idx],
        [0, N, N, BS, B, K], [out],
    )  # fmt: skip
    jit = mla.sparse_mla_attention_triton(q, pool, new, cu, tables, pos, idx, scale=scale, kv_lora_rank=DC)
    ref = mla_ref.sparse_mla_attention_reference(q.cpu(), pool.cpu(), new.cpu(), cu.cpu(), tables.cpu(), pos.cpu(),
                                                 idx.cpu(), scale=scale, kv_lora_rank=DC)  # fmt: skip
    fig["mla_aot_vs_jit"] = _max_diff(out, jit)
    fig["mla_aot_vs_reference"] = _max_diff(out.cpu(), ref)


def check_paged_cache_write(fig: dict, capability: int) -> None:
    """A prefill chunk and two decode tokens written into an fp8 pool of K3 latent rows (576 values + scale byte)."""
    from moe_export.plugins.paged_cache_write import reference as write_ref
    from moe_export.plugins.paged_cache_write import triton_kernel as write
    from moe_export.quantize import fp8_cache

    dev, D, BS, NB = "cuda", 576, 64, 64
    cu = torch.tensor([0, 100, 101, 102], device=dev)
    pos = torch.cat([torch.arange(0, 100), torch.tensor([700, 63])]).to(dev)
    tables = torch.randperm(NB, device=dev)[:36].view(3, 12)
    new = fp8_cache.round_rows(torch.randn(102, D, device=dev) * 3)
    pool0 = torch.randint(0, 256, (NB, BS, D + 1), device=dev, dtype=torch.uint8)
    kernel = write.aot_compile(D, capability, torch.uint8)
    pool_aot, rows_out = pool0.clone(), torch.empty_like(new)
    fig["write_launch"] = launch_like_tensorrt(
        kernel, (102, 1, 1), [pool_table_for(pool_aot, block_tables=tables), new, cu, tables, pos], [0, 3, 102, BS, 12],
        [rows_out],
    )  # fmt: skip
    fig["write_aot_rows_passed_on"] = bool(torch.equal(rows_out, new))
    pool_jit = write.paged_cache_write_triton(pool0.clone(), new, cu, tables, pos)
    ref = write_ref.paged_cache_write_reference(pool0.cpu(), new.cpu(), cu.cpu(), tables.cpu(), pos.cpu())
    fig["write_aot_equals_jit"] = bool(torch.equal(pool_aot, pool_jit))
    fig["write_aot_vs_jit"] = _max_diff(pool_aot, pool_jit)
    fig["write_aot_equals_reference"] = bool(torch.equal(pool_aot.cpu(), ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    fig = Figures(args.json)
    with fig.stage("aot_device"):
        torch.manual_seed(0)
        torch.cuda.init()
        _check(driver.cuInit(0))
        major, minor = torch.cuda.get_device_capability()
        fig.update(device=torch.cuda.get_device_name(), capability=major * 10 + minor)
    for check in (check_gated_delta_scan, check_short_conv, check_sparse_mla, check_paged_cache_write):
        with fig.stage(check.__name__):  # a failed launch is the finding: recorded, the other kernels still run
            check(fig, fig.get("capability", H200_CAPABILITY))


if __name__ == "__main__":
    main()
