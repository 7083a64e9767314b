"""Gated delta scan (KDA core recurrence): ``reference`` (naive fp32), ``cpu`` (chunked), ``triton_kernel``,
``onnx_schema`` (node ``GatedDeltaScan``), ``ort`` (ONNX function body), ``tensorrt_plugin`` (QDP).

Submodules are imported on demand; ``tensorrt_plugin`` is the only one that imports ``tensorrt``.
"""
