"""What this project assumes about TensorRT's closed core, each assumption a named contract with its source.

Nothing of TensorRT's compiled core (libnvinfer, the ONNX parser library) can be installed or run on this
project's machines. The builder, the runner and the plugin modules are written against these statements; the
CPU stand-in (`tests/tensorrt_standin.py`) enforces them, and a test fails where our graphs or code break one.
Sources are cited as file:line at the named commit of the public repositories (read, never copied):

  onnx/onnx-tensorrt @ 96e78110 (2024-06-17)           the ONNX parser TensorRT ships (open source)
  NVIDIA/TensorRT @ a892d222 (2026-07-07)              include/NvInfer.h, include/NvInferRuntime.h
  NVIDIA/TensorRT-LLM (file @ commit as named)         how TensorRT-LLM builds and runs engines
  tensorrt_bindings/plugin (10.9.0.34, 11.4.0.106)     the QDP package in the pinned bindings wheels (.whl/)

Re-check a contract when its source moves; the README's one command for a TensorRT machine is where they get
checked against the real core.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    name: str
    statement: str
    source: str


def _c(name: str, statement: str, source: str) -> Contract:
    return Contract(name, " ".join(statement.split()), " ".join(source.split()))


CONTRACTS = {c.name: c for c in (
    _c("PARSER_UINT8_WEIGHTS_BECOME_INT32",
       """The ONNX parser converts every UINT8 initializer (external data or inline) to INT32, one word per byte,
       before any layer sees it; a UINT8 weight feeding a plugin therefore arrives as INT32 (4x the bytes) and
       matches no UINT8 format combination. INT8, INT32, INT64, FLOAT16, BFLOAT16, BOOL and INT4 initializers
       are kept as they are (raw bytes).""",
       "onnx-tensorrt WeightsContext.cpp:266-277 (external data), :308-320 (inline), :356-358 (types kept)"),
    _c("ADD_CONSTANT_NO_UINT8",
       "INetworkDefinition::addConstant does not accept DataType::kUINT8 weights.",
       "TensorRT include/NvInfer.h:8780"),
    _c("PARSER_PLUGIN_FIELDS",
       """A plugin node's attributes become plugin fields typed by the ONNX attribute type, whatever the creator
       declares: INT -> one kINT32, FLOAT -> one kFLOAT32, STRING -> kCHAR bytes (the std::string's data, which
       the QDP layer reads with its terminating NUL); attributes the creator declares but the node lacks are
       skipped with a warning.""",
       "onnx-tensorrt onnxOpImporters.cpp:6112-6170 (loadFields / copyField)"),
    _c("ALIASED_PLUGIN_IO_MAY_COPY",
       """An aliased plugin output (getAliasedInput) is honoured only with PreviewFeature::kALIASED_PLUGIN_IO_10_03,
       and "TensorRT may insert copies to facilitate this capability": read-modify-write of a network input through
       an aliased plugin output is not guaranteed to be in place (a pool could be copied every step, O(pool)). So
       no pool is a network input or output and no plugin output is aliased: the runner owns the pools, the
       engine gets their device addresses in one small input (`pool_table` [P, 3] int64, plugins/pool_table.py),
       and the plugins write rows in place through it with the step's block tables / slot ids as offsets, as
       TensorRT-LLM's attention plugin gets `host_kv_cache_pool_pointers` + `kv_cache_block_offsets` and its
       recurrent (Mamba) layers `conv_state_ptr_{i}` / `rnn_state_ptr_{i}` + `slot_mapping`.""",
       "TensorRT include/NvInferRuntime.h:1190-1201 (IPluginV3OneBuild::getAliasedInput: \"TensorRT may insert "
       "copies to facilitate this capability\"; the same sentence in the Python bindings' get_aliased_input "
       "docstring); TensorRT-LLM tensorrt_llm/runtime/generation.py (GenerationSession.__init__, the engine's expected "
       "I/O names: kv_cache_block_offsets, host_kv_cache_pool_pointers; with paged_state conv_state_ptr_{i}, "
       "rnn_state_ptr_{i}, slot_mapping), cpp/tensorrt_llm/plugins/gptAttentionPlugin (INT64 block-pointer "
       "inputs in supportsFormatCombination); line numbers of the TensorRT-LLM files not pinned here"),
    _c("SET_INPUT_SHAPE_RETURNS_BOOL",
       """IExecutionContext::setInputShape returns false when the name is not an input or the shape is refused
       (outside the active optimization profile); setTensorAddress returns false on a bad name or a pointer
       without 256-byte alignment; enqueueV3 returns false when it could not enqueue. Nothing raises: every
       return value must be checked. Before enqueueV3 every input needs a non-null address, a zero-volume one
       included (torch gives an empty tensor address 0).""",
       "TensorRT include/NvInferRuntime.h:4120-4134 (setInputShape), :4354-4384 (setTensorAddress; non-null "
       "inputs before enqueueV3 at :4360-4361)"),
    _c("PROFILE_BOUNDS",
       """Input shapes must lie within [min, max] of the active optimization profile for every dimension; the
       runner's pools (slots S, blocks NB) are therefore sized no larger than the profile the engine was built
       with.""",
       "TensorRT include/NvInferRuntime.h:4120-4134; IOptimizationProfile::setDimensions (NvInferRuntime.h)"),
    _c("USER_MANAGED_DEVICE_MEMORY",
       """createExecutionContext(kUSER_MANAGED) allocates no activation memory; the user supplies it with
       setDeviceMemoryV2(ptr, size), size at least ICudaEngine::getDeviceMemorySizeV2() (the maximum over all
       profiles); the memory is in use from enqueueV3 until the work completes, so contexts that never run
       concurrently (one stream) may share one buffer. Python names: ICudaEngine.device_memory_size_v2,
       create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED), and
       IExecutionContext.set_device_memory(memory, size), which the bindings implement with
       `tensorrt::lambdas::context_set_device_memory_v2(IExecutionContext&, unsigned long, long)` (the
       setDeviceMemoryV2 wrapper) and document as ":arg memory: 256-byte aligned device memory. :arg size: ...
       at least as large as CudaEngine.get_device_memory_size_v2" (checked against the pinned wheels by
       tests/test_tensorrt_engine.py: BINDING_NAMES).""",
       "TensorRT include/NvInferRuntime.h:3075-3090, :2931, :3190-3200, :4060-4082; tensorrt_bindings/tensorrt.so "
       "(10.9.0.34, 11.4.0.106): the method name, its docstring and the mangled lambda "
       "_ZN8tensorrt7lambdas28context_set_device_memory_v2ERN8nvinfer117IExecutionContextEml"),
    _c("QDP_NO_WORKSPACE",
       """Quickly-deployable (QDP) plugins get no TensorRT workspace: the JIT enqueue hands `impl` only inputs,
       outputs and the stream, and the plugin class defines no workspace size. Scratch a plugin needs is
       therefore declared as an extra plugin output, which TensorRT places in the execution context's device
       memory (counted by getDeviceMemorySizeV2) like any activation.""",
       "tensorrt_bindings/plugin/_plugin_class.py (11.4.0.106):255-309 _TemplateJITPlugin.enqueue, no "
       "get_workspace_size in the file; (10.9.0.34) the same"),
    _c("QDP_AOT_CODE_PTX_OR_CUBIN",
       """A QDP `aot_impl` returns the kernel's code as str or bytes, "PTX/CUBIN": a cubin for the build GPU's
       architecture needs no JIT by the driver at load; PTX is the fallback for other architectures. The
       launch parameters include the dynamic shared memory per block (`shared_mem`).""",
       "tensorrt_bindings/plugin/_plugin_class.py (11.4.0.106):402-426"),
    _c("AOT_PARAMETERS_EXACT",
       """TensorRT's QDP AOT launch passes the input pointers, the int32 extra args, the output pointers and
       nothing else; Triton >= 3.3 kernels declare two more pointer parameters (global and profile scratch) that
       Triton's own launcher fills with null when their sizes are 0. The AOT code is therefore the PTX with
       those two parameters removed from the entry, refused when the kernel needs scratch or names them
       (`plugins/aot_contract.py`).""",
       "tensorrt_bindings/plugin/_lib.py (11.4.0.106):550, _plugin_class.py:402-436; triton "
       "backends/nvidia/driver.c (3.9.0):1478,1514-1520, driver.py:294-325"),
    _c("AOT_SHARED_MEMORY_OPT_IN_UNKNOWN",
       """Whether TensorRT's AOT launcher raises cudaFuncAttributeMaxDynamicSharedMemorySize for a kernel that
       declares more than 48 KiB of dynamic shared memory is not documented in the headers or the QDP source.
       Kernels declaring more than 48 KiB therefore have no AOT implementation here (the JIT launch, which
       Triton opts in, is used) until a TensorRT machine shows the AOT launch working.""",
       "TensorRT include/NvInferRuntime.h (IKernelLaunchParams: no opt-in flag); CUDA Programming Guide, "
       "dynamic shared memory above 48 KB requires explicit opt-in"),
    _c("PLUGIN_RUNS_WHILE_BUILDING",
       """TensorRT executes plugins while timing tactics during the build, with unspecified input contents.
       A collective plugin must not communicate then (ranks build independently): TensorRT-LLM's NCCL
       plugins return at once while the engine is being built and create their communicator only at run
       time, from the MPI session (rank 0 of the group sends the NCCL unique id).""",
       "TensorRT-LLM cpp/tensorrt_llm/plugins/ncclPlugin/allreducePlugin.cpp @ 005b299b "
       "(AllreducePlugin::enqueue: `if (isBuilding()) return 0;`), cpp/tensorrt_llm/plugins/common/plugin.cpp "
       "@ 03cff08f (initCommMap: skipped while building; ncclUniqueId sent over COMM_SESSION)"),
    _c("PARSER_OPERATORS",
       """The ONNX parser imports an op of the default domain with its builtin importer when onnx-tensorrt's
       operator matrix marks it supported, for the input types the matrix lists (UINT8 only as a network input
       or output); any other op type falls back to the plugin registry and needs a registered creator (our
       domain's ops). The matrix as data: tests/tensorrt_parser_rules.py.""",
       "onnx-tensorrt docs/operators.md:11 (UINT8 only at network I/O), :15-213 (the matrix); "
       "ModelImporter.cpp:166-167 (no importer -> FallbackPluginImporter)"),
    _c("CAST_TO_FP8_REJECTED",
       """Cast / CastLike to FLOAT8E4M3FN are parsed into an ICastLayer with kFP8, which TensorRT rejects ("TRT
       will reject casts to FP8"); Cast's types are FP32, FP16, BF16, INT32, INT64, UINT8, BOOL. FP8 values come
       only from QuantizeLinear (and go back through DequantizeLinear).""",
       "onnx-tensorrt onnxOpImporters.cpp:385-400 (Cast, the sentence at :390), :402-412 (CastLike), "
       "docs/operators.md:40-41, :6-9 (FP8 a quantized type, reached only through quantization)"),
    _c("QDQ_STATIC_SYMMETRIC",
       """QuantizeLinear / DequantizeLinear: the scale must have a static shape (a per-row scale [T] of a dynamic
       T is refused) and positive values when constant; quantization is to FP8, INT8 or INT4 only (the zero
       point's type chooses it; UINT8 becomes INT8) and symmetric (zero point 0); UINT8 data is refused; a
       per-axis scale must match a static dimension.""",
       "onnx-tensorrt onnxOpImporters.cpp:1349-1355 (UINT8 refused), :1385-1404 (positive constant scale), "
       ":1418-1419 (\"Dynamic shape for scale tensor is not supported.\"), :1444-1462 (zero-point type), "
       ":1492-1495 (zero point all zeros), :1522-1540 (per-axis scale count), :1593-1596 (FP8, INT8, INT4 only); "
       "docs/operators.md:61, :141"),
    _c("MAX_AUX_STREAMS",
       """IBuilderConfig::setMaxAuxStreams(0) enforces single-stream inference; by default TensorRT's heuristics
       may run independent branches on auxiliary streams, in an order that can differ between engines. Each MoE
       layer's tp all-reduce (shared expert) and ep all-to-all (routed experts) are independent branches, and
       NCCL needs the same collective order on every rank, so the builder sets 0. Python:
       IBuilderConfig.max_aux_streams (in the 10.9 and 11.4 bindings).""",
       "TensorRT include/NvInfer.h:11170-11197 (setMaxAuxStreams), python/src/infer/pyCore.cpp:1757; "
       "tensorrt_bindings/tensorrt.so (10.9.0.34, 11.4.0.106): `max_aux_streams`"),
    _c("TRT_ORDERS_BY_DATA_DEPENDENCIES",
       """A built engine runs a layer after the layers that produce its inputs; no other order is promised: the
       builder fuses, reorders and (without setMaxAuxStreams(0)) spreads independent layers over streams by its own
       heuristics and timings, so two independent plugin layers may run in either order, differently in engines
       built separately (every rank builds its own). NCCL, for its part, needs every communicator's collectives
       submitted in the same order on all its ranks, and operations on different communicators ordered alike
       ("applications should ensure operations are submitted in the same order across ranks"), else a hang.
       So each collective plugin of a rank graph takes the graph's previous collective's output as a last input,
       `after` (`GraphForm.ordered_collectives`, `GraphBuilder.collective`): every two collectives are ordered
       by a data path, the graph's order, the same on every rank (tests/test_collective_order.py).""",
       "TensorRT include/NvInfer.h:11170-11197 (setMaxAuxStreams: the only execution-order control; independent "
       "layers on auxiliary streams otherwise), no ordering of independent layers in INetworkDefinition / "
       "IBuilderConfig; NCCL user guide, usage/communicators.html \"Using multiple NCCL communicators "
       "concurrently\"; NVIDIA/nccl issue #195 (the maintainers: operations on two communicators in different "
       "orders across ranks can deadlock)"),
    _c("AOT_PTX_ISA_FOR_THE_DRIVER",
       """An AOT plugin's PTX is compiled by the driver when the engine loads (cuModuleLoadData JIT), and a driver
       refuses PTX of an ISA newer than its CUDA version (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): ISA 8.0 came with
       CUDA 12.0, 9.0 with CUDA 13.0. TensorRT 10.13's CUDA-12 build runs on CUDA 12.0 to 12.9 drivers, so its AOT
       PTX is ISA 8.0 (`aot_contract.TENSORRT_PTX_VERSION`). Triton writes the ISA of the ptxas it ships unless
       told (`ptx_version` option): Triton 3.9's (CUDA 13) gives 9.4, which no CUDA-12 driver loads.""",
       "CUDA Driver API cuModuleLoadData / CUDA_ERROR_UNSUPPORTED_PTX_VERSION (cuda.h); PTX ISA reference, "
       "release notes table (ISA 8.0: CUDA 12.0; ISA 9.0: CUDA 13.0); TensorRT 10.13 support matrix (CUDA 12.0-12.9 "
       "for the cu12 packages); triton backends/nvidia/compiler.py (3.9.0) lines 58-85 (ptx_get_version from the "
       "ptxas version, overridden by options.ptx_version) and 563-564 (the PTX's .version line)"),
    _c("PROBE_MEMORY_BOUNDS_THE_ENGINE_BELOW",
       """An engine's device memory (getDeviceMemorySizeV2: activations and the scratch of its layers, shared between
       tensors whose lifetimes do not overlap) is the peak over its layers' needs, so an engine of the first layers
       of a network, built with the same profile and settings, needs no more than the whole network's engine: a
       probe over the plan's budget means the whole engine is too (`tensorrt_build.probe_memory`). Not the
       converse: the whole engine is still checked after its build.""",
       "TensorRT include/NvInferRuntime.h (ICudaEngine::getDeviceMemorySizeV2: the device memory an execution "
       "context needs, the user-managed allocation the runner makes); TensorRT developer guide, \"Memory\" "
       "(activation memory: intermediate tensors, reused between layers whose lifetimes do not overlap)"),
    _c("ENGINE_STREAMS",
       """Building to a stream: IBuilder::buildSerializedNetworkToStream(network, config, IStreamWriter&) writes
       the plan in chunks through the writer's write(data) -> bytes written (Python:
       build_serialized_network_to_stream, trt.IStreamWriter; in the 11.4 bindings, not in 10.9, where
       build_serialized_network returns an IHostMemory that is a buffer, written without a copy). Loading:
       IRuntime::deserializeCudaEngine(IStreamReaderV2&) pulls the plan by read(num_bytes, stream) -> bytes and
       seek(offset, where) (Python: deserialize_cuda_engine(stream_reader_v2), trt.IStreamReaderV2, both
       bindings); a short read is asked again for the rest.""",
       "TensorRT include/NvInfer.h:11661-11680, include/NvInferRuntime.h:642-675 (IStreamWriter), :719 "
       "(IStreamReaderV2); python/src/infer/pyCore.cpp:691-790 (PyStreamReaderV2::read: chunks until num_bytes, "
       "each copied to host or device memory, 0 bytes aborts), :830-850 (PyStreamWriter::write), :1590-1597, :1820, "
       ":1840-1841; python/docstrings/infer/pyCoreDoc.h:1010-1088; tensorrt_bindings/tensorrt.so (10.9.0.34, "
       "11.4.0.106)"),
)}


def contract(name: str) -> Contract:
    """The contract `name` (KeyError names the known ones)."""
    if name not in CONTRACTS:
        raise KeyError(f"no TensorRT contract {name!r}; known: {sorted(CONTRACTS)}")
    return CONTRACTS[name]


# The parser's weight conversion (PARSER_UINT8_WEIGHTS_BECOME_INT32), by ONNX element type: UINT8 -> INT32,
# DOUBLE -> FLOAT; the types listed as kept pass through.
PARSER_WEIGHT_CONVERSION = {2: 6, 11: 1}  # TensorProto.UINT8 -> INT32, DOUBLE -> FLOAT
PARSER_WEIGHT_KEPT = (1, 3, 6, 7, 9, 10, 16, 22)  # FLOAT, INT8, INT32, INT64, BOOL, FLOAT16, BFLOAT16, INT4
# Dynamic shared memory a kernel gets without an explicit opt-in (AOT_SHARED_MEMORY_OPT_IN_UNKNOWN).
DEFAULT_DYNAMIC_SHARED_MEMORY = 48 * 1024


# USER_MANAGED_DEVICE_MEMORY: Python name the runner calls -> what the compiled bindings must hold for it (the name
# as a string, and the C++ symbol or docstring fragment that says which C++ call it is).
STREAM_BINDINGS = {  # name -> the pinned bindings that have it (MAX_AUX_STREAMS, ENGINE_STREAMS)
    "max_aux_streams": ("10.9", "11.4"),
    "IStreamReaderV2": ("10.9", "11.4"),
    "stream_reader_v2": ("10.9", "11.4"),
    "build_serialized_network_to_stream": ("11.4",),
    "IStreamWriter": ("11.4",),
}
BINDING_NAMES = {
    "set_device_memory": (b"context_set_device_memory_v2ERN8nvinfer117IExecutionContextEml",
                          b":arg size: Size of the provided memory. This must be at least as large as "
                          b"CudaEngine.get_device_memory_size_v2"),
    "device_memory_size_v2": (b":ivar device_memory_size_v2:",),
    "create_execution_context": (b"ExecutionContextAllocationStrategy",),
    "USER_MANAGED": (b"ExecutionContextAllocationStrategy",),
}


def parser_weight_type(onnx_elem_type: int) -> int:
    """The element type TensorRT's ONNX parser gives an initializer of `onnx_elem_type`."""
    return PARSER_WEIGHT_CONVERSION.get(onnx_elem_type, onnx_elem_type)
