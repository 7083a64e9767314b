"""SparseMLAAttention: absorbed MLA over a latent cache `[c | k_pe]`, restricted to top-k positions per query
(dense causal when no indices are given). Reference, fast CPU, Triton, ONNX schema, ORT function, TensorRT
plugin; `tensorrt_plugin` is not imported here (it needs `tensorrt`)."""

from .cpu import sparse_mla_attention_cpu
from .reference import sparse_mla_attention_reference, token_slots

__all__ = ["sparse_mla_attention_cpu", "sparse_mla_attention_reference", "token_slots"]
