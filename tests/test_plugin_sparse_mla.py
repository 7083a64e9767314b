"""sparse_mla_attention: reference vs external oracles (dense MLA computed the non-absorbed way, transformers'
DeepseekV32Attention, fla's naive DSA), and the CPU, Triton (interpreter, in a subprocess) and ONNX Runtime
implementations vs the reference."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moe_export.plugins import DOMAIN, OPSET_VERSION
from moe_export.plugins.sparse_mla_attention import cpu, onnx_schema, ort, reference
from moe_export.plugins.sparse_mla_attention import triton_kernel as smla_triton  # TRITON_INTERPRET=1 in triton_inner runs
from moe_export.quantize import fp8_cache
from conftest import load_fla_naive, page_cache, run_triton_inner_tests

REPO = Path(__file__).resolve().parents[1]


def close(a, b, tol=1e-5):
    """Max abs error relative to max(1, the reference's max magnitude)."""
    err = float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1.0)
    assert err < tol, err


def make_case(seed=0, H=3, Dc=32, Dr=16, L=48, slots=(4, 0, 2), starts=(0, 20, 47), lengths=(5, 1, 1), S=5, K=12,
              block_size=8, dtype=torch.float32):
    """Packed inputs of sequences with `lengths[n]` query tokens at positions starts[n]..; their contexts are
    random latent rows, paged into shuffled blocks of `block_size` (`conftest.page_cache`; `slots` only picks
    which random rows each sequence gets).

    Returns dict(q_lat [T,H,Dc+Dr], kv_pool [NB,BS,Dc+Dr], kv_new [T,Dc+Dr], cu_seqlens, block_tables [N,B],
    positions, topk_indices [T,K]) where each index row mixes distinct causal positions, -1 padding and positions
    beyond the token (ignored).
    """
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(torch.int64)
    T = int(cu[-1])
    rows = []
    for t in range(T):
        pos = int(positions[t])
        causal = torch.randperm(pos + 1, generator=gen)[: K - 3]
        future = torch.arange(pos + 1, pos + 3)  # beyond the token: must be ignored
        row = torch.cat([causal, future, torch.full((K,), -1)])[:K]
        rows.append(row[torch.randperm(K, generator=gen)])
    q_lat = torch.randn(T, H, Dc + Dr, generator=gen)
    cache = torch.randn(S, L, Dc + Dr, generator=gen)
    pool, new, tables = page_cache(cache, torch.tensor(slots), cu, positions, block_size, seed, dtype)
    return dict(
        q_lat=q_lat,
        kv_pool=pool,
        kv_new=new,
        cu_seqlens=cu,
        block_tables=tables,
        positions=positions,
        topk_indices=torch.stack(rows).to(torch.int64),
    )


CASES = {
    "prefill_decode_mix": dict(),
    "chunked_prefill": dict(slots=(1, 3), starts=(10, 0), lengths=(7, 9), S=4, K=8),
    "single_decode": dict(slots=(0,), starts=(47,), lengths=(1,), S=1, K=16, H=17),
    "block_size_1": dict(block_size=1),
    "one_block_per_sequence": dict(block_size=64),
    "empty_sequence": dict(slots=(2, 1, 0), starts=(3, 0, 5), lengths=(2, 0, 3), S=3, K=5),
}


def run_all(fn, case, mode):
    """Call fn on a case; mode "sparse" (indices), "dense" (no indices) or "k0" (zero-width indices)."""
    c = dict(case)
    idx = c.pop("topk_indices")
    idx = {"sparse": idx, "dense": None, "k0": idx[:, :0]}[mode]
    return fn(**c, topk_indices=idx, scale=0.3, kv_lora_rank=case["kv_new"].shape[-1] - 16)


# --------------------------------------------------------------------------------------- oracles


def dense_mla_unabsorbed(q_nope, q_pe, c, k_pe, w_kc, w_vc, scale):
    """Causal MLA with per-head keys/values expanded from the latents (one sequence, positions 0..T-1).

    q_nope [T,H,dn], q_pe [T,H,dr], c [T,Dc], k_pe [T,dr], w_kc [H,dn,Dc], w_vc [H,dv,Dc] -> [T,H,dv].
    """
    T, H, _ = q_nope.shape
    k = torch.cat([torch.einsum("sc,hdc->hsd", c, w_kc), k_pe[None].expand(H, T, -1)], dim=-1)  # [H,T,dn+dr]
    v = torch.einsum("sc,hdc->hsd", c, w_vc)  # [H,T,dv]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H,T,dn+dr]
    s = (q @ k.transpose(1, 2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


def test_reference_full_topk_equals_unabsorbed_dense_mla():
    """Top-k covering the whole context (shuffled, padded with -1) == dense MLA with expanded k/v per head."""
    gen = torch.Generator().manual_seed(1)
    T, H, dn, dr, dv, Dc = 19, 4, 16, 8, 12, 32
    q_nope, q_pe = torch.randn(T, H, dn, generator=gen), torch.randn(T, H, dr, generator=gen)
    c, k_pe = torch.randn(T, Dc, generator=gen), torch.randn(T, dr, generator=gen)
    w_kc, w_vc = torch.randn(H, dn, Dc, generator=gen) * 0.2, torch.randn(H, dv, Dc, generator=gen) * 0.2
    scale = (dn + dr) ** -0.5
    want = dense_mla_unabsorbed(q_nope, q_pe, c, k_pe, w_kc, w_vc, scale)

    q_lat = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_kc), q_pe], dim=-1)
    cache = torch.cat([c, k_pe], dim=-1)[None]
    idx = torch.stack([torch.cat([torch.randperm(T, generator=gen), torch.full((3,), -1)]) for _ in range(T)])
    cu, pos = torch.tensor([0, T]), torch.arange(T)
    pool, new, tables = page_cache(cache, torch.tensor([0]), cu, pos, block_size=4)
    args = (q_lat, pool, new, cu, tables, pos)
    for indices in (idx, None):
        o_lat = reference.sparse_mla_attention_reference(*args, indices, scale=scale, kv_lora_rank=Dc)
        close(torch.einsum("thc,hvc->thv", o_lat, w_vc), want)


@pytest.fixture(scope="module")
def hf_deepseek_v32():
    """transformers' deepseek_v32 modeling module, imported fresh with `fla` hidden (so it binds the torch
    fallbacks, not fla's Triton kernels); sys.modules is restored right after the import."""
    name = "transformers.models.deepseek_v32.modeling_deepseek_v32"
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.") or k == name}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.pop(name, None)
        sys.modules.update(saved)


def test_reference_matches_transformers_deepseek_v32_attention(hf_deepseek_v32):
    """DeepseekV32Attention (eager, identity rotary) == projections + our op + W_vc + o_proj, with the indices
    its own indexer selects (index_topk < T, so the selection matters)."""
    torch.manual_seed(0)
    cfg = hf_deepseek_v32.DeepseekV32Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16,
        index_topk=6, num_hidden_layers=1, vocab_size=32,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    attn = hf_deepseek_v32.DeepseekV32Attention(cfg, layer_idx=0).eval()
    T, H, dn, dr, Dc = 20, 4, 16, 8, 32
    x = torch.randn(1, T, 64)
    rot = (torch.ones(1, T, dr), torch.zeros(1, T, dr))  # NoPE: identity rotary
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    mask = torch.zeros(1, 1, T, T).masked_fill(future, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = attn(x, position_embeddings=rot, attention_mask=mask, position_ids=torch.arange(T)[None])
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x[0]))
        q = attn.q_b_proj(q_resid).view(T, H, dn + dr)
        ckv = attn.kv_a_proj_with_mqa(x[0])
        c, k_pe = attn.kv_a_layernorm(ckv[:, :Dc]), ckv[:, Dc:]
        w = attn.kv_b_proj.weight.view(H, dn + 16, Dc)
        w_kc, w_vc = w[:, :dn], w[:, dn:]
        idx = attn.indexer(x, q_resid, rot, mask[:, 0], torch.arange(T)[None])[0].long()
        idx = torch.where(idx <= torch.arange(T)[:, None], idx, -1)  # the HF indexer also returns masked slots
        q_lat = torch.cat([torch.einsum("thd,hdc->thc", q[..., :dn], w_kc), q[..., dn:]], dim=-1)
        cache = torch.cat([c, k_pe], dim=-1)[None]
        cu, pos = torch.tensor([0, T]), torch.arange(T)
        pool, new, tables = page_cache(cache, torch.tensor([0]), cu, pos, block_size=8)
        o_lat = reference.sparse_mla_attention_reference(
            q_lat, pool, new, cu, tables, pos, idx, scale=attn.scaling, kv_lora_rank=Dc,
        )  # fmt: skip
        got = attn.o_proj(torch.einsum("thc,hvc->thv", o_lat, w_vc).reshape(T, -1))
    assert (idx >= 0).sum(1).max() == 6 and (idx < 0).any()
    close(got, want[0])


@pytest.fixture(scope="module")
def fla_dsa_naive():
    return load_fla_naive("ops/dsa/naive.py")


def test_reference_matches_fla_naive_dsa_varlen(fla_dsa_naive):
    """fla naive_dsa with given indices on packed varlen prefill (one KV head = the latent row, v = c)."""
    gen = torch.Generator().manual_seed(2)
    lengths, H, Dc, Dr, K = (9, 1, 14), 4, 32, 16, 6
    T = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    q_lat = torch.randn(T, H, Dc + Dr, generator=gen)
    rows = torch.randn(T, Dc + Dr, generator=gen)
    local = torch.cat([torch.arange(n) for n in lengths])
    idx = torch.stack([torch.cat([torch.randperm(int(p) + 1, generator=gen), torch.full((K,), -1)])[:K] for p in local])
    want = fla_dsa_naive.naive_dsa(
        q_lat[None], rows[None, :, None], rows[None, :, None, :Dc], None, None, indices=idx[None],
        scale=0.25, cu_seqlens=cu,
    )[0]  # fmt: skip
    cache = torch.zeros(len(lengths), max(lengths), Dc + Dr)
    for n in range(len(lengths)):
        cache[n, : lengths[n]] = rows[cu[n] : cu[n + 1]]
    pool, new, tables = page_cache(cache, torch.arange(len(lengths)), cu, local, block_size=4)
    got = reference.sparse_mla_attention_reference(q_lat, pool, new, cu, tables, local, idx, scale=0.25, kv_lora_rank=Dc)
    close(got, want)


# ------------------------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["sparse", "dense", "k0"])
def test_cpu_matches_reference(name, mode):
    case = make_case(seed=3, **CASES[name])
    want = run_all(reference.sparse_mla_attention_reference, case, "sparse" if mode == "sparse" else "dense")
    close(run_all(cpu.sparse_mla_attention_cpu, case, mode), want)


def test_cpu_chunking_and_all_invalid_rows(monkeypatch):
    """Tiny chunk budget (many chunks); a token whose indices are all -1 or future gets zeros."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 64)
    case = make_case(seed=4, **CASES["chunked_prefill"])
    case["topk_indices"][2] = -1
    case["topk_indices"][5, :] = case["positions"][5] + 1
    for mode in ("sparse", "dense"):
        got = run_all(cpu.sparse_mla_attention_cpu, case, mode)
        close(got, run_all(reference.sparse_mla_attention_reference, case, mode))
    got = run_all(cpu.sparse_mla_attention_cpu, case, "sparse")
    assert got[2].abs().max() == 0 and got[5].abs().max() == 0


# ------------------------------------------------------------------------------ ONNX + ORT path


ONNX_CACHE_TYPES = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16, torch.uint8: TensorProto.UINT8}


def onnx_model(case, mode, with_function=True, **tiles):
    """Model with one SparseMLAAttention node (+ its function, `tiles`: its key-tile arguments); mode as in run_all."""
    onnx_schema.register()
    H, D = case["q_lat"].shape[1:]
    cache_type = ONNX_CACHE_TYPES[case["kv_pool"].dtype]
    names = ["q_lat", "kv_pool", "kv_new", "cu_seqlens", "block_tables", "positions"]
    inputs = [
        helper.make_tensor_value_info("q_lat", TensorProto.FLOAT, ["T", H, D]),
        helper.make_tensor_value_info("kv_pool", cache_type, ["NB", "BS", case["kv_pool"].shape[-1]]),
        helper.make_tensor_value_info("kv_new", TensorProto.FLOAT, ["T", D]),
        helper.make_tensor_value_info("cu_seqlens", TensorProto.INT64, ["N1"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["N", "B"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
    ]
    if mode != "dense":
        inputs.append(helper.make_tensor_value_info("topk_indices", TensorProto.INT64, ["T", "K"]))
    topk = None if mode == "dense" else "topk_indices"
    node = onnx_schema.make_node(*names, topk, "o_lat", scale=0.3, kv_lora_rank=D - 16)
    out = helper.make_tensor_value_info("o_lat", TensorProto.FLOAT, ["T", H, D - 16])
    graph = helper.make_graph([node], "smla", inputs, [out])
    fp8_pool = cache_type == TensorProto.UINT8
    functions = [ort.function_proto(dense=mode == "dense", fp8_pool=fp8_pool, **tiles)] if with_function else []
    opsets = [helper.make_opsetid("", ort.ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


@pytest.mark.parametrize("with_function", [False, True])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_schema_checker_and_strict_shape_inference(mode, with_function):
    model = onnx_model(make_case(), mode, with_function)
    model.graph.ClearField("output")
    model.graph.output.append(helper.make_tensor_value_info("o_lat", TensorProto.FLOAT, None))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["T", 3, 32]
    node = model.graph.node[0]
    assert node.domain == DOMAIN and {a.name for a in node.attribute} == {"scale", "kv_lora_rank", "plugin_version", "plugin_namespace"}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["sparse", "dense", "k0"])
def test_ort_function_matches_reference(name, mode):
    case = make_case(seed=5, **CASES[name])
    got = run_ort(case, mode)
    close(got, run_all(reference.sparse_mla_attention_reference, case, "sparse" if mode == "sparse" else "dense"))


def run_ort(case, mode, **tiles):
    """The ORT function on a case (bf16 pools fed as OrtValues: numpy has no bf16)."""
    import onnxruntime

    sess = onnxruntime.InferenceSession(onnx_model(case, mode, **tiles).SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    feed = {}
    for k, v in case.items():
        if k == "topk_indices":
            continue
        if v.dtype == torch.bfloat16:
            feed[k] = onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(torch.int16).numpy().view(np.uint16),
                                                                             TensorProto.BFLOAT16)
        else:
            feed[k] = v.numpy()
    if mode != "dense":
        feed["topk_indices"] = case["topk_indices"][:, : 0 if mode == "k0" else None].numpy()
    return torch.from_numpy(sess.run(None, feed)[0])


# key tiles of one block (many Loop iterations)
TILE_FORMS = {"one_block_tiles": dict(tile_elems=1)}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("form", list(TILE_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_ort_dense_streams_over_key_tiles(name, form, dtype):
    """The dense body's online softmax over key tiles of one block each equals the reference (fp8 pools too: the
    rows no token may read, NaN in the pool, are never read)."""
    case = make_case(seed=7, dtype=dtype, **CASES[name])
    want = run_all(reference.sparse_mla_attention_reference, case, "dense")
    close(run_ort(case, "dense", **TILE_FORMS[form]), want)
    close(run_ort(case, "k0", **TILE_FORMS[form]), want)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_bf16_pool_is_cast_after_the_gather(mode):
    """A bf16 pool (new rows fp32, rounded to bf16): CPU and ORT equal the reference run on the same values
    (up to fp32 rounding), i.e. the cast happens after the gather and the arithmetic stays fp32."""
    case = make_case(seed=10, dtype=torch.bfloat16)
    want = run_all(reference.sparse_mla_attention_reference, case, mode)
    close(run_all(cpu.sparse_mla_attention_cpu, case, mode), want)
    close(run_ort(case, mode), want)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_fp8_pool_is_decoded_after_the_gather(mode):
    """An fp8 pool (uint8 rows of E4M3 codes + an E8M0 scale byte; new rows fp32, rounded the same way): CPU and
    ORT equal the reference on the decoded values; the pool's NaN rows (never read) stay unread."""
    case = make_case(seed=12, dtype=torch.uint8)
    assert case["kv_pool"].dtype == torch.uint8 and case["kv_pool"].shape[-1] == case["kv_new"].shape[-1] + 1
    want = run_all(reference.sparse_mla_attention_reference, case, mode)
    assert torch.isfinite(want).all()
    close(run_all(cpu.sparse_mla_attention_cpu, case, mode), want)
    close(run_ort(case, mode), want)
    exact = dict(case, kv_pool=fp8_cache.decode_rows(case["kv_pool"]))  # the same values in an fp32 pool
    close(want, run_all(reference.sparse_mla_attention_reference, exact, mode))


# ------------------------------------------------------------------- triton AOT (TensorRT plugin)


def test_aot_compile_produces_ptx():
    """The kernel the TensorRT AOT plugin embeds compiles to sm_90 PTX for fp32 at K3's MLA widths (Dc 512,
    Dr 64), real compile on CPU, without tensorrt; its parameters start with the plugin's launch order: seven
    input pointers (the pool table second: no pool pointer), the int32 scalars pool, N, T, BS, B, K, then the
    output pointer; bf16 and fp8 pools compile too."""
    import triton  # noqa: F401  (test extra: a missing oracle is a broken install, not a skip)
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    kernel = triton_kernel.aot_compile(16, 512, 64, 192**-0.5, 90)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.name == "_sparse_mla_kernel"
    assert ".entry _sparse_mla_kernel(" in ptx and ".target sm_90" in ptx
    entry = ptx[ptx.index(".entry _sparse_mla_kernel(") :].split(")", 1)[0]
    kinds = [".u64 .ptr" if ".ptr" in line else line.split()[1] for line in entry.splitlines() if ".param" in line]
    assert kinds[:14] == [".u64 .ptr"] * 7 + [".u32"] * 6 + [".u64 .ptr"]
    assert kernel.metadata.num_warps * 32 > 0
    for pool_dtype in (torch.bfloat16, torch.uint8):
        assert ".entry _sparse_mla_kernel(" in triton_kernel.aot_compile(16, 512, 64, 192**-0.5, 90,
                                                                          pool_dtype=pool_dtype).asm["ptx"]
    assert "tensorrt" not in sys.modules


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


@inner_triton
def test_inner_triton_reads_through_the_pool_table():
    """The kernel reads the pool only through the pool table (here row 1 of two: a NaN pool
    at row 0 would poison the result); a garbage row reads no pool memory (a NaN pool leaves the result finite)."""
    from moe_export.plugins.pool_table import device_pool_table
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=9, **CASES[list(CASES)[0]])
    want = run_all(reference.sparse_mla_attention_reference, case, "sparse")
    pool = case["kv_pool"]
    poison = torch.full_like(pool, float("nan"))
    q, new = case["q_lat"].float().contiguous(), case["kv_new"].float().contiguous()
    cu, tables, pos = case["cu_seqlens"], case["block_tables"], case["positions"]
    idx = case["topk_indices"]
    kw = dict(scale=0.3, kv_lora_rank=new.shape[-1] - 16)  # as run_all
    out = torch.empty(q.shape[0], q.shape[1], kw["kv_lora_rank"])
    triton_kernel.sparse_mla_attention_launch(q, device_pool_table([poison, pool]), 1, pool.shape[1], pool.dtype, new,
                                              cu, tables, pos, idx, out, **kw)  # fmt: skip
    close(out, want)
    garbage = torch.tensor([[poison.data_ptr(), poison.shape[0], 99]])
    triton_kernel.sparse_mla_attention_launch(q, garbage, 0, pool.shape[1], pool.dtype, new, cu, tables, pos, idx, out,
                                              **kw)  # fmt: skip
    assert torch.isfinite(out).all()


@inner_triton
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["sparse", "dense", "k0"])
def test_inner_triton_matches_reference(name, mode):
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=6, **CASES[name])
    got = run_all(triton_kernel.sparse_mla_attention_triton, case, mode)
    close(got, run_all(reference.sparse_mla_attention_reference, case, "sparse" if mode == "sparse" else "dense"))


@inner_triton
def test_inner_triton_small_blocks_and_non_power_of_two_dims():
    """Dc = 24, Dr = 8 (masked tails), 2-head blocks, 4-index blocks: many loop iterations."""
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=7, Dc=24, Dr=8, H=5, block_size=3)
    for idx in (case["topk_indices"], None):
        args = {k: v for k, v in case.items() if k != "topk_indices"}
        kw = dict(topk_indices=idx, scale=0.3, kv_lora_rank=24)
        got = triton_kernel.sparse_mla_attention_triton(**args, **kw, block_h=2, block_k=4)
        close(got, reference.sparse_mla_attention_reference(**args, **kw))


@inner_triton
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_inner_triton_bf16_pool(mode):
    """bf16 pool: the dots take bf16 operands (tensor cores; q and the softmax weights rounded to bf16, 2^-9
    relative) with fp32 accumulation: within 1e-2 of the fp32 reference relative to max |o|, not within 1e-5."""
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=11, dtype=torch.bfloat16)
    got = run_all(triton_kernel.sparse_mla_attention_triton, case, mode)
    want = run_all(reference.sparse_mla_attention_reference, case, mode)
    close(got, want, tol=1e-2)
    with pytest.raises(AssertionError):
        close(got, want)


@inner_triton
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_inner_triton_fp8_pool(mode):
    """fp8 rows decoded in the kernel by bit arithmetic (exact in bf16: 3 mantissa bits; every code is checked
    below) and fed to bf16 dots as the bf16 pool: within 1e-2 of the reference's decode (torch's float8_e4m3fn)."""
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=13, dtype=torch.uint8)
    close(run_all(triton_kernel.sparse_mla_attention_triton, case, mode),
          run_all(reference.sparse_mla_attention_reference, case, mode), tol=1e-2)


@inner_triton
@pytest.mark.parametrize("splits", [3, 8])
def test_inner_triton_split_keys_combined(splits):
    """Flash decoding: each token's keys split across `splits` programs (partial softmax and log-sum-exp each,
    one combine launch), some splits with no key (short dense rows): equal to the reference (fp32 pool)."""
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    case = make_case(seed=14, K=20)
    split = lambda **kw: triton_kernel.sparse_mla_attention_triton(**kw, block_k=2, splits=splits)  # noqa: E731
    for mode in ("sparse", "dense"):
        close(run_all(split, case, mode), run_all(reference.sparse_mla_attention_reference, case, mode))
    from moe_export.plugins.sparse_mla_attention.sizes import num_splits

    assert num_splits(1, 2048, 32) == 64 and num_splits(64, 2048, 32) == 8 and num_splits(4096, 2048, 32) == 1
    assert num_splits(1, 2048, 16) == 64  # fp8 pools' 16-key steps: still 64 programs for one query at top-2048


@inner_triton
def test_inner_triton_fp8_decode_every_code_and_scale():
    """The kernels' bit-arithmetic decode of every E4M3 code (NaN codes included) under every E8M0 scale byte equals
    the lookup tables built from torch's float8_e4m3fn (`fp8_cache.code_table` / `scale_table`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(codes_ptr, scales_ptr, out_ptr):
        rows = tl.arange(0, 256)
        cols = tl.arange(0, 256)
        codes = tl.load(codes_ptr + rows[:, None] * 256 + cols[None, :])
        decoded = smla_triton.fp8_rows_to_f32(codes, tl.load(scales_ptr + rows))
        tl.store(out_ptr + rows[:, None] * 256 + cols[None, :], decoded)

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = every[None, :].expand(256, 256).contiguous()  # row r: all codes, scale byte r
    out = torch.empty(256, 256)
    decode[(1,)](codes, every, out)
    want = torch.from_numpy(fp8_cache.scale_table())[:, None] * torch.from_numpy(fp8_cache.code_table())[None, :]
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


@inner_triton
def test_inner_triton_many_sequences():
    """150 sequences (some empty), more than one block of the kernel's token -> sequence search."""
    from moe_export.plugins.sparse_mla_attention import triton_kernel

    n = 150
    gen = torch.Generator().manual_seed(8)
    lengths = tuple(int(x) for x in torch.randint(0, 3, (n,), generator=gen))
    starts = tuple(int(x) for x in torch.randint(0, 20, (n,), generator=gen))
    slots = tuple(int(x) for x in torch.randperm(n, generator=gen))
    case = make_case(seed=9, H=2, L=24, slots=slots, starts=starts, lengths=lengths, S=n, K=6)
    for mode in ("sparse", "k0"):
        got = run_all(triton_kernel.sparse_mla_attention_triton, case, mode)
        close(got, run_all(reference.sparse_mla_attention_reference, case, "sparse" if mode == "sparse" else "dense"))
