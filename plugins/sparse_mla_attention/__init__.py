"""SparseMLAAttention: absorbed MLA over a paged latent cache `[c | k_pe]` (blocks addressed by block tables),
restricted to top-k positions per query (dense causal when no indices are given). Reference, fast CPU, Triton,
ONNX schema, ORT function, TensorRT plugin; `tensorrt_plugin` is not imported here (it needs `tensorrt`)."""

from .cpu import sparse_mla_attention_cpu
from .reference import gather_context, sparse_mla_attention_reference, token_sequences

__all__ = ["gather_context", "sparse_mla_attention_cpu", "sparse_mla_attention_reference", "token_sequences"]
