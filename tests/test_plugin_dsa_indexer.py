"""dsa_indexer: reference vs external oracles (transformers' DeepseekV32Indexer, fla's naive DSA indexer), and
the CPU, Triton (interpreter, in a subprocess) and ONNX Runtime implementations vs the reference."""

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
from moe_export.plugins.dsa_indexer import cpu, onnx_schema, ort, reference
from conftest import load_fla_naive, page_cache, run_triton_inner_tests

REPO = Path(__file__).resolve().parents[1]


def make_case(seed=0, Hi=4, Di=16, L=40, slots=(3, 0, 1), starts=(0, 17, 39), lengths=(6, 2, 1), S=4, integer=False,
              block_size=8, dtype=torch.float32, with_cache=False):
    """Packed inputs; sequence n has lengths[n] query tokens at positions starts[n].., its keys are random rows
    (slot slots[n] of a [S, L, Di] table), paged into shuffled blocks of `block_size` (`conftest.page_cache`).

    `integer`: q and k in {-2..2}, weights in {0.25, 0.5, 0.75, 1}, so every implementation computes the scores
    exactly and many positions tie (exercising the lower-position-first rule); every slot's key at position 5
    also equals its key at position 2. With a bf16 or fp8 pool q is rounded to bf16 (what the Triton kernel
    multiplies on the tensor cores for those pools), so the fp32 reference stays the oracle.
    Returns dict(q_idx [T,Hi,Di], weights [T,Hi], k_pool [NB,BS,Di], k_new [T,Di], cu_seqlens, block_tables,
    positions); with `with_cache` also the unpaged key table and the slots, (case, k_cache, slot_ids).
    """
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    if integer:
        k_cache = torch.randint(-2, 3, (S, L, Di), generator=gen).float()
        k_cache[:, 5] = k_cache[:, 2]
        q_idx = torch.randint(-2, 3, (T, Hi, Di), generator=gen).float()
        weights = torch.randint(1, 5, (T, Hi), generator=gen) * 0.25
    else:
        k_cache = torch.randn(S, L, Di, generator=gen)
        q_idx = torch.randn(T, Hi, Di, generator=gen)
        weights = torch.rand(T, Hi, generator=gen) + 0.1
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(torch.int64)
    if dtype in (torch.bfloat16, torch.uint8):
        q_idx = q_idx.bfloat16().float()
    slot_ids = torch.tensor(slots, dtype=torch.int64)
    pool, new, tables = page_cache(k_cache, slot_ids, cu, positions, block_size, seed, dtype)
    case = dict(q_idx=q_idx, weights=weights, k_pool=pool, k_new=new, cu_seqlens=cu, block_tables=tables,
                positions=positions)
    return (case, k_cache, slot_ids) if with_cache else case


CASES = {
    "prefill_decode_mix": dict(),
    "chunked_prefill": dict(slots=(1, 2), starts=(12, 0), lengths=(9, 7), S=3),
    "single_decode_many_heads": dict(slots=(0,), starts=(39,), lengths=(1,), S=1, Hi=20, Di=24),
    "empty_sequence": dict(slots=(2, 1, 0), starts=(3, 0, 30), lengths=(2, 0, 3), S=3),
    "exact_ties": dict(slots=(1, 2), starts=(12, 0), lengths=(9, 7), S=3, integer=True),
    "block_size_1": dict(block_size=1),
    "bf16_pool": dict(dtype=torch.bfloat16),
    "fp8_pool": dict(dtype=torch.uint8),  # uint8 rows: E4M3 codes + an E8M0 scale byte (quantize.fp8_cache)
    # blocks of 16: a 16-position Triton tile lies in one cache block (its rows read from one scalar address)
    "bf16_pool_blocks_of_16": dict(dtype=torch.bfloat16, block_size=16),
    "fp8_pool_blocks_of_16": dict(dtype=torch.uint8, block_size=16),
    # several sequences deep in a longer context (37 whole blocks before position 299), decode and a short chunk
    "long_context_several": dict(L=300, slots=(2, 0, 1), starts=(299, 131, 57), lengths=(1, 1, 3), S=3,
                                 dtype=torch.bfloat16),
}


def assert_tie_free(score_rows, topk, gap=1e-4):
    """Guard for oracle comparisons: the best topk+1 scores of every row are pairwise >= gap apart."""
    for s in score_rows:
        top = torch.sort(s, descending=True).values[: topk + 1]
        top = top[torch.isfinite(top)]
        assert top.numel() < 2 or float((top[:-1] - top[1:]).min()) > gap, "tie in oracle data: change the seed"


def scores_of(q, w, keys):
    """[T, Lk] index scores of one sequence (no causal mask): relu(q @ k^T) weighted over heads."""
    return torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q, keys)))


# --------------------------------------------------------------------------------------- oracles


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


def test_reference_matches_transformers_deepseek_v32_indexer(hf_deepseek_v32):
    """DeepseekV32Indexer (identity rotary) == graph-side projections/norm + our op, order included."""
    torch.manual_seed(3)
    Hi, Di, T, topk = 16, 16, 24, 7  # 16 heads: a position scores exactly 0 only if all 16 relu to 0
    cfg = hf_deepseek_v32.DeepseekV32Config(
        hidden_size=48, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=Hi, index_head_dim=Di,
        index_topk=topk, num_hidden_layers=1, vocab_size=32,
    )  # fmt: skip
    idx_mod = hf_deepseek_v32.DeepseekV32Indexer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        idx_mod.k_norm.weight.uniform_(0.5, 1.5)
        idx_mod.k_norm.bias.normal_(0.0, 0.3)
        x, q_resid = torch.randn(1, T, 48), torch.randn(1, T, 32)
        rot = (torch.ones(1, T, 8), torch.zeros(1, T, 8))
        mask = torch.zeros(1, T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        want = idx_mod(x, q_resid, rot, mask, torch.arange(T)[None])[0].long()
        q = idx_mod.wq_b(q_resid[0]).view(T, Hi, Di)
        k = idx_mod.k_norm(idx_mod.wk(x[0]))
        w = idx_mod.weights_proj(x[0]) * Hi**-0.5 * idx_mod.softmax_scale
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    assert_tie_free(scores_of(q, w, k).masked_fill(~causal, float("-inf")), topk)
    cu, pos = torch.tensor([0, T]), torch.arange(T)
    pool, new, tables = page_cache(k[None], torch.tensor([0]), cu, pos, block_size=5)
    got = reference.dsa_indexer_reference(q, w, pool, new, cu, tables, pos, topk=topk)
    want = torch.where(want <= torch.arange(T)[:, None], want, -1)  # HF returns masked slots for t < topk
    assert torch.equal(got, want)
    assert (got[:, 0] >= 0).all() and (got[: topk - 1] == -1).any()


@pytest.fixture(scope="module")
def fla_dsa_naive():
    return load_fla_naive("ops/dsa/naive.py")


def test_reference_matches_fla_naive_dsa_indexer_varlen(fla_dsa_naive):
    """fla naive_dsa_indexer (relu, scale 1, cu_seqlens) on packed prefill == our op with one slot per sequence."""
    gen = torch.Generator().manual_seed(4)
    lengths, Hi, Di, topk = (13, 2, 21), 8, 16, 9
    T = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    q, keys = torch.randn(T, Hi, Di, generator=gen), torch.randn(T, Di, generator=gen)
    w = torch.rand(T, Hi, generator=gen)
    for n in range(len(lengths)):
        b, e = int(cu[n]), int(cu[n + 1])
        causal = torch.arange(e - b)[None, :] <= torch.arange(e - b)[:, None]
        assert_tie_free(scores_of(q[b:e], w[b:e], keys[b:e]).masked_fill(~causal, float("-inf")), topk)
    want = fla_dsa_naive.naive_dsa_indexer(
        q[None], keys[None], w[None], topk=topk, scale=1.0, activation="relu", cu_seqlens=cu
    )[0]
    cache = torch.zeros(len(lengths), max(lengths), Di)
    for n in range(len(lengths)):
        cache[n, : lengths[n]] = keys[cu[n] : cu[n + 1]]
    local = torch.cat([torch.arange(n) for n in lengths])
    pool, new, tables = page_cache(cache, torch.arange(len(lengths)), cu, local, block_size=4)
    got = reference.dsa_indexer_reference(q, w, pool, new, cu, tables, local, topk=topk)
    assert torch.equal(got, want)


def test_reference_tie_rule_and_padding():
    """Rows list all causal positions by (score desc, position asc) when topk > pos+1, then -1 padding."""
    case, k_cache, slot_ids = make_case(seed=1, **CASES["exact_ties"], with_cache=True)
    got = reference.dsa_indexer_reference(**case, topk=40)
    slots = slot_ids[torch.searchsorted(case["cu_seqlens"][1:], torch.arange(got.shape[0]), right=True)]
    ties = 0
    for t in range(got.shape[0]):
        pos = int(case["positions"][t])
        keys = k_cache[slots[t], : pos + 1]
        score = scores_of(case["q_idx"][t : t + 1], case["weights"][t : t + 1], keys)[0]
        row = got[t].tolist()
        assert row[pos + 1 :] == [-1] * (40 - pos - 1)
        assert [(-float(score[p]), p) for p in row[: pos + 1]] == sorted((-float(score[p]), p) for p in range(pos + 1))
        ties += int((score[row[1 : pos + 1]] == score[row[:pos]]).sum())
    assert ties > 10


# ------------------------------------------------------------------------------------ CPU path


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("topk", [1, 6, 64])
@pytest.mark.parametrize("tile_positions", [None, 24])
def test_cpu_matches_reference(name, topk, tile_positions, monkeypatch):
    """Equal to the reference; also with key tiles of 24 positions (3 blocks of 8, 1 of 24 or 16: a running top-k
    merged over many tiles, the last one partial)."""
    if tile_positions:
        monkeypatch.setattr(cpu, "_TILE_POSITIONS", tile_positions)
    case = make_case(seed=2, **CASES[name])
    assert torch.equal(cpu.dsa_indexer_cpu(**case, topk=topk), reference.dsa_indexer_reference(**case, topk=topk))


def test_cpu_chunking(monkeypatch):
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 100)
    case = make_case(seed=5, **CASES["chunked_prefill"])
    assert torch.equal(cpu.dsa_indexer_cpu(**case, topk=5), reference.dsa_indexer_reference(**case, topk=5))


# ------------------------------------------------------------------------------ ONNX + ORT path


def onnx_model(case, topk, with_function=True, **tiles):
    """Model with one DSAIndexer node (+ its function, `tiles`: its key-tile arguments)."""
    onnx_schema.register()
    Hi, Di = case["q_idx"].shape[1:]
    cache_type = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
                  torch.uint8: TensorProto.UINT8}[case["k_pool"].dtype]
    inputs = [
        helper.make_tensor_value_info("q_idx", TensorProto.FLOAT, ["T", Hi, Di]),
        helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", Hi]),
        helper.make_tensor_value_info("k_pool", cache_type, ["NB", "BS", case["k_pool"].shape[-1]]),
        helper.make_tensor_value_info("k_new", TensorProto.FLOAT, ["T", Di]),
        helper.make_tensor_value_info("cu_seqlens", TensorProto.INT64, ["N1"]),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["N", "B"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"]),
    ]
    node = onnx_schema.make_node(*[i.name for i in inputs], "indices", topk=topk)
    out = helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", topk])
    graph = helper.make_graph([node], "dsa", inputs, [out])
    opsets = [helper.make_opsetid("", ort.ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    functions = [ort.function_proto(fp8_pool=cache_type == TensorProto.UINT8, **tiles)] if with_function else []
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


@pytest.mark.parametrize("with_function", [False, True])
def test_schema_checker_and_strict_shape_inference(with_function):
    model = onnx_model(make_case(), 6, with_function)
    model.graph.ClearField("output")
    model.graph.output.append(helper.make_tensor_value_info("indices", TensorProto.INT64, None))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    out_type = inferred.graph.output[0].type.tensor_type
    assert out_type.elem_type == TensorProto.INT64
    assert [d.dim_param or d.dim_value for d in out_type.shape.dim] == ["T", 6]
    assert {a.name for a in model.graph.node[0].attribute} == {"topk", "plugin_version", "plugin_namespace"}


# default key tiles; tiles of one block (many Loop iterations); tiles of 384 floats: 3 blocks of 8 positions for a
# sequence of fewer than 5 tokens (16 floats a position), 2 for one of 6 (24): a sequence's 4 whole blocks before
# position 39 in a tile of 3 and a partial tile of 1, not a multiple of the tile
TILE_FORMS = {"default": {}, "one_block_tiles": dict(tile_elems=1), "uneven_tiles": dict(tile_elems=384)}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("topk", [1, 6, 64])
@pytest.mark.parametrize("form", list(TILE_FORMS))
def test_ort_function_matches_reference(name, topk, form):
    """Equal to the reference, also with a running top-k merged over key tiles of one block each."""
    import onnxruntime

    case = make_case(seed=6, **CASES[name])
    model = onnx_model(case, topk, **TILE_FORMS[form])
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {}
    for k, v in case.items():
        if v.dtype == torch.bfloat16:  # numpy has no bf16: feed the bits as an OrtValue
            v = onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(torch.int16).numpy().view(np.uint16),
                                                                        TensorProto.BFLOAT16)
        else:
            v = v.numpy()
        feed[k] = v
    got = torch.from_numpy(sess.run(None, feed)[0])
    assert torch.equal(got, reference.dsa_indexer_reference(**case, topk=topk))


# ------------------------------------------------------------- triton (interpreter, subprocess)


def test_triton_in_interpreter_subprocess():
    """Run this file's ``triton_inner`` tests in a fresh process with TRITON_INTERPRET=1."""
    run_triton_inner_tests(__file__)


inner_triton = pytest.mark.triton_inner  # deselected outside the interpreter subprocess (see conftest)


@inner_triton
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_n", [16, 64])
def test_inner_triton_matches_reference(name, block_n):
    from moe_export.plugins.dsa_indexer import triton_kernel

    case = make_case(seed=7, **CASES[name])
    for topk in (1, 6, 64):
        got = triton_kernel.dsa_indexer_triton(**case, topk=topk, block_n=block_n)
        assert torch.equal(got, reference.dsa_indexer_reference(**case, topk=topk))


@inner_triton
def test_inner_triton_reads_keys_through_the_pool_table():
    """The kernel reads the key pool only through the pool table (here row 1 of two: the
    NaN pool of row 0 would poison the scores); a garbage row reads no pool memory (finite scores, valid ids)."""
    from moe_export.plugins.dsa_indexer import triton_kernel
    from moe_export.plugins.pool_table import device_pool_table

    case = make_case(seed=11, **CASES[list(CASES)[-1]])
    pool = case["k_pool"]
    poison = torch.full_like(pool, 0xFF if pool.dtype == torch.uint8 else float("nan"))  # fp8: NaN codes
    args = (case["k_new"], case["cu_seqlens"], case["block_tables"], case["positions"])
    got = triton_kernel.dsa_indexer_launch(case["q_idx"], case["weights"], device_pool_table([poison, pool]), 1,
                                           pool.shape[1], pool.dtype, *args, topk=6)  # fmt: skip
    assert torch.equal(got, reference.dsa_indexer_reference(**case, topk=6))
    garbage = torch.tensor([[poison.data_ptr(), poison.shape[0], 5]])
    got = triton_kernel.dsa_indexer_launch(case["q_idx"], case["weights"], garbage, 0, pool.shape[1], pool.dtype,
                                           *args, topk=6)  # fmt: skip
    assert got.shape == (case["q_idx"].shape[0], 6) and int(got.max()) < case["block_tables"].shape[1] * pool.shape[1]


@inner_triton
def test_inner_triton_small_chunks_match_reference():
    """Chunks of a few tokens x one block of positions (a tiny scratch budget): the same indices."""
    from moe_export.plugins.dsa_indexer import sizes, triton_kernel

    case = make_case(seed=9, **CASES[list(CASES)[-1]])
    for topk in (1, 6):
        got = triton_kernel.dsa_indexer_triton(**case, topk=topk, block_n=16, budget_bytes=2000)
        assert torch.equal(got, reference.dsa_indexer_reference(**case, topk=topk))
        length = case["block_tables"].shape[1] * case["k_pool"].shape[1]
        size = sizes.workspace_bytes(case["q_idx"].shape[0], length, topk, budget_bytes=2000)
        workspace = torch.full((size,), 0xFF, dtype=torch.uint8)
        got = triton_kernel.dsa_indexer_triton(**case, topk=topk, block_n=16, budget_bytes=2000, workspace=workspace)
        assert torch.equal(got, reference.dsa_indexer_reference(**case, topk=topk))


@inner_triton
def test_inner_triton_chunked_topk_matches_one_sort_without_host_sync():
    """The indexer's top-k runs in bounded chunks (the select kernel merges each chunk into a running top-k,
    ties to the lower position) with no value read back to the host; equal to one stable sort of all scores,
    at edge shapes: one candidate, topk larger than the row, a row with no candidate, NaN-free exact ties."""
    from host_sync import no_host_sync

    from moe_export.plugins.dsa_indexer import cpu, sizes, triton_kernel

    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(-3, 4, (11, 70), generator=gen).float()  # many exact ties
    scores[scores < -2] = float("-inf")  # not candidates
    scores[3] = float("-inf")  # a token with no candidate at all
    scores[4, 1:] = float("-inf")  # one candidate
    scores[5, :7] = -0.0  # -0 and +0 tie: both are zero scores
    for topk, chunks in ((1, [(11, 70)]), (5, [(1, 7)]), (80, [(3, 16)])):
        want = cpu.select_topk(scores, topk)
        for chunk in chunks:
            with no_host_sync():
                got = triton_kernel.chunked_topk(lambda t0, t1, c0, c1, buf: scores[t0:t1, c0:c1], 11, 70, topk, chunk,
                                                 scores.device)  # fmt: skip
            assert torch.equal(got, want), (topk, chunk)
    # every buffer in a caller's workspace (TensorRT: the plugin's second output), poisoned first
    tc, lc = 3, 16
    workspace = torch.full((tc * sizes.per_token_bytes(lc, 5) + 3 * 256,), 0xFF, dtype=torch.uint8)
    with no_host_sync():
        got = triton_kernel.chunked_topk(lambda t0, t1, c0, c1, buf: scores[t0:t1, c0:c1], 11, 70, 5, (tc, lc),
                                         scores.device, workspace=workspace)  # fmt: skip
    assert torch.equal(got, cpu.select_topk(scores, 5))
    with pytest.raises(ValueError, match="too small"):
        triton_kernel.chunked_topk(lambda *a: None, 11, 70, 5, (tc, lc), scores.device, workspace=workspace[:100])


def test_indexer_scratch_bounded_at_long_context():
    from moe_export.plugins.dsa_indexer import sizes

    budget = sizes.DEFAULT_SCRATCH_BUDGET
    long = sizes.scratch_bytes(16384, 1 << 20, 2048)
    assert long <= budget and long == sizes.scratch_bytes(16384, 1 << 21, 2048)
    assert 16384 * ((1 << 20) + 1) * 4 > 200 * budget  # the [T, max_pos + 1] fp32 scores of before
