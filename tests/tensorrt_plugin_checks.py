"""Our TensorRT plugin modules under TensorRT's real `tensorrt.plugin` (one version per process).

Run by `test_tensorrt_plugins.py` in a subprocess per pinned TensorRT version (env MOE_EXPORT_TRT_VERSION),
over the exported graphs of real tiny builds (env MOE_EXPORT_TRT_GRAPHS: model.onnx paths, os.pathsep-joined).
The file name has no `test_` prefix so the main test run does not collect it. See `tensorrt_standin.py` for
what is real and what is faked.

Concrete shapes of the "tiny engine" (ENV): T tokens, N sequences, S state slots, NB cache blocks of BS
positions, B blocks per block table. Dims ONNX shape inference leaves unnamed are, in our graphs, token dims
(`Reshape(x, [-1, heads, dim])`) except `local_slots` = Range(0, N).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tensorrt_standin as standin  # noqa: E402

VERSION = os.environ.get("MOE_EXPORT_TRT_VERSION", "")
# the graphs TensorRT parses: those exported for backend tensorrt (folder `<preset>-tensorrt<n>`)
GRAPHS = [Path(p) for p in os.environ.get("MOE_EXPORT_TRT_GRAPHS", "").split(os.pathsep) if "-tensorrt" in p]
ENV = {"T": 5, "N": 2, "N_plus_1": 3, "S": 3, "NB": 7, "BS": 4, "B": 3}
EXPECTED = {  # op type -> (has JIT impl, has AOT impl, aliased input of each output)
    "GatedDeltaScan": (True, True, [-1]),
    "ShortConv": (True, True, [-1]),
    "SparseMLAAttention": (True, True, [-1]),
    "DSAIndexer": (True, False, [-1, -1]),
    "PagedCacheWrite": (True, True, [-1]),
    "MoEMXFP4": (True, False, [-1, -1]),
    "AllReduce": (True, False, [-1]),
    "AllGather": (True, False, [-1]),
    "MoEDispatch": (True, False, [-1] * 6),
    "MoECombine": (True, False, [-1]),
}

assert VERSION in standin.PINNED_WHEELS, f"MOE_EXPORT_TRT_VERSION={VERSION!r}: run via test_tensorrt_plugins.py"
assert GRAPHS, "MOE_EXPORT_TRT_GRAPHS is empty: run via test_tensorrt_plugins.py"
trt, trtp = standin.install(VERSION)

from moe_export.export.backends.onnxruntime import _value_types  # noqa: E402
from moe_export.export.backends.tensorrt.engine import register_plugins  # noqa: E402
from moe_export.plugins import (  # noqa: E402 (imported after standin.install, as the lines around)
    DOMAIN,  # noqa: E402
    tensorrt_common,  # noqa: E402
)
from moe_export.plugins.registry import OP_FOLDERS  # noqa: E402
from tensorrt_parser_rules import parser_refusals  # noqa: E402

COLLECTIVES = {"AllReduce", "AllGather", "MoEDispatch", "MoECombine"}

register_plugins()
QDP = sys.modules["tensorrt.plugin._lib"].QDP_REGISTRY


def plugin_nodes() -> list[tuple[str, onnx.NodeProto, dict]]:
    """(graph label, node, value types) of every plugin node TensorRT sees; value types include the
    initializers (weights feed plugins too: MoE experts, conv taps), listed under "__initializers__"."""
    out = []
    for path in GRAPHS:
        model = onnx.load(str(path), load_external_data=False)
        types = _value_types(model)
        for init in model.graph.initializer:
            types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
        types["__initializers__"] = {init.name for init in model.graph.initializer}
        for node in model.graph.node:
            if node.domain == DOMAIN and node.op_type in EXPECTED:
                out.append((path.parent.name, node, types))
    return out


NODES = plugin_nodes()


def first_of_each() -> list:
    seen, out = set(), []
    for label, node, types in NODES:
        dense = node.op_type == "SparseMLAAttention" and "dense" in node.input[6]
        if (label, node.op_type, dense) not in seen:
            seen.add((label, node.op_type, dense))
            out.append(pytest.param(node, types, id=f"{label}-{node.op_type}{'-dense' if dense else ''}"))
    return out


def io_of(node, types):
    """(input TensorRT types, input dims with names, output types, output shapes for ENV) from the graph."""

    def dims(name):
        shape = types[name].tensor_type.shape.dim
        unnamed = "N" if name == "local_slots" else "T"  # Range(0, N) / Reshape(x, [-1, ...]) outputs
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param in ENV else unnamed)
                for d in shape]  # fmt: skip

    in_types = standin.parsed_input_types(node, types, types["__initializers__"])
    in_dims = [dims(i) for i in node.input]
    out_types = [standin.ONNX_TO_TRT[types[o].tensor_type.elem_type] for o in node.output]
    if node.op_type == "AllGather":  # the gathered dim is unnamed in ONNX: group_size times the input's
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        shape = [standin.symbolic(d).evaluate(ENV) for d in in_dims[0]]
        shape[attrs["axis"] % len(shape)] *= attrs["group_size"]
        return in_types, in_dims, out_types, [shape]
    out_shapes = [[standin.symbolic(d).evaluate(ENV) for d in dims(o)] for o in node.output]
    if node.op_type == "MoEDispatch":  # send_rows is unnamed in ONNX: T * K rows (each token at most K times)
        out_shapes[3] = [ENV["T"] * out_shapes[1][1]]
    return in_types, in_dims, out_types, out_shapes


def create(node, request=standin.QuickPluginCreationRequest.PREFER_JIT, phase=standin.TensorRTPhase.BUILD):
    creator = standin.find_creator(node, namespace_from_domain=False)
    fields, missing = standin.parser_fields(creator, node)
    assert not missing, f"{node.name}: attributes the QDP registration declares but the node lacks: {missing}"
    return creator, creator.create_plugin(node.op_type, DOMAIN, fields, phase,
                                          standin.creation_request(node, request))  # fmt: skip


# ------------------------------------------------------------------------------------- registration
def test_every_plugin_registered_with_its_implementations():
    for op, (jit, aot, _) in EXPECTED.items():
        definition = QDP[f"{DOMAIN}::{op}"]
        assert (definition.impl_func is not None, definition.aot_impl_func is not None) == (jit, aot), op
    assert {k for k in QDP if k.startswith(DOMAIN + "::")} == {f"{DOMAIN}::{op}" for op in EXPECTED}


def test_graphs_hold_every_plugin_op():
    assert {node.op_type for _, node, _ in NODES} == set(EXPECTED)


# -------------------------------------------------------------- ONNX-level contract (every node)
def test_every_node_found_and_carries_every_declared_field():
    """Found through `plugin_namespace` (parsers before 10.13 ignore the domain) and carrying every field its
    QDP registration declares, with no attribute of a plugin's own left undeclared."""
    lookup_attrs = {"plugin_version", "plugin_namespace"}
    for label, node, _ in NODES:
        creator = standin.find_creator(node, namespace_from_domain=False)
        assert creator is not None, f"{label}/{node.name}: no creator for {node.op_type} (plugin_namespace?)"
        declared = {f.name for f in creator.field_names}
        assert declared == set(QDP[f"{DOMAIN}::{node.op_type}"].input_attrs)
        carried = {a.name for a in node.attribute}
        assert declared <= carried, f"{label}/{node.name}: missing {declared - carried}"
        assert carried - lookup_attrs <= declared, f"{label}/{node.name}: undeclared {carried - lookup_attrs - declared}"


# ----------------------------------------------------------------------------- creation and build
@pytest.mark.parametrize("node,types", first_of_each())
def test_creation_types_shapes_formats_aliasing(node, types):
    jit, aot, aliases = EXPECTED[node.op_type]
    if jit and aot:  # both implementations: QDP refuses unless the network (or node) says which
        with pytest.raises(ValueError, match="both AOT and JIT"):
            create(node, standin.QuickPluginCreationRequest.UNKNOWN)
    creator, plugin = create(node)
    assert type(plugin).__name__ == "_TemplateJITPlugin"
    for a in node.attribute:  # the values the impl will see, after the parser's encoding
        if a.name in plugin.attrs:
            got = plugin.attrs[a.name]
            if a.type == onnx.AttributeProto.STRING:
                assert tensorrt_common.text(got) == a.s.decode() and got.endswith("\0")
            elif a.type == onnx.AttributeProto.INT:
                assert tensorrt_common.scalar(got) == a.i and isinstance(tensorrt_common.scalar(got), int)
            else:
                assert tensorrt_common.scalar(got) == pytest.approx(a.f, rel=1e-7)
    in_types, in_dims, out_types, out_shapes = io_of(node, types)
    built = standin.build_phase(plugin, in_types, in_dims, ENV)
    assert built["output_types"] == out_types
    assert built["output_shapes"] == out_shapes  # the QDP shape function agrees with our ONNX schema
    standin.require_supported(node, in_types, out_types, built)  # after the parser's weight conversion
    assert built["aliases"] == aliases
    # engine (de)serialization: the fields the JIT plugin stores recreate the same attributes at run time
    stored = plugin.get_fields_to_serialize()
    again = creator.create_plugin(node.op_type, DOMAIN, stored, standin.TensorRTPhase.RUNTIME,
                                  standin.QuickPluginCreationRequest.STRICT_JIT)  # fmt: skip
    assert sorted(again.attrs) == sorted(plugin.impl_attr_names)
    for k in plugin.impl_attr_names:
        assert np.array_equal(np.asarray(again.attrs[k]), np.asarray(plugin.attrs[k]))


def _ptx_param_kinds(ptx: str, kernel: str) -> list[str]:
    entry = ptx[ptx.index(f".entry {kernel}(") :].split(")", 1)[0]
    return ["ptr" if ".ptr" in line else line.split()[1] for line in entry.splitlines() if ".param" in line]


@pytest.mark.parametrize("node,types", [p for p in first_of_each() if EXPECTED[p.values[0].op_type][1]])
def test_aot_launch_parameters_and_extra_args(node, types, monkeypatch):
    """The AOT plugin's kernel (real Triton compile to PTX for sm_90; the build GPU's capability is the one
    faked value), launch grid / block / shared memory and int32 extras, in TensorRT's argument order."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    module = sys.modules[f"moe_export.plugins.{OP_FOLDERS[node.op_type]}.tensorrt_plugin"]
    compiled = []
    real = module.aot_kernel_code
    monkeypatch.setattr(module, "aot_kernel_code", lambda kernel, pid, n: compiled.append(kernel) or real(kernel, pid, n))
    _, plugin = create(node, standin.QuickPluginCreationRequest.PREFER_AOT)
    assert type(plugin).__name__ == "_TemplateAOTPlugin"
    in_types, in_dims, _, _ = io_of(node, types)
    launch = standin.aot_launch(plugin, standin.build_phase(plugin, in_types, in_dims, ENV), ENV)
    # the PTX whose entry takes exactly TensorRT's parameters: inputs, int32 extras, outputs (Triton's two
    # scratch pointers, which the compiled kernel declares after them, removed: aot_kernel_code's contract)
    ptx = launch["ptx"].decode() if isinstance(launch["ptx"], bytes) else launch["ptx"]
    assert ".target sm_90" in ptx and not ptx.startswith("\x7fELF") and launch["shared"] == compiled[-1].metadata.shared
    assert ".version 8.0\n" in ptx  # the ISA a CUDA-12 driver loads (contract AOT_PTX_ISA_FOR_THE_DRIVER), not 9.x
    kinds = _ptx_param_kinds(ptx, launch["kernel"])
    n_in, n_out, n_extra = len(node.input), len(node.output), len(launch["extras"])
    assert kinds == ["ptr"] * n_in + [".u32"] * n_extra + ["ptr"] * n_out
    assert len(_ptx_param_kinds(compiled[-1].asm["ptx"], launch["kernel"])) == len(kinds) + 2
    assert all(dtype == standin.PluginArgDataType.INT32 for dtype, _ in launch["extras"])
    extras = [v for _, v in launch["extras"]]
    shape = {name: [standin.symbolic(d).evaluate(ENV) for d in dims] for name, dims in zip(node.input, in_dims)}
    T, N = ENV["T"], ENV["N"]
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    row = attrs["pool"]  # issue 18, defect 4: the pool's table row, never a pool pointer
    assert node.input[1 if node.op_type in ("SparseMLAAttention",) else {"GatedDeltaScan": 5, "ShortConv": 2,
                                                                         "PagedCacheWrite": 0}[node.op_type]] == "pool_table"
    if node.op_type == "GatedDeltaScan":
        from moe_export.plugins.gated_delta_scan.sizes import block_sizes

        _, H, K = shape[node.input[0]]
        V = shape[node.input[2]][2]
        assert extras == [row, T]
        assert launch["grid"] == [-(-V // block_sizes(K, V)[1]), H, N]
    elif node.op_type == "ShortConv":
        from moe_export.plugins.short_conv.sizes import block_sizes

        C, W = shape[node.input[1]]
        assert extras == [row, T]
        assert launch["grid"] == [-(-C // block_sizes(C, W)[1]), N, 1]
    elif node.op_type == "PagedCacheWrite":
        assert extras == [row, N, T, attrs["block_size"], ENV["B"]]
        assert launch["grid"] == [T, 1, 1]
    else:
        H = shape[node.input[0]][1]
        assert extras == [row, N, T, attrs["block_size"], ENV["B"], shape[node.input[6]][1]]
        assert launch["grid"] == [T, -(-H // 16), 1]
    assert launch["block"][0] % 32 == 0 and launch["block"][1:] == [1, 1]
    assert launch["shared"] >= 0


def test_collectives_are_in_engine_plugins_that_do_nothing_while_building():
    """Issue 18, defect 9: one engine per rank with its collectives inside as plugins (TensorRT-LLM's pattern):
    while the engine is built the impl returns at once (contract PLUGIN_RUNS_WHILE_BUILDING); at run time it
    needs the communicator its `group` field names, registered by the runner."""
    from moe_export.plugins.collectives import nccl

    reduce = QDP[f"{DOMAIN}::AllReduce"].impl_func
    gather = QDP[f"{DOMAIN}::AllGather"].impl_func
    x = _tensor(trt.bfloat16, (5, 16), (16, 1), 0x7000)
    out = _tensor(trt.bfloat16, (5, 16), (16, 1), 0x8000)
    nccl.set_communicators({})
    with nccl.building():
        assert reduce(x, x, "tp\0", "sum\0", [out], stream=7) is None  # `after`: any earlier tensor, never read
        assert gather(x, x, "tp\0", np.array([-1], np.int32), np.array([2], np.int32), [out], stream=7) is None
    assert not nccl.is_building()
    with pytest.raises(RuntimeError, match="no communicator for group 'ep'"):
        reduce(x, x, "ep\0", "sum\0", [out], stream=7)
    dispatch = QDP[f"{DOMAIN}::MoEDispatch"].impl_func
    combine = QDP[f"{DOMAIN}::MoECombine"].impl_func
    ids = _tensor(trt.int64, (5, 2), (2, 1), 0x9000)
    with nccl.building():  # TensorRT times the all-to-alls too: nothing may be sent then
        assert dispatch(x, ids, out, x, "ep\0", *(np.array([v], np.int32) for v in (8, 8, 40)), [out] * 6,
                        stream=7) is None
        assert combine(out, ids, ids, ids, x, x, "ep\0", [out], stream=7) is None
    with pytest.raises(RuntimeError, match="no communicator for group 'ep'"):
        dispatch(x, ids, out, x, "ep\0", *(np.array([v], np.int32) for v in (8, 8, 40)), [out] * 6, stream=7)
    groups = {n.op_type: {a.name for a in n.attribute} for _, n, _ in NODES
              if n.op_type in ("AllReduce", "AllGather", "MoEDispatch", "MoECombine")}
    assert groups["AllReduce"] >= {"group", "reduce_op"} and groups["AllGather"] >= {"group", "axis", "group_size"}
    assert groups["MoEDispatch"] >= {"group", "num_experts", "group_size", "max_recv_rows"} and "group" in groups["MoECombine"]


def test_dispatch_receive_bound_is_static_and_required():
    """The dp graph's MoEDispatch carries the recipe's receive bound ep * ceil(max_num_tokens / tp) as its static
    received-row dim (the other groups' batches are not visible to a shape expression); a node without a bound
    (an ONNX Runtime graph, exact sizes) fails the build with the way out."""
    from moe_export.common.recipe import load_recipe
    from moe_export.graphs.sharding import Mapping

    limits = load_recipe("tiny-cpu.yaml")[0].limits
    label, node, types = next(x for x in NODES if x[1].op_type == "MoEDispatch")
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    assert attrs["max_recv_rows"] == Mapping(8, 3, 2, 8, "dp").max_recv_rows(limits.max_num_tokens) == 8 * -(-limits.max_num_tokens // 2)
    _, plugin = create(node)
    in_types, in_dims, _, _ = io_of(node, types)
    built = standin.build_phase(plugin, in_types, in_dims, ENV)
    assert built["output_shapes"][0][0] == attrs["max_recv_rows"] and built["output_shapes"][4] == [attrs["group_size"]]
    unbounded = onnx.helper.make_node("MoEDispatch", list(node.input), list(node.output), domain=DOMAIN,
                                      **{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                                         if a.name != "max_recv_rows"}, max_recv_rows=0)  # fmt: skip
    _, plugin = create(unbounded)
    with pytest.raises(ValueError, match="export the graph for backend tensorrt"):
        standin.build_phase(plugin, in_types, in_dims, ENV)


def test_aot_kernel_above_48_kib_of_shared_memory_is_refused():
    """Issue 18, defect 7: SparseMLA needs ~110 KiB of dynamic shared memory at K3 widths; nothing shows TensorRT's
    AOT launcher opting a kernel in (contract AOT_SHARED_MEMORY_OPT_IN_UNKNOWN), so such a kernel is refused with
    the way out (the JIT launch), never launched without its shared memory. A kernel that needs Triton's global
    scratch, or reads a parameter TensorRT does not pass, is refused too."""
    from types import SimpleNamespace

    ptx = ".version 8.0\n.target sm_90\n.entry k(\n\t.param .u64 .ptr .global k_param_0,\n\t.param .u32 k_param_1,\n\t.param .u64 k_param_2,\n" \
          "\t.param .u64 k_param_3\n)\n{\n\tld.param.b32 %r1, [k_param_1];\n}\n"  # fmt: skip

    def kernel(shared=48 * 1024, scratch=0, code=ptx):
        return SimpleNamespace(metadata=SimpleNamespace(shared=shared, name="k", global_scratch_size=scratch,
                                                        profile_scratch_size=0), asm={"ptx": code})  # fmt: skip

    with pytest.raises(ValueError, match="prefer_aot: false"):
        tensorrt_common.aot_kernel_code(kernel(shared=110 * 1024), "x::SparseMLAAttention", 2)
    with pytest.raises(ValueError, match="global_scratch"):
        tensorrt_common.aot_kernel_code(kernel(scratch=64), "x", 2)
    assert tensorrt_common.aot_kernel_code(kernel(), "x", 2).count("k_param_") == 3  # two declared, one read
    assert "k_param_2" not in tensorrt_common.aot_kernel_code(kernel(), "x", 2)
    with pytest.raises(ValueError, match="reads k_param_1"):
        tensorrt_common.aot_kernel_code(kernel(), "x", 1)
    with pytest.raises(ValueError, match="TensorRT passes 5"):
        tensorrt_common.aot_kernel_code(kernel(), "x", 5)
    with pytest.raises(ValueError, match="PTX ISA 9.4; TensorRT's CUDA-12 drivers load PTX ISA up to 8.0"):
        tensorrt_common.aot_kernel_code(kernel(code=ptx.replace(".version 8.0", ".version 9.4")), "x", 2)


def test_parser_refuses_a_uint8_weight_feeding_a_plugin():
    """Issue 18, defect 1: MXFP4 experts as uint8 initializers would be widened to INT32 by the ONNX parser
    (contract PARSER_UINT8_WEIGHTS_BECOME_INT32) and match no combination; our TensorRT graphs pass int8 views."""
    label, node, types = next((x for x in NODES if x[1].op_type == "MoEMXFP4"), (None, None, None))
    parsed = standin.parsed_input_types(node, types, types["__initializers__"])
    weights = [t for name, t in zip(node.input[3:7], parsed[3:7]) if name in types["__initializers__"]]
    assert len(weights) == 4 and all(t in (trt.int8, trt.uint8) for t in weights)  # uint8 would have become INT32
    as_uint8 = dict(types)
    for name in node.input[3:7]:  # the four MXFP4 byte tensors (input 7 is the int64 row counts)
        as_uint8[name] = onnx.helper.make_tensor_type_proto(onnx.TensorProto.UINT8, [1])
    widened = standin.parsed_input_types(node, as_uint8, types["__initializers__"])
    assert widened[3:7] == [trt.int32] * 4
    _, plugin = create(node)
    in_types, in_dims, out_types, _ = io_of(node, types)
    built = standin.build_phase(plugin, in_types, in_dims, ENV)
    with pytest.raises(standin.ParserRefusal, match="PARSER_UINT8_WEIGHTS_BECOME_INT32"):
        standin.require_supported(node, widened, out_types, built)


def test_tensorrt_graphs_keep_the_pools_outside_the_network():
    """Issue 18, defect 4 (contract ALIASED_PLUGIN_IO_MAY_COPY): no pool is an input or output of the graphs
    TensorRT parses; every pool op takes the pool table."""
    for path in GRAPHS:
        model = onnx.load(str(path), load_external_data=False)
        standin.require_pools_outside_io(model)
        pool_ops = [n for n in model.graph.node if n.op_type in ("GatedDeltaScan", "ShortConv", "PagedCacheWrite",
                                                                 "SparseMLAAttention", "DSAIndexer")]  # fmt: skip
        assert pool_ops and all("pool_table" in n.input for n in pool_ops)


def test_stand_in_refuses_an_aliased_plugin_output():
    """Issue 18, defect 4: a plugin output aliased to an input (how the pools used to be updated) is refused by the
    stand-in's build (contract ALIASED_PLUGIN_IO_MAY_COPY: TensorRT may insert copies), with the reason."""
    _register_scratch(
        """
        import tensorrt.plugin as trtp

        @trtp.register("NAME")
        def _desc(pool: trtp.TensorDesc) -> trtp.TensorDesc:
            return pool.aliased()

        @trtp.impl("NAME")
        def _run(pool, outputs, stream):
            pass
        """,
        "aliased",
    )
    ns = f"scratch_{VERSION.replace('.', '_')}"
    creator = standin.get_plugin_registry().get_creator("aliased", "1", ns)
    plugin = creator.create_plugin("aliased", ns, standin.PluginFieldCollection(), standin.TensorRTPhase.BUILD,
                                   standin.QuickPluginCreationRequest.PREFER_JIT)  # fmt: skip
    with pytest.raises(standin.ParserRefusal, match="ALIASED_PLUGIN_IO_MAY_COPY"):
        standin.build_phase(plugin, [trt.float32], [["S", 4]], ENV)


# ----------------------------------------------------------------------- buffers handed to impl
def _tensor(dtype, shape, strides, ptr):
    t = trtp.Tensor()
    t.dtype, t.shape, t.strides, t.data_ptr = dtype, trtp.Shape(tuple(shape)), tuple(strides), ptr
    t._stream = 7
    return t


def test_bf16_buffers_get_an_interface():
    """QDP's own interface refuses BF16; ours views it as int16 (then torch views it back as bf16)."""
    bf16 = _tensor(trt.bfloat16, (5, 2, 16), (32, 16, 1), 0x7000)
    with pytest.raises(ValueError, match="not supported"):
        bf16.__cuda_array_interface__  # noqa: B018
    iface = tensorrt_common.cuda_array_interface(bf16)
    assert iface["typestr"] == "<i2" and iface["shape"] == (5, 2, 16) and iface["strides"] == (64, 32, 2)
    assert iface["data"] == (0x7000, False)
    fp32 = _tensor(trt.float32, (3, 4), (4, 1), 0x9000)
    ours, theirs = tensorrt_common.cuda_array_interface(fp32), fp32.__cuda_array_interface__
    assert {k: ours[k] for k in ("shape", "typestr", "data", "strides")} == {
        k: theirs[k] for k in ("shape", "typestr", "data", "strides")
    }


# -------------------------------------------- what this TensorRT version does with the naive forms
def _register_scratch(source: str, name: str):
    namespace = {}
    code = textwrap.dedent(source).replace("NAME", f"scratch_{VERSION.replace('.', '_')}::{name}")
    exec(compile(code, f"<scratch {name}>", "exec", dont_inherit=True), namespace)  # noqa: S102
    return namespace


def test_string_annotations_fail_registration():
    """`from __future__ import annotations` (strings for annotations) breaks `register` on every version."""
    with pytest.raises((TypeError, ValueError)):
        _register_scratch(
            """
            from __future__ import annotations
            import tensorrt.plugin as trtp

            @trtp.register("NAME")
            def _desc(x: trtp.TensorDesc, k: int) -> trtp.TensorDesc:
                return x.like()
            """,
            "stringly",
        )


def test_builtin_numeric_fields_on_this_version():
    """`int` / `float` plugin attributes from the parser's 1-element INT32 / FLOAT32 fields: TypeError under
    NumPy >= 2 on 10.x-11.1 (hence our 1-element array attributes), fine on 11.2+; strings keep the NUL."""
    _register_scratch(
        """
        import tensorrt.plugin as trtp

        @trtp.register("NAME")
        def _desc(x: trtp.TensorDesc, k: int, s: str) -> trtp.TensorDesc:
            return x.like()

        @trtp.impl("NAME")
        def _run(x, k, s, outputs, stream):
            pass
        """,
        "builtin",
    )
    ns = f"scratch_{VERSION.replace('.', '_')}"
    creator = standin.get_plugin_registry().get_creator("builtin", "1", ns)
    node = onnx.helper.make_node("builtin", ["x"], ["y"], k=3, s="silu")
    fields, missing = standin.parser_fields(creator, node)
    assert not missing

    def make():
        return creator.create_plugin("builtin", ns, fields, standin.TensorRTPhase.BUILD,
                                     standin.QuickPluginCreationRequest.PREFER_JIT)  # fmt: skip

    if tuple(int(x) for x in VERSION.split(".")) < (11, 2) and int(np.__version__.split(".")[0]) >= 2:
        with pytest.raises(TypeError):
            make()
    else:
        assert make().attrs == {"k": 3, "s": "silu\0"}


# ------------------------------------------- a dp recipe built at world 8 through the stand-in's contracts
class _Parsed:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def builder_api(log: list, device_memory) -> dict:
    """TensorRT's builder API over the stand-in core, as `export/backends/tensorrt/engine.py` drives it: the parser does
    what TensorRT's ONNX parser does with each plugin node of the rank graph (lookup by `plugin_namespace`, fields
    by the parser's encoding, creation through the real `tensorrt.plugin` registry with the network's PREFER_*
    request) and the builder's calls on each created plugin (output types and shapes, format negotiation after
    the parser's weight conversion, aliasing) at the tiny ENV shapes; `build_serialized_network` records
    whether the collectives were in their build-time state. `device_memory(path)` -> the engine's activation
    memory (not knowable without TensorRT: the test says what it assumes)."""
    from moe_export.plugins.collectives import nccl

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs, self.outputs, self.path = flags, [], [], None

        num_inputs = property(lambda self: len(self.inputs))
        num_outputs = property(lambda self: len(self.outputs))

        def get_input(self, i):
            return _Parsed(name=self.inputs[i])

        def get_output(self, i):
            return _Parsed(name=self.outputs[i])

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.num_errors = network, 0

        def get_error(self, i):
            return self.errors[i]

        def parse_from_file(self, path):
            model = onnx.load(path, load_external_data=False)
            self.errors = parser_refusals(model)  # the standard ops the real parser refuses
            self.num_errors = len(self.errors)
            if self.errors:
                return False
            types = _value_types(model)
            for init in model.graph.initializer:
                types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
            types["__initializers__"] = {init.name for init in model.graph.initializer}
            prefer = (standin.QuickPluginCreationRequest.PREFER_AOT if self.network.flags & (1 << 5)
                      else standin.QuickPluginCreationRequest.PREFER_JIT)  # fmt: skip
            ops = []
            for node in model.graph.node:
                if node.domain != DOMAIN:
                    continue
                _, plugin = create(node, prefer)
                in_types, in_dims, out_types, out_shapes = io_of(node, types)
                built = standin.build_phase(plugin, in_types, in_dims, ENV)
                assert built["output_types"] == out_types and built["output_shapes"] == out_shapes, node.name
                standin.require_supported(node, in_types, out_types, built)
                ops.append(node.op_type)
            self.network.inputs = [v.name for v in model.graph.input]
            self.network.outputs = [v.name for v in model.graph.output]
            self.network.path = path
            self.network.collectives = bool(set(ops) & COLLECTIVES)
            log.append(("parse", path, ops))
            return True

    class Config:
        max_aux_streams = -1  # TensorRT's heuristic until set (contract MAX_AUX_STREAMS)

        def set_memory_pool_limit(self, pool, size):
            log.append(("workspace", size))

        def set_preview_feature(self, feature, on):
            pass

        def create_timing_cache(self, blob):
            return _Parsed(serialize=lambda: b"cache")

        def set_timing_cache(self, cache, ignore_mismatch):
            return True

        def add_optimization_profile(self, profile):
            log.append(("profile", profile.shapes))
            return 0

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, low, opt, high):
            self.shapes[name] = (low, opt, high)

    class Builder:
        def __init__(self, logger):
            self.network = None

        def create_network(self, flags):
            self.network = Network(flags)
            return self.network

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            if network.collectives and config.max_aux_streams != 0:  # MAX_AUX_STREAMS: collectives on one stream
                log.append(("refused", network.path, "max_aux_streams"))
                return None
            log.append(("build", network.path, nccl.is_building()))
            return network.path.encode()

        def build_serialized_network_to_stream(self, network, config, writer):
            plan = self.build_serialized_network(network, config)
            if plan is None:
                return False
            half = len(plan) // 2  # in chunks, as TensorRT hands them to the writer
            return writer.write(plan[:half]) + writer.write(plan[half:]) == len(plan)

    if not hasattr(trt, "IStreamWriter"):  # the 10.9 bindings: no streamed build (contract ENGINE_STREAMS)
        del Builder.build_serialized_network_to_stream

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, reader):
            assert isinstance(reader, trt.IStreamReaderV2)  # the plan is streamed in, never held whole
            plan = b""
            while chunk := reader.read(5, 0):
                plan += chunk
            log.append(("deserialized", plan.decode()))
            return _Parsed(device_memory_size_v2=device_memory(plan.decode()), num_layers=1)

    return {"Builder": Builder, "OnnxParser": OnnxParser, "Runtime": Runtime,
            "NetworkDefinitionCreationFlag": _Parsed(STRONGLY_TYPED=0, PREFER_JIT_PYTHON_PLUGINS=4,
                                                     PREFER_AOT_PYTHON_PLUGINS=5),
            "MemoryPoolType": _Parsed(WORKSPACE=0), "PreviewFeature": _Parsed(ALIASED_PLUGIN_IO_10_03=1)}  # fmt: skip


def test_dp_recipe_builds_at_world_8_through_the_standin(tmp_path, monkeypatch):
    """Issue 19: `moe-export build` of a tiny `parallel.attention: dp` recipe with backend tensorrt at world 8
    (tp 2 x dp 4, experts over all 8 ranks) is no longer refused: every rank's whole graph goes through the
    stand-in parser and builder (every plugin node, MoEDispatch / MoECombine included, created by the real
    `tensorrt.plugin` and negotiated under the contracts), built with the collectives idle, one engine per rank.
    Assumed (no TensorRT here): the engine needs exactly the activation memory the plan set aside; one byte
    more is refused."""
    import importlib.machinery

    import yaml
    from moe_export.common.recipe import load_recipe
    from moe_export.export.backends.tensorrt import engine as tensorrt_build
    from moe_export.export.build import build
    from moe_export.export.plan.planner import make_plan, vision_activation_bytes
    from moe_export.common.engine_file import read_engine_file
    from moe_export.export.backends.tensorrt.engine import ENGINE_WORKSPACES

    data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    data.update(name="tiny-dp-trt", backend="tensorrt", model={"source": "synthetic:tiny-k3"})
    data["target"].update(gpu="h100", gpus_per_node=8, memory_gib=4.0)
    data["parallel"] = {"tp": 2, "ep": 8, "attention": "dp"}
    data["quantization"]["kv_cache"] = "fp8"
    path = tmp_path / "tiny-dp-trt.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe, _ = load_recipe(path)
    plan = make_plan(recipe)
    planned = {r.rank: r.memory["activations"] + sum(r.memory.get(f"workspace.{k}", 0) for k in ENGINE_WORKSPACES)
               for r in plan.per_rank}  # fmt: skip
    assert all(r.memory["workspace.moe_all_to_all"] > 0 for r in plan.per_rank)  # the receive buffers are counted

    def device_memory(graph: str) -> int:
        props = {p.key: p.value for p in onnx.load(graph, load_external_data=False).metadata_props}
        if "mapping" not in props:  # K3's vision tower: one engine every rank loads, its own memory plan
            return vision_activation_bytes(plan.config, recipe)
        return planned[json.loads(props["mapping"])["rank"]]

    log: list = []
    for name, value in builder_api(log, device_memory).items():
        monkeypatch.setattr(trt, name, value, raising=False)
    monkeypatch.setattr(trt, "Logger", standin.Logger)
    monkeypatch.setattr(trt, "__spec__", importlib.machinery.ModuleSpec("tensorrt", None))
    monkeypatch.setattr(tensorrt_build, "select_device", lambda: 0)
    out = tmp_path / "engine"
    build(recipe, out)
    ranks = [e for e in log if e[0] == "parse" and "MoEDispatch" in e[2]]  # (the tower graph is parsed too)
    probes = [e for e in ranks if e[1].endswith("probe.onnx")]  # each rank's first layers, built and checked first
    ranks = [e for e in ranks if e not in probes]
    assert len(ranks) == 8 and all({"MoEDispatch", "MoECombine", "MoEMXFP4", "AllGather"} <= set(e[2]) for e in ranks)
    assert len(probes) == 8 and all({"MoEDispatch", "MoECombine", "MoEMXFP4"} <= set(e[2]) for e in probes)
    rank_builds = [e[2] for e in log if e[0] == "build" and e[1] in {r[1] for r in ranks + probes}]
    assert rank_builds == [True] * 16  # every rank's collectives idle while building (probe and whole engine)
    for rank in range(8):
        meta, _ = read_engine_file(out / f"rank{rank}" / f"rank{rank}.engine")
        assert meta["rank"] == rank and meta["device_memory_bytes"] == planned[rank]
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"]["attention"] == "dp" and [r["dp_rank"] for r in config["ranks"]] == [0, 0, 1, 1, 2, 2, 3, 3]
