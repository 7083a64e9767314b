"""Collective nodes of the per-rank graphs: `AllReduce` (sum) and `AllGather` over the tp or ep group (and the
wide-EP all-to-all); on TensorRT, plugins inside each rank's engine (`tensorrt_plugin.py`, `nccl.py`)."""
