"""`moe-export inspect` of a checkpoint: tensors and bytes by weight class, layer kinds, problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_export.common.model_config import ModelConfig
from moe_export.export.convert.checkpoint import CheckpointReader
from moe_export.graphs.weights import WEIGHT_CLASSES, classify_tensor_name

CLASS_LABELS = {
    "embeddings": "embeddings",
    "lm_head": "lm_head",
    "norms": "norms",
    "attn_res": "attention residuals",
    "kda": "KDA (linear attention)",
    "mla": "MLA",
    "indexer": "DSA indexer",
    "dense": "dense MLP",
    "router": "router",
    "latent_proj": "latent projections",
    "shared_experts": "shared experts",
    "routed_experts": "routed experts",
    "vision": "vision",
}


def layer_summary(cfg: ModelConfig) -> dict[str, Any]:
    """Layer kinds, 0-based: attention mixer, FFN kind, attention-residual snapshot layers."""
    layers = range(cfg.num_layers)
    return {
        "num_layers": cfg.num_layers,
        "kda": list(cfg.kda_layers),
        "mla": list(cfg.mla_layers),
        "dense_ffn": [i for i in layers if not cfg.is_moe(i)],
        "moe": [i for i in layers if cfg.is_moe(i)],
        "attn_res_snapshots": list(cfg.snapshot_layers()),
        "experts": {
            "num_experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_token,
            "format": "mxfp4" if cfg.experts_mxfp4 else "bf16",
            "latent_width": cfg.routed_expert_hidden_size,
        },
        "dsa_index_topk": cfg.index_topk,
    }


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """Census of a checkpoint directory (never raises for checkpoint problems, only for an unusable
    config or layout). Bytes are tensor data bytes as stored."""
    with CheckpointReader(path) as reader:
        problems = reader.validate()
        cfg = reader.config
        spec_class = {reader.stored(s.name).name if s.name in reader else s.name: s.weight_class
                      for s in reader.expected_specs()}
        counts = {c: [0, 0] for c in WEIGHT_CLASSES}
        names = reader.tensor_names()
        for name in names:
            cls = spec_class.get(name) or classify_tensor_name(name)
            counts.setdefault(cls, [0, 0])
            counts[cls][0] += 1
            counts[cls][1] += reader.nbytes(name)
        return {
            "kind": "checkpoint",
            "path": str(reader.path),
            "architecture": cfg.architecture,
            "model_type": cfg.model_type,
            "num_shards": len(reader.files),
            "num_tensors": len(names),
            "total_bytes": sum(b for _, b in counts.values()),
            "classes": {c: {"tensors": n, "bytes": b} for c, (n, b) in counts.items() if n},
            "layers": layer_summary(cfg),
            "problems": [p.to_dict() for p in problems],
            "source_dtypes": reader.dtype_report(),
            "vision": vision_summary(cfg, reader.path),
        }


def vision_summary(cfg: ModelConfig, folder: Path) -> dict[str, Any] | None:
    """K3's tower (vision_config); None without a tower. The image processor settings the checkpoint ships
    (`processor`, `max_tokens_per_image`: the runtime's ImageProcessor) are added by the CLI."""
    from moe_export.graphs.vision import PREPROCESSOR_CONFIG, vision_config

    vc = vision_config(cfg)
    if vc is None:
        return None
    return {
        "layers": vc.num_layers, "hidden": vc.hidden_size, "heads": vc.num_heads, "head_dim": vc.head_dim,
        "mlp": vc.intermediate_size, "patch_size": vc.patch_size,
        "pos_emb": [vc.pos_emb_height, vc.pos_emb_width], "interpolation": vc.interpolation_mode,
        "projector": [vc.merged_dim, vc.merged_dim, vc.text_hidden_size], "params": vc.params(),
        "processor_file": (folder / PREPROCESSOR_CONFIG).is_file(),
    }


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2, 4'."""
    out: list[str] = []
    for x in xs:
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out) or "-"


def render_checkpoint_report(report: dict[str, Any], console) -> None:
    """Print `inspect_checkpoint`'s report with rich: census table, layer kinds, problem count (the
    problems themselves go to the error paragraph, see `checkpoint.format_problems`)."""
    from rich.markup import escape
    from rich.table import Table

    total = report["total_bytes"] or 1
    console.print(
        f"[bold]{escape(report['path'])}[/]: {report['architecture']} ({report['model_type']}), {report['num_shards']} shard(s)",
        highlight=False,
        soft_wrap=True,
    )
    table = Table()
    table.add_column("weight class")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for cls, row in report["classes"].items():
        table.add_row(CLASS_LABELS.get(cls, cls), str(row["tensors"]), _human_bytes(row["bytes"]), f"{100 * row['bytes'] / total:.1f}%")
    table.add_row("total", str(report["num_tensors"]), _human_bytes(report["total_bytes"]), "100.0%", style="bold")
    console.print(table)

    lay = report["layers"]
    ex = lay["experts"]
    console.print(f"layers (0-based): {lay['num_layers']}", highlight=False)
    console.print(f"  KDA: {_ranges(lay['kda'])}    MLA: {_ranges(lay['mla'])}", highlight=False)
    console.print(f"  dense FFN: {_ranges(lay['dense_ffn'])}    MoE: {_ranges(lay['moe'])}", highlight=False)
    console.print(
        f"  experts: {ex['num_experts']} top-{ex['top_k']} {ex['format']}"
        + (f", latent width {ex['latent_width']}" if ex["latent_width"] else ""),
        highlight=False,
    )
    if lay["attn_res_snapshots"]:
        console.print(f"  attention-residual snapshots before layers: {_ranges(lay['attn_res_snapshots'])}", highlight=False)
    if lay["dsa_index_topk"]:
        console.print(f"  DSA indexer: top-{lay['dsa_index_topk']} on the MLA layers", highlight=False)

    vis = report.get("vision")
    if vis:
        pc = vis["processor"]
        console.print(
            f"  vision tower: {vis['layers']} x {vis['hidden']} ({vis['heads']} heads of {vis['head_dim']}, MLP "
            f"{vis['mlp']}), {vis['patch_size']} px patches, position table {vis['pos_emb'][0]}x{vis['pos_emb'][1]} "
            f"({vis['interpolation']}), projector {vis['projector'][0]} -> {vis['projector'][2]}; "
            f"{vis['params']:,} parameters (bf16, not quantized)", highlight=False)
        console.print(
            f"  images: in_patch_limit {pc['in_patch_limit']} (<= {vis['max_tokens_per_image']} tokens), "
            f"{pc['patch_limit_on_one_side']} patches per side, mean {pc['image_mean']} std {pc['image_std']}, "
            f"transparent background {(pc.get('transparent_bg_config') or {}).get('pattern', 'none')} "
            f"({pc.get('transparent_bg_fill_stage', 'before_resize')})"
            + ("" if vis["processor_file"] else " [K3 defaults: no preprocessor_config.json]"), highlight=False)
    for what, count in report["source_dtypes"].items():
        console.print(f"  float dtype: {count} tensor(s) stored {what}", highlight=False)
    n = len(report["problems"])
    console.print(f"[red]{n} problem(s) found[/]" if n else "[green]no problems found[/]")
