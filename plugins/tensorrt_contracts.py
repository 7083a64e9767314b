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
       return value must be checked.""",
       "TensorRT include/NvInferRuntime.h:4120-4134 (setInputShape), :4365-4384 (setTensorAddress)"),
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
