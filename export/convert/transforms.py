"""Streaming weight transforms of the convert stage: finiteness checks, MXFP4 / FP8 quantization,
validation of pre-quantized MXFP4 experts, gate-up fusion and per-rank expert stacking.

Everything works one source tensor at a time (the checkpoint reader memory-maps them), so peak
memory is the tensor being transformed, its output and chunk-sized temporaries; expert stacks are
written into preallocated (possibly memory-mapped) outputs.

Routed-expert names and shapes come from `graphs.weights.expert_tensor_specs`:
  K3 (pre-quantized): experts.E.w{1,2,3}.weight_packed U8 [out, in/2] + .weight_scale U8 [out, in/32]
  Kimi Linear / DSA:  experts.E.w{1,2,3}.weight BF16 [out, in]  (quantized here to MXFP4)
w1 = gate [I, D], w3 = up [I, D], w2 = down [D, I]. The fused gate-up tensor `w13` holds the I gate
rows then the I up rows: packed [2I, D/2], scales [2I, D/32]; stacks add a leading E_local dim in
the order of the rank's expert ids.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import (
    TensorSpec,
    classify_tensor_name,
    expert_tensor_specs,
)
from moe_export.quantize import fp8, mxfp4

_EXPERT_RE = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
# Elements per step of the chunked checks and error statistics (16 Mi: <= 64 MiB fp32 temporaries).
_STAT_ELEMS = 1 << 24
_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}


@dataclass
class QuantReport:
    """Quantization error of one source tensor, for the build manifest.

    fmt: "mxfp4", "fp8_block128" or "mxfp4_prequantized" (validated pass-through: no source to
    compare, so the error fields are None). sqnr_db = 10 log10(sum x^2 / sum (x - q)^2) over the
    finite elements; inf when the quantization is exact. max_abs_err and rms_err are in the units
    of the weight. nonfinite counts NaN/Inf source elements (nonzero only with allow_nonfinite),
    or NaN-scale blocks of a pre-quantized tensor.
    """

    name: str
    fmt: str
    shape: tuple[int, ...]
    source_dtype: str
    sqnr_db: float | None
    max_abs_err: float | None
    rms_err: float | None
    nonfinite: int = 0

    def to_dict(self) -> dict:
        """JSON-able dict; an infinite SQNR (exact) is written as None with exact=True."""
        exact = self.sqnr_db is not None and math.isinf(self.sqnr_db)
        return {
            "name": self.name,
            "fmt": self.fmt,
            "shape": list(self.shape),
            "source_dtype": self.source_dtype,
            "sqnr_db": None if exact else self.sqnr_db,
            "exact": exact,
            "max_abs_err": self.max_abs_err,
            "rms_err": self.rms_err,
            "nonfinite": self.nonfinite,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _TORCH_DTYPE.items()}.get(dtype, str(dtype).removeprefix("torch."))


def count_nonfinite(t: torch.Tensor) -> int:
    """Number of NaN/Inf elements of a floating tensor (0 for integer tensors), checked in chunks."""
    if not t.is_floating_point():
        return 0
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i : i + _STAT_ELEMS])).sum()) for i in range(0, flat.numel(), _STAT_ELEMS))


def is_finite(t: torch.Tensor) -> bool:
    """True if t holds no NaN/Inf: one min/max reduction (NaN propagates), no temporaries."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise InputError naming `name` if the floating tensor t holds a NaN or Inf."""
    if is_finite(t):
        return
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), _STAT_ELEMS):
        bad = ~torch.isfinite(flat[i : i + _STAT_ELEMS])
        if bad.any():
            first = i + int(bad.nonzero()[0, 0])
            index = tuple(int(k) for k in torch.unravel_index(torch.tensor(first), t.shape)) if t.dim() else ()
            raise InputError(
                f"{name}: {count_nonfinite(t)} non-finite value(s) (NaN/Inf), first {float(flat[first])} at index "
                f"{list(index)} of shape {list(t.shape)}; fix the checkpoint or set quantization.allow_nonfinite"
            )


def error_report(
    name: str, fmt: str, x: torch.Tensor, dequant_rows: Callable[[int, int], torch.Tensor], row_step: int
) -> QuantReport:
    """QuantReport of source x [R, ...] against dequant_rows(r0, r1) -> fp32 rows r0:r1 of the
    quantized tensor, accumulated over row chunks (row_step rows rounded to fit _STAT_ELEMS)."""
    rows = x.shape[0] if x.dim() else 1
    per_row = max(1, x.numel() // max(rows, 1))
    step = max(row_step, (_STAT_ELEMS // per_row) // row_step * row_step)
    sig = noise = 0.0
    max_err = 0.0
    count = nonfinite = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        xs = x[r0:r1].double()
        err = dequant_rows(r0, r1).double() - xs
        ok = torch.isfinite(xs) & torch.isfinite(err)
        nonfinite += int((~torch.isfinite(xs)).sum())
        xs, err = xs[ok], err[ok]
        sig += float((xs * xs).sum())
        noise += float((err * err).sum())
        if err.numel():
            max_err = max(max_err, float(err.abs().max()))
        count += int(ok.sum())
    if noise == 0.0:
        sqnr = math.inf
    elif sig == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig / noise)
    rms = math.sqrt(noise / count) if count else 0.0
    return QuantReport(name, fmt, tuple(x.shape), _dtype_name(x.dtype), sqnr, max_err, rms, nonfinite)


def quantize_mxfp4(
    name: str, w: torch.Tensor, allow_nonfinite: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, QuantReport]:
    """MXFP4-quantize a weight w [..., in] (bf16/fp16/fp32) -> (packed U8 [..., in/2], scales U8
    [..., in/32], report). InputError naming `name` on NaN/Inf unless allow_nonfinite, or when
    `in` is not a multiple of 32. `out` as in mxfp4.encode."""
    if not allow_nonfinite:
        check_finite(name, w)
    if w.dim() == 0 or w.shape[-1] % mxfp4.BLOCK_SIZE:
        raise InputError(f"{name}: shape {list(w.shape)} cannot be MXFP4-quantized (last dim must be a multiple of 32)")
    packed, scales = mxfp4.encode(w, out=out)
    n = w.shape[-1]
    p2, s2 = packed.view(-1, n // 2), scales.view(-1, n // mxfp4.BLOCK_SIZE)
    report = error_report(name, "mxfp4", w.reshape(-1, n), lambda r0, r1: mxfp4.decode(p2[r0:r1], s2[r0:r1]), 1)
    report.shape = tuple(w.shape)
    return packed, scales, report


def quantize_fp8(name: str, w: torch.Tensor, allow_nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor, QuantReport]:
    """FP8 E4M3 128x128-block quantization of a 2-D weight -> (q [R, C] float8_e4m3fn, scale_inv fp32
    [ceil(R/128), ceil(C/128)], report). InputError naming `name` on NaN/Inf unless allow_nonfinite."""
    if not allow_nonfinite:
        check_finite(name, w)
    if w.dim() != 2:
        raise InputError(f"{name}: FP8 block quantization needs a 2-D weight, got shape {list(w.shape)}")
    q, scale_inv = fp8.encode(w)
    blk = fp8.FP8_BLOCK

    def rows(r0: int, r1: int) -> torch.Tensor:
        return fp8.decode(q[r0:r1], scale_inv[r0 // blk : -(-r1 // blk)])

    return q, scale_inv, error_report(name, "fp8_block128", w, rows, blk)


def validate_mxfp4(
    name: str, t: torch.Tensor, logical_shape: tuple[int, ...], kind: str, allow_nonfinite: bool = False
) -> int:
    """Check a pre-quantized MXFP4 piece against its logical [out, in] shape. kind: "packed"
    (U8 [out, in/2]) or "scale" (U8 [out, in/32]; byte 255 = NaN block). Returns the number of NaN
    blocks (InputError naming `name` if any, unless allow_nonfinite)."""
    out_dim, in_dim = logical_shape
    want = (out_dim, in_dim // 2) if kind == "packed" else (out_dim, in_dim // mxfp4.BLOCK_SIZE)
    if t.dtype != torch.uint8 or tuple(t.shape) != want:
        raise InputError(
            f"{name}: expected U8 {list(want)} (MXFP4 {kind} of a logical [{out_dim}, {in_dim}] weight), "
            f"got {_dtype_name(t.dtype)} {list(t.shape)}"
        )
    if kind != "scale":
        return 0
    nan_blocks = int((t == 255).sum()) if t.numel() and int(t.amax()) == 255 else 0
    if nan_blocks and not allow_nonfinite:
        raise InputError(f"{name}: {nan_blocks} MXFP4 block scale(s) are 0xFF (NaN); set quantization.allow_nonfinite to keep them")
    return nan_blocks


# ---- routed experts ----


def parse_expert_name(name: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, "w1"|"w2"|"w3", "weight"|"weight_packed"|"weight_scale") of a routed-expert tensor name."""
    m = _EXPERT_RE.search(name)
    return (int(m[1]), int(m[2]), m[3], m[4]) if m else None


def _expert_spec(cfg: ModelConfig, name: str) -> TensorSpec:
    parsed = parse_expert_name(name)
    known = parsed is not None and parsed[1] < cfg.num_experts and parsed[0] < cfg.num_layers and cfg.is_moe(parsed[0])
    specs = {s.name: s for s in expert_tensor_specs(cfg, parsed[0], parsed[1])} if known else {}
    if name not in specs:
        raise InputError(f"{name}: not a routed-expert tensor of this {cfg.architecture} config")
    return specs[name]


def _logical(spec: TensorSpec) -> tuple[int, int]:
    shape = spec.logical_shape or spec.shape
    return int(shape[0]), int(shape[1])


def expert_piece_mxfp4(
    cfg: ModelConfig, spec: TensorSpec, t: torch.Tensor, allow_nonfinite: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], QuantReport | None]:
    """One expert tensor -> its MXFP4 pieces {"packed": ..., "scale": ...} (only the pieces this
    tensor provides) and a report. A BF16 `w.weight` is quantized (into `out` if given); a U8
    `.weight_packed` / `.weight_scale` is validated and passed through (copied into out[0] / out[1])."""
    kind = spec.name.rsplit(".", 1)[1]
    logical = _logical(spec)
    if kind == "weight":
        if tuple(t.shape) != logical or not t.is_floating_point():
            raise InputError(f"{spec.name}: expected a floating [{logical[0]}, {logical[1]}] weight, got {t.dtype} {list(t.shape)}")
        packed, scales, report = quantize_mxfp4(spec.name, t, allow_nonfinite, out)
        return {"packed": packed, "scale": scales}, report
    piece = "packed" if kind == "weight_packed" else "scale"
    nan_blocks = validate_mxfp4(spec.name, t, logical, piece, allow_nonfinite)
    if out is not None:
        dst = out[0] if piece == "packed" else out[1]
        dst.copy_(t)
        t = dst
    report = None
    if piece == "scale":
        report = QuantReport(spec.name, "mxfp4_prequantized", logical, "U8", None, None, None, nan_blocks)
    return {piece: t}, report


@dataclass
class ExpertMXFP4:
    """One expert's MXFP4 weight: packed U8 [rows, in/2], scales U8 [rows, in/32] (w13: rows = 2I)."""

    packed: torch.Tensor
    scales: torch.Tensor
    reports: list[QuantReport] = field(default_factory=list)


def expert_mxfp4(
    reader, cfg: ModelConfig, layer: int, expert: int, fuse_gate_up: bool, allow_nonfinite: bool = False
) -> ExpertMXFP4:
    """Read one routed expert through reader.get(name) and return its fused gate-up `w13`
    (fuse_gate_up=True: w1 rows then w3 rows, [2I, D/2] + [2I, D/32]) or its down `w2`
    ([D, I/2] + [D, I/32]) as MXFP4, quantizing BF16 experts and validating pre-quantized ones."""
    specs = expert_tensor_specs(cfg, layer, expert)
    parts = ("w1", "w3") if fuse_gate_up else ("w2",)
    rows_each, in_dim = _logical(next(s for s in specs if f".{parts[0]}." in s.name))
    rows = rows_each * len(parts)
    packed = torch.empty(rows, in_dim // 2, dtype=torch.uint8)
    scales = torch.empty(rows, in_dim // mxfp4.BLOCK_SIZE, dtype=torch.uint8)
    reports: list[QuantReport] = []
    for k, part in enumerate(parts):
        sl = slice(k * rows_each, (k + 1) * rows_each)
        for spec in (s for s in specs if f".{part}." in s.name):
            _, report = expert_piece_mxfp4(cfg, spec, reader.get(spec.name), allow_nonfinite, (packed[sl], scales[sl]))
            if report is not None:
                reports.append(report)
    return ExpertMXFP4(packed, scales, reports)


class ExpertStackBuilder:
    """Stacks one MoE layer's routed experts for a rank, fed one expert tensor at a time.

    Output (uint8, written in place into `out` if given, e.g. slices of a memory-mapped file):
      w13_packed [E_local, 2I, D/2], w13_scale [E_local, 2I, D/32],
      w2_packed  [E_local, D, I/2],  w2_scale  [E_local, D, I/32]
    with E_local = len(expert_ids) in that order. feed() accepts BF16 `w.weight` (quantized straight
    into its slot) or U8 `.weight_packed` / `.weight_scale` (validated, copied), in any order.
    """

    KEYS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")

    def __init__(
        self, cfg: ModelConfig, layer: int, expert_ids: Iterable[int], allow_nonfinite: bool = False,
        out: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg, self.layer, self.allow_nonfinite = cfg, layer, allow_nonfinite
        self.expert_ids = list(expert_ids)
        self._slot = {e: k for k, e in enumerate(self.expert_ids)}
        if len(self._slot) != len(self.expert_ids):
            raise InputError(f"layer {layer}: duplicate expert ids {self.expert_ids}")
        d, i, n = cfg.expert_in_dim, cfg.moe_intermediate_size, len(self.expert_ids)
        shapes = {
            "w13_packed": (n, 2 * i, d // 2), "w13_scale": (n, 2 * i, d // 32),
            "w2_packed": (n, d, i // 2), "w2_scale": (n, d, i // 32),
        }  # fmt: skip
        if out is None:
            out = {k: torch.empty(s, dtype=torch.uint8) for k, s in shapes.items()}
        for k, s in shapes.items():
            t = out.get(k)
            if t is None or tuple(t.shape) != s or t.dtype != torch.uint8 or not t.is_contiguous():
                raise InputError(f"layer {layer}: out[{k!r}] must be a contiguous U8 tensor of shape {list(s)}")
        self.out = out
        self._rows = {"w1": (0, i), "w3": (i, 2 * i), "w2": (0, d)}
        self._pending = {(e, w, p) for e in self.expert_ids for w in ("w1", "w2", "w3") for p in ("packed", "scale")}
        self.reports: list[QuantReport] = []

    def wants(self, name: str) -> bool:
        """True if `name` is a routed-expert tensor of this layer held by this rank."""
        parsed = parse_expert_name(name)
        return parsed is not None and parsed[0] == self.layer and parsed[1] in self._slot

    def feed(self, name: str, t: torch.Tensor) -> None:
        """Write one expert tensor into its slot (InputError if it is not one of this stack's)."""
        if not self.wants(name):
            raise InputError(f"{name}: not a routed expert of layer {self.layer} on this rank (experts {self.expert_ids[:8]}...)")
        _, expert, w, _ = parse_expert_name(name)
        spec = _expert_spec(self.cfg, name)
        k = self._slot[expert]
        r0, r1 = self._rows[w]
        stack = "w2" if w == "w2" else "w13"
        dst = (self.out[f"{stack}_packed"][k, r0:r1], self.out[f"{stack}_scale"][k, r0:r1])
        pieces, report = expert_piece_mxfp4(self.cfg, spec, t, self.allow_nonfinite, dst)
        self._pending -= {(expert, w, p) for p in pieces}
        if report is not None:
            self.reports.append(report)

    @property
    def missing(self) -> list[str]:
        """(expert, w, piece) triples not fed yet, formatted."""
        return [f"expert {e} {w} {p}" for e, w, p in sorted(self._pending)]

    def result(self) -> dict[str, torch.Tensor]:
        """The four stacked tensors; InputError listing what was never fed."""
        if self._pending:
            miss = self.missing
            raise InputError(f"layer {self.layer}: expert stack incomplete, missing {len(miss)}: {', '.join(miss[:6])}")
        return self.out


# ---- tensor streams ----


def transform_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    fp8_classes: Collection[str] = (),
    allow_nonfinite: bool = False,
    reports: list[QuantReport] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Transform a stream of checkpoint tensors one at a time.

    - routed experts: BF16 `w.weight` -> `w.weight_packed` U8 + `w.weight_scale` U8 (MXFP4);
      pre-quantized U8 pieces are validated against their logical shape and passed through.
    - 2-D `.weight` tensors whose weight class (graphs.weights.classify_tensor_name) is in
      fp8_classes -> `.weight` float8_e4m3fn + `.weight_scale_inv` fp32 (128x128 blocks).
    - everything else passes through after the finiteness check.
    NaN/Inf raise InputError naming the tensor unless allow_nonfinite. Reports are appended to
    `reports` when given.
    """
    for name, t in pairs:
        report = None
        if parse_expert_name(name) is not None:
            spec = _expert_spec(cfg, name)
            pieces, report = expert_piece_mxfp4(cfg, spec, t, allow_nonfinite)
            base = name.rsplit(".", 1)[0]
            outs = [(f"{base}.weight_{'packed' if p == 'packed' else 'scale'}", v) for p, v in pieces.items()]
        elif fp8_classes and t.dim() == 2 and name.endswith(".weight") and classify_tensor_name(name) in fp8_classes:
            q, scale_inv, report = quantize_fp8(name, t, allow_nonfinite)
            outs = [(name, q), (name + "_scale_inv", scale_inv)]
        else:
            if not allow_nonfinite:
                check_finite(name, t)
            outs = [(name, t)]
        if report is not None and reports is not None:
            reports.append(report)
        yield from outs
