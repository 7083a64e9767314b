"""SparseMLAAttention: absorbed MLA over a paged latent cache `[c | k_pe]` (blocks addressed by block tables),
restricted to top-k positions per query (dense causal when no indices are given). Reference, fast CPU, Triton,
ONNX schema, ORT function, TensorRT plugin; `tensorrt_plugin` is not imported here (it needs `tensorrt`)."""

from .cpu import sparse_mla_attention_cpu
from .inputs import attention_inputs, step_indices, token_sequences
from .reference import gather_context, sparse_mla_attention_reference

__all__ = ["attention_inputs", "gather_context", "sparse_mla_attention_cpu", "sparse_mla_attention_reference",
           "step_indices", "token_sequences"]
