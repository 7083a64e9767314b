"""MoEMXFP4: this rank's routed experts with MXFP4 weights (W4A16), SiTU or SwiGLU, weighted fp32 partial sum.
Reference, fast CPU, Triton, ONNX schema, ORT function, TensorRT plugin; `tensorrt_plugin` is not imported
here (it needs `tensorrt`)."""

from .cpu import group_by_expert, moe_mxfp4_cpu
from .inputs import moe_inputs
from .reference import gated_activation, moe_mxfp4_reference

__all__ = ["gated_activation", "group_by_expert", "moe_inputs", "moe_mxfp4_cpu", "moe_mxfp4_reference"]
