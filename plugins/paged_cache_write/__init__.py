"""PagedCacheWrite: writes a step's new cache rows into a paged pool at each token's block-table row, in place.
Reference, fast CPU (the ONNX Runtime engine's write-back), Triton, ONNX schema, TensorRT plugin (the pool reached
through the pool table); `tensorrt_plugin` is not imported here (it needs `tensorrt`)."""

from .cpu import paged_cache_write_
from .inputs import write_inputs
from .reference import paged_cache_write_reference

__all__ = ["paged_cache_write_", "paged_cache_write_reference", "write_inputs"]
