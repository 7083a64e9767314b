"""What a rank's GPU really offers, what runs beside the engine on it, and the rank's host memory.

GPU. A GPU sold as "80 GB" exposes less: NVML (nvidia-smi) reports 81,559 MiB = 79.65 GiB for an H100 80 GB and
143,771 MiB = 140.40 GiB for an H200 141 GB (https://thundergolfer.com/blog/nvidia-gpu-memory-capacity, table of
NVML totals). The planner budgets the smaller of that and the recipe's `target.memory_gib`.
Beside the engine, outside the workspace reserve (which keeps the CUDA context, cuBLAS and allocator slack):
  - NCCL's buffers (`nccl_buffer_bytes`): per communicator of more than one rank, NCCL_BUFFSIZE (4 MiB by
    default, NCCL's environment documentation) per protocol buffer and channel. Assumed here, to be measured on
    the GPU after warm-up: ring collectives (tp all-reduce / all-gather; the ep all-reduce of the tp layout) use
    RING_CHANNELS channels with a SIMPLE and an LL128 buffer each; the dp layout's all-to-all holds, per peer,
    P2P_CHANNELS_PER_PEER channels with a send and a receive buffer each. NVLink SHARP's multicast buffers are not
    counted: the TensorRT runner turns NVLS off (`runtime/engine/tensorrt_nccl.py` NCCL_ENV, with why).
  - the vision tower's activations (`planner.vision_activation_bytes`), one call at a time.
Host, per rank (`host_peak_bytes`): building, the ONNX parser holds the rank's weights and the plan streams to
disk (`common/engine_file.py`: a chunk at a time with bindings that have build_serialized_network_to_stream,
else TensorRT's one IHostMemory of about the plan's size, i.e. the weights again); running, the prefix cache's
pinned state checkpoints and one read chunk of the plan while loading.
"""

from __future__ import annotations

from moe_export.common.engine_file import READ_CHUNK

MIB = 2**20
EXPOSED_GPU_BYTES = {"h100": 81_559 * MIB, "h200": 143_771 * MIB}  # NVML totals (see the module docstring)
NCCL_BUFFSIZE = 4 * MIB
RING_CHANNELS = 16  # assumed (NVLink rings); measured value replaces it
RING_PROTOCOL_BUFFERS = 2  # SIMPLE and LL128, NCCL_BUFFSIZE each (LL's is small)
P2P_CHANNELS_PER_PEER = 2  # assumed, as NCCL_NCHANNELS_PER_NET_PEER


def usable_gpu_bytes(recipe) -> int:
    """Bytes a rank can use: the recipe's memory, at most what the GPU exposes."""
    return min(recipe.memory_bytes, EXPOSED_GPU_BYTES.get(recipe.target.gpu, recipe.memory_bytes))


def nccl_buffer_bytes(mapping) -> int:
    """NCCL's device buffers on a rank of `mapping` whose collectives run over NCCL (`Backend.nccl`)."""
    ring = RING_CHANNELS * RING_PROTOCOL_BUFFERS * NCCL_BUFFSIZE
    rings = (mapping.tp > 1) + (not mapping.all_to_all and mapping.ep > 1)
    peers = mapping.ep - 1 if mapping.all_to_all else 0
    return rings * ring + peers * P2P_CHANNELS_PER_PEER * 2 * NCCL_BUFFSIZE


def host_peak_bytes(parser_weight_bytes: int, checkpoint_host_bytes: int) -> dict[str, int]:
    """A rank's host memory peaks: building with a streamed plan, building with TensorRT's one plan buffer
    (bindings without build_serialized_network_to_stream, e.g. 10.9), and running; `peak` the larger of the
    streamed build and the run."""
    out = {
        "build_streamed": parser_weight_bytes + READ_CHUNK,
        "build_plan_buffer": 2 * parser_weight_bytes,
        "run": checkpoint_host_bytes + READ_CHUNK,
    }
    out["peak"] = max(out["build_streamed"], out["run"])
    return out
