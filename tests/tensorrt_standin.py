"""A stand-in of TensorRT's compiled core, so that TensorRT's REAL pure-Python `tensorrt.plugin` runs on CPU.

What is real. `tensorrt.plugin` (register / impl / aot_impl / autotune decorators, signature validation, the
plugin creator, the JIT and AOT plugin classes, field (de)serialization, aliasing, shape expressions,
`KernelLaunchParams`, `SymInt32`) is the unmodified source from NVIDIA's published `tensorrt-cu12-bindings` /
`tensorrt-cu13-bindings` wheels (pinned in the README's test command, downloaded there with `pip download`),
extracted from the wheel and imported as the package `tensorrt.plugin`.

What is faked, and why. The package imports `tensorrt`, whose core is `tensorrt.so` (a pybind11 module over
libnvinfer, which cannot be installed here). This module provides the few symbols the plugin package touches,
as plain Python with the semantics of TensorRT's C++ API as documented:
  - enums (`DataType` and its aliases, `PluginFieldType`, `TensorFormat`, `DimensionOperation`,
    `TensorRTPhase`, `QuickPluginCreationRequest`, `PluginArgType`, `PluginArgDataType`);
  - `PluginField` (its `data` is a NumPy array of the field's type, as the bindings return it) and
    `PluginFieldCollection`; `get_plugin_registry()` (creators by name, version, namespace);
  - the interface base classes the plugin classes derive from (`IPluginV3`, `IPluginV3Quick*`,
    `IPluginCreatorV3Quick`, `ISymExpr`): empty, as the bindings' trampolines are to Python code;
  - dimension expressions (`IDimensionExpr`, an expression builder, `DimsExprs`, `Dims`): a small symbolic
    integer algebra over named dimensions that `evaluate`s for concrete shapes (TensorRT folds constants the
    same way; non-constant expressions stay symbolic until the shapes are known);
  - tensor descriptors (`PluginTensorDesc`, `DynamicPluginTensorDesc`).
And `Core`, which drives a plugin the way TensorRT does (see its docstring), including the ONNX parser's
field encoding (onnx-tensorrt `loadFields` / `copyField`: INT -> one INT32, FLOAT -> one FLOAT32, STRING ->
CHAR bytes with a terminating NUL) and its lookup (op type, `plugin_version`, `plugin_namespace`, `aot`).
Nothing here computes a plugin's result: kernels never run (no GPU); what is checked is everything TensorRT
learns from the plugin module before and during the build, plus what the JIT impl receives as buffers.
"""

from __future__ import annotations

import enum
import importlib.util
import shutil
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"
# Pinned in the README's test command and .ci/run (the same line); versions that exist on PyPI.
PINNED_WHEELS = {"10.9": "tensorrt_cu12_bindings-10.9.0.34", "11.4": "tensorrt_cu13_bindings-11.4.0.106"}


def plugin_package_dir(version: str, wheel_dir: Path = WHEEL_DIR) -> Path:
    """`.whl/<pinned wheel name>/plugin`, extracted from the pinned wheel (downloaded by the test command).

    Safe when several processes (MPI ranks, pytest-xdist workers) ask at once: each extracts into its own
    temporary folder and renames it into place; the first rename wins and the others drop their copy."""
    dest = wheel_dir / PINNED_WHEELS[version]
    if (dest / "plugin" / "__init__.py").is_file():
        return dest / "plugin"
    wheels = sorted(wheel_dir.glob(f"{PINNED_WHEELS[version]}-*.whl"))
    if not wheels:
        raise FileNotFoundError(
            f"no {PINNED_WHEELS[version]}-*.whl in {wheel_dir}: run the README's test command (its `pip download` "
            "step fetches the pinned TensorRT bindings wheels)"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{PINNED_WHEELS[version]}.", suffix=".partial", dir=wheel_dir))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the extracted package is read like any checkout file
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if name.startswith("tensorrt_bindings/plugin/") and name.endswith(".py"):
                    target = tmp / "plugin" / Path(name).name
                    target.parent.mkdir(exist_ok=True)
                    target.write_bytes(zf.read(name))
        try:
            tmp.rename(dest)
        except OSError:  # another process renamed its copy into place first (ENOTEMPTY / EEXIST)
            if not (dest / "plugin" / "__init__.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "plugin"


# ------------------------------------------------------------------------------------------- enums
class DataType(enum.Enum):
    FLOAT = "FP32"
    HALF = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT32 = "INT32"
    INT64 = "INT64"
    UINT8 = "UINT8"
    BOOL = "BOOL"
    FP8 = "FP8"
    INT4 = "INT4"
    FP4 = "FP4"


class PluginFieldType(enum.Enum):
    FLOAT16 = np.float16
    FLOAT32 = np.float32
    FLOAT64 = np.float64
    INT8 = np.int8
    INT16 = np.int16
    INT32 = np.int32
    INT64 = np.int64
    CHAR = "char"
    UNKNOWN = "unknown"
    DIMS = "dims"
    BF16 = "bf16"
    FP8 = "fp8"


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2


class DimensionOperation(enum.Enum):
    SUM = "+"
    PROD = "*"
    MAX = "max"
    MIN = "min"
    SUB = "-"
    EQUAL = "=="
    LESS = "<"
    FLOOR_DIV = "//"
    CEIL_DIV = "cdiv"


class TensorRTPhase(enum.Enum):
    BUILD = 0
    RUNTIME = 1


class QuickPluginCreationRequest(enum.Enum):
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class PluginArgType(enum.Enum):
    INT = 0


class PluginArgDataType(enum.Enum):
    INT8 = 0
    INT16 = 1
    INT32 = 2


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class Logger:
    """Collects messages (the plugin package logs one warning on import)."""

    Severity = _Severity
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = _Severity
    messages: list[tuple[int, str]] = []

    def __init__(self, min_severity=_Severity.WARNING):
        self.min_severity = min_severity

    def log(self, severity, msg):
        Logger.messages.append((int(severity), msg))


# --------------------------------------------------------------------------------------- fields
_BYTE_FIELDS = {PluginFieldType.CHAR: np.int8, PluginFieldType.UNKNOWN: np.uint8, PluginFieldType.BF16: np.uint16,
                PluginFieldType.FP8: np.uint8, PluginFieldType.DIMS: np.int64}  # fmt: skip


class PluginField:
    """name, data (a NumPy array of the field type's dtype, as the bindings return it), type."""

    def __init__(self, name: str = "", data=None, type: PluginFieldType = PluginFieldType.UNKNOWN):
        self.name = name
        self.type = type
        dtype = _BYTE_FIELDS.get(type, type.value)
        if isinstance(data, (bytes, bytearray)):
            self.data = np.frombuffer(bytes(data), dtype=np.uint8).view(dtype).copy()
        else:
            self.data = np.asarray([] if data is None else data).astype(dtype)

    def __repr__(self):
        return f"PluginField({self.name!r}, {self.data!r}, {self.type})"


class PluginFieldCollection(list):
    pass


class PluginRegistry:
    def __init__(self):
        self.creators: dict[tuple[str, str, str], object] = {}

    def register_creator(self, creator, namespace: str) -> bool:
        self.creators[(creator.name, creator.plugin_version, namespace)] = creator
        return True

    def get_creator(self, name: str, version: str, namespace: str = ""):
        return self.creators.get((name, version, namespace))


_REGISTRY = PluginRegistry()


def get_plugin_registry() -> PluginRegistry:
    return _REGISTRY


# ------------------------------------------------------------------------------ interface bases
class _Interface:
    def __init__(self, *args, **kwargs):
        pass


class IPluginV3(_Interface):
    pass


class IPluginV3QuickCore(_Interface):
    pass


class IPluginV3QuickBuild(_Interface):
    pass


class IPluginV3QuickRuntime(_Interface):
    pass


class IPluginV3QuickAOTBuild(_Interface):
    pass


class IPluginCreatorV3Quick(_Interface):
    pass


class ISymExpr(_Interface):
    pass


class ITensor:
    pass


# -------------------------------------------------------------------------- dimension expressions
class IDimensionExpr:
    """A symbolic integer: a constant, a named dimension, or an operation over two expressions."""

    def __init__(self, op=None, args=(), value=None, name=None):
        self.op, self.args, self.value, self.name = op, args, value, name

    def is_constant(self) -> bool:
        return self.value is not None

    def get_constant_value(self) -> int:
        assert self.value is not None, "not a build-time constant"
        return self.value

    def is_size_tensor(self) -> bool:
        return False

    def evaluate(self, env: dict[str, int]) -> int:
        if self.value is not None:
            return self.value
        if self.name is not None:
            return env[self.name]
        a, b = (x.evaluate(env) for x in self.args)
        return _apply(self.op, a, b)

    def __repr__(self):
        if self.value is not None:
            return str(self.value)
        if self.name is not None:
            return self.name
        return f"({self.args[0]!r} {self.op.value} {self.args[1]!r})"


def _apply(op: DimensionOperation, a: int, b: int) -> int:
    return {
        DimensionOperation.SUM: lambda: a + b,
        DimensionOperation.PROD: lambda: a * b,
        DimensionOperation.MAX: lambda: max(a, b),
        DimensionOperation.MIN: lambda: min(a, b),
        DimensionOperation.SUB: lambda: a - b,
        DimensionOperation.EQUAL: lambda: int(a == b),
        DimensionOperation.LESS: lambda: int(a < b),
        DimensionOperation.FLOOR_DIV: lambda: a // b,
        DimensionOperation.CEIL_DIV: lambda: -(-a // b),
    }[op]()


class ExprBuilder:
    """TensorRT's IExprBuilder: constants, and operations folded when both sides are constants."""

    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(value=int(value))

    def operation(self, op, a: IDimensionExpr, b: IDimensionExpr) -> IDimensionExpr:
        if a.is_constant() and b.is_constant():
            return IDimensionExpr(value=_apply(op, a.value, b.value))
        return IDimensionExpr(op=op, args=(a, b))

    def declare_size_tensor(self, index, opt, upper):
        raise NotImplementedError("size tensors are not used by our plugins")


def symbolic(name_or_value) -> IDimensionExpr:
    """A named dimension (str) or a constant (int) of a plugin input."""
    return IDimensionExpr(value=name_or_value) if isinstance(name_or_value, int) else IDimensionExpr(name=name_or_value)


class DimsExprs(list):
    def __init__(self, n_or_items=0):
        super().__init__([None] * n_or_items if isinstance(n_or_items, int) else n_or_items)


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, shape=()):
        return super().__new__(cls, (0,) * shape if isinstance(shape, int) else tuple(shape))


class PluginTensorDesc:
    def __init__(self, dims=(), type=DataType.FLOAT, format=TensorFormat.LINEAR, scale=1.0):
        self.dims, self.type, self.format, self.scale = Dims(dims), type, format, scale


class DynamicPluginTensorDesc:
    def __init__(self, desc: PluginTensorDesc, min=(), opt=(), max=()):
        self.desc, self.min, self.opt, self.max = desc, Dims(min), Dims(opt), Dims(max)


class KernelLaunchParamsSink:
    """What TensorRT hands `get_launch_params` to fill: grid, block, shared memory (expressions)."""

    grid_x = grid_y = grid_z = block_x = block_y = block_z = shared_mem = None


class SymExprSetter(list):
    """TensorRT's ISymExprs for the extra kernel arguments: sized by `nbSymExprs`, filled by index."""

    @property
    def nbSymExprs(self):
        return len(self)

    @nbSymExprs.setter
    def nbSymExprs(self, n):
        self[:] = [None] * n


class SeekPosition(enum.Enum):
    SET = 0
    CUR = 1
    END = 2


class IStreamReaderV2(_Interface):
    """Application reader TensorRT pulls a plan from: read(num_bytes, stream) -> bytes, seek(offset, where)."""


class IStreamWriter(_Interface):
    """Application writer TensorRT hands a plan to: write(data) -> bytes written (11.x bindings only)."""


def _module_namespace() -> dict:
    """The stand-in `tensorrt` module's symbols."""
    ns = {k: v for k, v in globals().items() if not k.startswith("_") or k == "_Interface"}
    ns.update(
        float32=DataType.FLOAT, float16=DataType.HALF, bfloat16=DataType.BF16, int8=DataType.INT8,
        int32=DataType.INT32, int64=DataType.INT64, uint8=DataType.UINT8, bool=DataType.BOOL, fp8=DataType.FP8,
        int4=DataType.INT4, fp4=DataType.FP4, __version__=None,
    )  # fmt: skip
    return ns


def install(version: str):
    """Put the stand-in core in sys.modules as `tensorrt` and import the real `tensorrt.plugin` of `version`."""
    assert "tensorrt" not in sys.modules, "install() once per process"
    trt = types.ModuleType("tensorrt")
    trt.__dict__.update(_module_namespace())
    trt.__version__ = PINNED_WHEELS[version].rsplit("-", 1)[1]
    from moe_export.plugins.tensorrt_contracts import STREAM_BINDINGS

    for name, versions in STREAM_BINDINGS.items():  # the stream interfaces exactly where the bindings have them
        if version not in versions and hasattr(trt, name):
            delattr(trt, name)
    trt.__path__ = []
    trt.nptype = lambda t: {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT32: np.int32,
                            DataType.INT64: np.int64, DataType.INT8: np.int8, DataType.UINT8: np.uint8,
                            DataType.BOOL: np.bool_}[t]  # fmt: skip
    sys.modules["tensorrt"] = trt
    pkg_dir = plugin_package_dir(version)
    spec = importlib.util.spec_from_file_location(
        "tensorrt.plugin", pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    plugin = importlib.util.module_from_spec(spec)
    sys.modules["tensorrt.plugin"] = plugin
    trt.plugin = plugin
    spec.loader.exec_module(plugin)
    return trt, plugin


# ----------------------------------------------------------------------- TensorRT's side of a node
ONNX_TO_TRT = {1: DataType.FLOAT, 10: DataType.HALF, 16: DataType.BF16, 7: DataType.INT64, 6: DataType.INT32,
               2: DataType.UINT8, 3: DataType.INT8, 9: DataType.BOOL}  # fmt: skip


class ParserRefusal(ValueError):
    """What TensorRT's ONNX parser / builder would refuse (the message names the contract)."""


def parsed_input_types(node, value_types: dict, initializers: set[str]) -> list[DataType]:
    """The TensorRT types of `node`'s inputs as the ONNX parser makes them: network values keep their ONNX type,
    initializers go through the parser's weight conversion (contract PARSER_UINT8_WEIGHTS_BECOME_INT32: a uint8
    initializer becomes INT32, one word per byte)."""
    from moe_export.plugins.tensorrt_contracts import parser_weight_type

    out = []
    for name in node.input:
        elem = value_types[name].tensor_type.elem_type
        out.append(ONNX_TO_TRT[parser_weight_type(elem) if name in initializers else elem])
    return out


POOL_PREFIXES = ("kda_state.", "conv_state.", "mla_cache.", "index_cache.")  # the runner's cache and state pools


def require_pools_outside_io(model) -> None:
    """Contract ALIASED_PLUGIN_IO_MAY_COPY: TensorRT "may insert copies" for aliased plugin I/O, so a pool as a
    network input updated through a plugin output (or returned as a network output) is not in place; a TensorRT
    build of ours refuses any pool among the network's inputs and outputs."""
    from moe_export.plugins.tensorrt_contracts import contract

    pools = [v.name for v in (*model.graph.input, *model.graph.output) if v.name.startswith(POOL_PREFIXES)]
    if pools:
        raise ParserRefusal(f"pools as network I/O {pools[:4]}{'...' if len(pools) > 4 else ''}: "
                            f"{contract('ALIASED_PLUGIN_IO_MAY_COPY').name} ({contract('ALIASED_PLUGIN_IO_MAY_COPY').source})")


def require_supported(node, in_types: list[DataType], out_types: list[DataType], built: dict) -> None:
    """The builder's format negotiation: the node's parsed types must be one of the plugin's combinations, else
    no engine (a uint8 initializer, widened to INT32 by the parser, matches nothing a plugin declares)."""
    combo = tuple(in_types + out_types)
    if combo not in built["combinations"]:
        widened = [node.input[i] for i, t in enumerate(in_types) if t == DataType.INT32]
        why = (f"; initializers widened to INT32 by the parser (PARSER_UINT8_WEIGHTS_BECOME_INT32): {widened}"
               if widened else "")
        raise ParserRefusal(f"{node.name}: no format combination of {node.op_type} accepts "
                            f"{[t.value for t in combo]}{why}")


def parser_fields(creator, node) -> tuple[PluginFieldCollection, list[str]]:
    """The fields TensorRT's ONNX parser builds for `node` from the creator's declared field names: each
    declared name present as a node attribute, typed by the ONNX attribute type (onnx-tensorrt `loadFields`):
    INT -> one INT32, FLOAT -> one FLOAT32, STRING -> CHAR bytes plus a terminating NUL. Also returns the
    declared names the node lacks (the parser only warns about them)."""
    from onnx import AttributeProto

    attrs = {a.name: a for a in node.attribute}
    fields, missing = PluginFieldCollection(), []
    for declared in creator.field_names:
        a = attrs.get(declared.name)
        if a is None:
            missing.append(declared.name)
        elif a.type == AttributeProto.INT:
            fields.append(PluginField(a.name, np.array([a.i], dtype=np.int32), PluginFieldType.INT32))
        elif a.type == AttributeProto.FLOAT:
            fields.append(PluginField(a.name, np.array([a.f], dtype=np.float32), PluginFieldType.FLOAT32))
        elif a.type == AttributeProto.STRING:
            fields.append(PluginField(a.name, a.s + b"\0", PluginFieldType.CHAR))
        else:
            raise AssertionError(f"{node.name}: attribute {a.name} of ONNX type {a.type} is not a plugin field here")
    return fields, missing


def find_creator(node, *, namespace_from_domain: bool):
    """The parser's lookup: name = op type, version = `plugin_version` (default "1"), namespace = the
    `plugin_namespace` attribute (default ""), or the node's domain when `namespace_from_domain` (10.13+)."""
    attrs = {a.name: a.s.decode() for a in node.attribute if a.name in ("plugin_version", "plugin_namespace")}
    namespace = attrs.get("plugin_namespace", node.domain if namespace_from_domain else "")
    return get_plugin_registry().get_creator(node.op_type, attrs.get("plugin_version", "1"), namespace)


def creation_request(node, network_preference: QuickPluginCreationRequest) -> QuickPluginCreationRequest:
    """The parser's choice: a node's `aot` attribute is strict, else the network's PREFER_* flag (or UNKNOWN)."""
    for a in node.attribute:
        if a.name == "aot":
            return QuickPluginCreationRequest.STRICT_AOT if a.i else QuickPluginCreationRequest.STRICT_JIT
    return network_preference


def build_phase(plugin, input_types: list[DataType], input_dims: list[list], env: dict[str, int]) -> dict:
    """TensorRT's build-time calls on a created QDP plugin, in order: output data types, output shape
    expressions (inputs given as named dimensions), supported format combinations for the concrete shapes
    `env`, configure, tactics, aliasing. Returns what TensorRT learned."""
    num_inputs = len(input_types)
    out_types = plugin.get_output_data_types(input_types, [len(d) for d in input_dims])
    in_exprs = [DimsExprs([symbolic(d) for d in dims]) for dims in input_dims]
    out_exprs = plugin.get_output_shapes(in_exprs, [], ExprBuilder())
    out_shapes = [[e.evaluate(env) for e in exprs] for exprs in out_exprs]
    in_shapes = [[symbolic(d).evaluate(env) for d in dims] for dims in input_dims]
    in_out = [
        DynamicPluginTensorDesc(PluginTensorDesc(shape, t), shape, shape, shape)
        for shape, t in zip(in_shapes + out_shapes, list(input_types) + list(out_types))
    ]
    flat = plugin.get_supported_format_combinations(in_out, num_inputs)
    n = len(in_out)
    combos = [tuple(d.type for d in flat[i : i + n]) for i in range(0, len(flat), n)]
    plugin.configure_plugin(in_out[:num_inputs], in_out[num_inputs:])
    tactics = plugin.get_valid_tactics()
    plugin.set_tactic(tactics[0] if tactics else 0)
    aliases = [plugin.get_aliased_input(i) for i in range(len(out_types))]
    if any(a >= 0 for a in aliases):  # contract ALIASED_PLUGIN_IO_MAY_COPY: our builds enable no aliasing
        raise ParserRefusal(f"plugin output aliased to input(s) {aliases}: the builder leaves "
                            "PreviewFeature.ALIASED_PLUGIN_IO_10_03 off (contract ALIASED_PLUGIN_IO_MAY_COPY: TensorRT "
                            "may insert copies); pools are reached through the pool table")
    return {"output_types": list(out_types), "output_shapes": out_shapes, "combinations": combos,
            "aliases": aliases, "in_out": in_out, "input_exprs": in_exprs, "tactics": tactics}  # fmt: skip


def aot_launch(plugin, built: dict, env: dict[str, int]) -> dict:
    """TensorRT's AOT calls: launch parameters and extra arguments (evaluated for `env`), then the kernel."""
    num_inputs = len(built["input_exprs"])
    sink, extras = KernelLaunchParamsSink(), SymExprSetter()
    plugin.get_launch_params(built["input_exprs"], built["in_out"], num_inputs, sink, extras, ExprBuilder())
    name, ptx = plugin.get_kernel([d.desc for d in built["in_out"][:num_inputs]],
                                  [d.desc for d in built["in_out"][num_inputs:]])  # fmt: skip
    grid = [getattr(sink, k).expr.evaluate(env) for k in ("grid_x", "grid_y", "grid_z")]
    block = [getattr(sink, k).expr.evaluate(env) for k in ("block_x", "block_y", "block_z")]
    extra = [(e.dtype, e.expr.evaluate(env)) for e in extras]
    return {"kernel": name, "ptx": ptx, "grid": grid, "block": block, "shared": sink.shared_mem.expr.evaluate(env),
            "extras": extra}  # fmt: skip
