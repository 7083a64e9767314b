"""DSAIndexer: DeepSeek-V3.2 lightning indexer (causal relu-scored, head-weighted top-k positions per token),
feeding SparseMLAAttention. Reference, fast CPU, Triton, ONNX schema, ORT function, TensorRT plugin;
`tensorrt_plugin` is not imported here (it needs `tensorrt`)."""

from .cpu import dsa_indexer_cpu, select_topk
from .inputs import indexer_inputs
from .reference import dsa_indexer_reference

__all__ = ["dsa_indexer_cpu", "dsa_indexer_reference", "indexer_inputs", "select_topk"]
