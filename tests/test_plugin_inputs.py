"""Each op's reference, CPU and Triton implementations prepare their inputs with one function (`plugins/<op>/inputs.py`):
a malformed input is refused by all three with the same message, naming the op and the input, before anything is
computed or launched."""

from __future__ import annotations

import pytest
import torch

from moe_export.plugins.dsa_indexer import cpu as dsa_cpu, reference as dsa_ref, triton_kernel as dsa_triton
from moe_export.plugins.moe_mxfp4 import cpu as moe_cpu, reference as moe_ref, triton_kernel as moe_triton
from moe_export.plugins.paged_cache_write import cpu as write_cpu, reference as write_ref
from moe_export.plugins.paged_cache_write import triton_kernel as write_triton
from moe_export.plugins.sparse_mla_attention import cpu as mla_cpu, reference as mla_ref
from moe_export.plugins.sparse_mla_attention import triton_kernel as mla_triton

T, N, B, BS = 3, 1, 2, 4
CU = torch.tensor([0, T])
TABLES = torch.tensor([[0, 1]])
POS = torch.arange(T)


def refused(fns, args, kwargs, match):
    messages = set()
    for fn in fns:
        with pytest.raises(ValueError, match=match) as err:
            fn(*args, **kwargs)
        messages.add(str(err.value))
    assert len(messages) == 1, messages  # one function, one message


def test_sparse_mla_attention_refuses_a_kv_new_of_the_wrong_width():
    q, pool, new = torch.zeros(T, 2, 10), torch.zeros(2, BS, 10), torch.zeros(T, 9)
    fns = (mla_ref.sparse_mla_attention_reference, mla_cpu.sparse_mla_attention_cpu, mla_triton.sparse_mla_attention_triton)
    refused(fns, (q, pool, new, CU, TABLES, POS, None), dict(scale=1.0, kv_lora_rank=8),
            r"SparseMLAAttention: kv_new must be \[T, Dc\+Dr\] = \[3, 10\]")


def test_sparse_mla_attention_refuses_positions_of_another_step():
    q, pool, new = torch.zeros(T, 2, 10), torch.zeros(2, BS, 10), torch.zeros(T, 10)
    fns = (mla_ref.sparse_mla_attention_reference, mla_cpu.sparse_mla_attention_cpu, mla_triton.sparse_mla_attention_triton)
    refused(fns, (q, pool, new, CU, TABLES, torch.arange(T + 1), None), dict(scale=1.0, kv_lora_rank=8),
            r"SparseMLAAttention: positions must be \[T\] = \[3\]")


def test_dsa_indexer_refuses_weights_of_the_wrong_heads():
    q, w, pool, new = torch.zeros(T, 2, 8), torch.zeros(T, 3), torch.zeros(2, BS, 8), torch.zeros(T, 8)
    fns = (dsa_ref.dsa_indexer_reference, dsa_cpu.dsa_indexer_cpu, dsa_triton.dsa_indexer_triton)
    refused(fns, (q, w, pool, new, CU, TABLES, POS), dict(topk=2), r"DSAIndexer: weights must be \[T, Hi\] = \[3, 2\]")


def test_paged_cache_write_refuses_rows_wider_than_the_pool():
    pool, rows = torch.zeros(2, BS, 8), torch.zeros(T, 9)
    fns = (write_ref.paged_cache_write_reference, write_cpu.paged_cache_write_, write_triton.paged_cache_write_triton)
    refused(fns, (pool, rows, CU, TABLES, POS), {}, r"PagedCacheWrite: a torch.float32 pool for rows of D = 9")


def test_moe_mxfp4_refuses_routing_weights_of_another_shape():
    E, D, I = 2, 32, 32
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    experts = (torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8), torch.zeros(E, 2 * I, D // 32, dtype=torch.uint8),
               torch.zeros(E, D, I // 2, dtype=torch.uint8), torch.zeros(E, D, I // 32, dtype=torch.uint8))
    fns = (moe_ref.moe_mxfp4_reference, moe_cpu.moe_mxfp4_cpu, moe_triton.moe_mxfp4_triton)
    refused(fns, (x, torch.zeros(T, 2, dtype=torch.int64), torch.zeros(T, 3), *experts), dict(expert_offset=0),
            r"MoEMXFP4: expert_weights must be \[T, k\] = \[3, 2\]")
