"""Short causal depthwise convolution + SiLU with a carried window state (KDA's q/k/v conv):
``reference`` (naive fp32), ``cpu`` (vectorised gathers), ``triton_kernel``, ``onnx_schema`` (node
``ShortConv``), ``ort`` (ONNX function body), ``tensorrt_plugin`` (QDP).

Submodules are imported on demand; ``tensorrt_plugin`` is the only one that imports ``tensorrt``.
"""
