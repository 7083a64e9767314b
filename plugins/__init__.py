"""moe_export.plugins: one folder per custom op (reference, fast CPU, Triton, ONNX schema,
ONNX Runtime lowering, TensorRT plugin).

Every op's ONNX node lives in domain `DOMAIN` with op type = TensorRT plugin name, so TensorRT's
plugin lookup (op type = plugin name, namespace = domain, `plugin_version` attribute) finds it.
"""

from moe_export.common.engine_config import PLUGIN_DOMAIN as DOMAIN

PLUGIN_NAMESPACE = DOMAIN
PLUGIN_VERSION = "1"
OPSET_VERSION = 1
