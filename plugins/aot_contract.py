"""The AOT launch contract between TensorRT's QDP AOT path and a Triton-compiled kernel (no tensorrt import).

TensorRT passes, in this order, the plugin's input pointers, the `extra_args` (int32 only), the output pointers,
and nothing else: tensorrt_bindings/plugin/_lib.py (11.4.0.106) line 550 ("extra_args: Symbolic expressions for
scalar inputs to the kernel, located after the tensor inputs and before the tensor outputs"), _plugin_class.py
lines 402-436 (the aot_impl's result is checked there; every extra arg must be a SymInt32).
Triton >= 3.3 appends two pointer parameters to every kernel, the global scratch and the profile scratch, and its
own launcher fills them: triton backends/nvidia/driver.c (3.9.0) line 1478 ("+ 2 for global & profile scratch")
and lines 1514-1520 (appended after the kernel's arguments, a null pointer when `metadata.global_scratch_size` /
`profile_scratch_size` is 0: driver.py lines 294-325). TensorRT does not pass them, so a launch of Triton's entry
reads two parameters past TensorRT's list (the segfault seen on the H200).
They are satisfied here by removing them from the PTX entry, which is exact only when the kernel needs no
scratch (both sizes 0) and its body never names them; anything else is refused (ValueError), as is an entry with
fewer parameters than TensorRT passes. PTX, not the cubin (whose entry cannot be edited): the driver compiles it
for the GPU when the engine loads, and a driver refuses PTX of a newer ISA than its CUDA version knows
(contract AOT_PTX_ISA_FOR_THE_DRIVER): Triton writes the ISA of the ptxas it ships (Triton 3.9's, CUDA 13: 9.4),
which no CUDA-12 driver loads. So every AOT compile asks Triton for `TENSORRT_PTX_VERSION` (`aot_compile_options`)
and `tensorrt_ptx` refuses PTX of a later ISA.
"""

import re

TENSORRT_PTX_VERSION = 80  # PTX ISA 8.0 (CUDA 12.0): what every driver TensorRT 10.13's CUDA-12 build runs on loads


def aot_compile_options(**options) -> dict:
    """Triton compile options of an AOT kernel for TensorRT: `options` with the PTX ISA pinned."""
    return {**options, "ptx_version": TENSORRT_PTX_VERSION}


def tensorrt_ptx(kernel, plugin_id: str, num_params: int) -> str:
    """The PTX of Triton CompiledKernel `kernel` whose entry takes exactly the `num_params` parameters TensorRT
    passes (inputs + extra args + outputs); ValueError when the kernel needs Triton's scratch."""
    for size in ("global_scratch_size", "profile_scratch_size"):
        if int(getattr(kernel.metadata, size, 0) or 0):
            raise ValueError(f"{plugin_id}: the AOT kernel needs Triton's {size[:-5]} ({getattr(kernel.metadata, size)} "
                             "B per program), which TensorRT's AOT launch cannot pass: use tensorrt.prefer_aot: false")
    return ptx_with_parameters(kernel.asm["ptx"], kernel.metadata.name, num_params, plugin_id)


def ptx_with_parameters(ptx: str, entry: str, num_params: int, plugin_id: str) -> str:
    """`ptx` with the parameters of `.entry entry` past the first `num_params` removed; ValueError when it has
    fewer, when the body names a removed one, or when its ISA is later than `TENSORRT_PTX_VERSION`."""
    version = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
    if version is None or int(version.group(1)) * 10 + int(version.group(2)) > TENSORRT_PTX_VERSION:
        found = "no .version" if version is None else f"PTX ISA {version.group(1)}.{version.group(2)}"
        raise ValueError(f"{plugin_id}: {found}; TensorRT's CUDA-12 drivers load PTX ISA up to "
                         f"{TENSORRT_PTX_VERSION // 10}.{TENSORRT_PTX_VERSION % 10} (compile with "
                         "aot_contract.aot_compile_options)")
    head = re.search(rf"\.entry\s+{re.escape(entry)}\s*\((.*?)\)", ptx, re.S)
    if head is None:
        raise ValueError(f"{plugin_id}: no .entry {entry} in the PTX")
    params = [p.strip() for p in head.group(1).split(",") if p.strip()]
    if len(params) < num_params:
        raise ValueError(f"{plugin_id}: the PTX entry takes {len(params)} parameters, TensorRT passes {num_params}")
    for extra in params[num_params:]:
        name = extra.split()[-1]
        if ptx.count(name) > 1:  # named again in the body: read there
            raise ValueError(f"{plugin_id}: the kernel reads {name}, a parameter TensorRT does not pass")
    kept = ",\n\t".join(params[:num_params])
    return ptx[: head.start(1)] + "\n\t" + kept + "\n" + ptx[head.end(1) :]
