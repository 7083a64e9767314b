"""The `moe-export` command line (typer). Every command exits 0 on success and 2 on bad input,
printing one paragraph on stderr without a traceback (`--debug` shows it)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from moe_export.common.errors import EngineDead, InputError
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

class FlagsShownAsFlags:
    """typer's help with boolean flags shown as flags (`--json`), not as options taking a `<bool>`."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_bool_flag", False) and param.metavar is None:
                param.metavar = ""  # the help's type column shows the metavar when one is set
        return params


class Command(FlagsShownAsFlags, TyperCommand):
    pass


class Group(FlagsShownAsFlags, TyperGroup):
    pass


app = typer.Typer(
    cls=Group,
    name="moe-export",
    help="Export hybrid linear/sparse-attention MoE checkpoints (Kimi K3, Kimi Linear, DSA) to per-rank engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    _state["debug"] = debug


@app.command(cls=Command)
def plan(
    recipe: str = typer.Option(..., "--recipe", "-r", help="recipe YAML (path, or name in the shipped recipes/)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Parameter counts, per-rank memory by weight class, sequences that fit, and a verdict (no weights needed)."""
    import json

    from moe_export.common.recipe import load_recipe
    from moe_export.common.pools import GIB
    from moe_export.export.plan.planner import make_plan

    rec, path = load_recipe(recipe)
    p = make_plan(rec)
    if as_json:
        print(json.dumps(p.to_dict(), indent=2))
    else:
        from rich.table import Table

        console.print(
            f"[bold]{rec.name}[/] ({path}): {p.config.architecture}, world {rec.target.world_size} "
            f"(tp={rec.parallel.tp}, ep={rec.parallel.ep}) on {rec.target.gpu}"
        )
        console.print(f"parameters: total {p.total_params / 1e9:,.2f} B, active {p.active_params / 1e9:,.2f} B")
        r0 = p.per_rank[0]
        table = Table(title="rank 0 memory (GiB)")
        table.add_column("weight class")
        table.add_column("GiB", justify="right")
        for cls, b in r0.weight_bytes.items():
            table.add_row(cls, f"{b / GIB:.3f}")
        for kind, b in r0.state_bytes_per_sequence.items():
            table.add_row(f"per sequence: {kind}", f"{b / GIB:.3f}")
        table.add_row("workspace reserve", f"{p.reserve_bytes / GIB:.3f}")
        table.add_row("memory per rank", f"{p.memory_bytes / GIB:.3f}")
        console.print(table)
        worst = min(p.per_rank, key=lambda r: r.max_sequences)
        gpu = Table(title=f"per-GPU memory (GiB), rank {worst.rank} (the tightest)")
        gpu.add_column("part")
        gpu.add_column("GiB", justify="right")
        labels = {"weights": "weights", "state_slots": f"recurrent-state pools ({worst.pools.num_slots} slots)",
                  "state_checkpoints": f"prefix-cache state checkpoints ({worst.pools.num_checkpoints:,})",
                  "cache_blocks": f"cache pools ({worst.pools.num_blocks:,} blocks)",
                  "activations": "engine activations (one buffer per rank)",
                  "plugin_workspaces": "plugin workspaces", "nccl_buffers": "NCCL buffers",
                  "vision_activations": "vision tower activations (one call)",
                  "reserve": "reserve (CUDA context, cuBLAS, allocator)", "total": "total",
                  "capacity": "GPU memory (usable)"}  # fmt: skip
        for part, b in worst.memory.items():
            label = f"  {part.split('.', 1)[1]}" if part.startswith("workspace.") else labels[part]
            gpu.add_row(label, f"{b / GIB:.3f}")
        console.print(gpu)
        d = p.to_dict()
        fit = ", ".join(f"{n} x {int(length):,} tokens" for length, n in d["sequences_that_fit"].items())
        console.print(f"cache per rank: {d['cache_tokens_per_rank']:,} tokens in blocks of {rec.limits.block_size} "
                      f"({rec.limits.max_batch} sequence slots); at once: {fit}")
        _print_checkpoint_host_memory(d, rec, worst.pools)
        layouts = Table(title=f"decode step per GPU, {rec.limits.max_batch} tokens per attention group "
                              f"(MoE bytes per MoE layer; attention token x heads per layer)")
        for col in ("layout", "groups", "tokens served / GPU", "MoE bytes sent", "of which between nodes",
                    "MoE bytes / served token", "attention token x heads"):
            layouts.add_column(col, justify="right")
        for name, lay in d["layouts"].items():
            chosen = " (recipe)" if name == rec.parallel.attention else ""
            layouts.add_row(f"{name}{chosen}", str(lay["groups"]), f"{lay['tokens_per_gpu']:.2f}",
                            f"{lay['moe_bytes']['total'] / 2**20:.2f} MiB",
                            f"{lay['moe_bytes']['inter_node'] / 2**20:.2f} MiB",
                            f"{lay['moe_bytes_per_token'] / 2**10:.1f} KiB", f"{lay['attention_token_heads']:,}")
        console.print(layouts)
        _print_margins_and_dp_step(d)
        console.print(("[green]" if p.fits else "[red]") + p.verdict())
    if not p.fits:
        if not as_json:
            err_console.print(f"error: recipe {rec.name}: {p.verdict()}", highlight=False)
        raise typer.Exit(2)


def _print_checkpoint_host_memory(d: dict, rec, pools) -> None:
    """`plan`'s lines on the prefix cache's checkpoints: per rank, and beside GPUs per node against
    target.host_memory_gib."""
    from moe_export.common.pools import GIB

    console.print(f"host memory per rank: prefix-cache state checkpoints {pools.checkpoint_host_bytes / GIB:.2f} "
                  f"GiB ({rec.limits.checkpoints_per_slot} per slot (limits.checkpoints_per_slot) x "
                  f"{pools.num_slots} slots x {pools.bytes_per_slot / 2**20:,.1f} MiB; pinned beside a "
                  "GPU, the rank's own memory on a CPU target)")
    if rec.target.gpu != "cpu":
        limit = d["host_memory_bytes_per_node"]
        console.print(f"host memory per node running: {d['host_run_bytes_per_node'] / GIB:.2f} GiB ("
                      f"{rec.target.gpus_per_node} ranks; " + (f"target.host_memory_gib {limit / GIB:g})" if limit
                                                               else "target.host_memory_gib not given: not checked)"))


def _print_margins_and_dp_step(d: dict) -> None:
    """`plan`'s lines on the usable GPU memory, its margin, the host memory peak and the dp decode-step model."""
    gib = 2**30
    console.print(f"usable GPU memory per rank {d['usable_gpu_bytes'] / gib:.2f} GiB; margin beyond one max_seq_len "
                  f"sequence {d['margin_bytes'] / gib:.2f} GiB")
    console.print(f"host memory peak per rank {d['host_peak_bytes_per_rank'] / gib:.2f} GiB "
                  f"({d['host_peak_bytes_per_rank'] / d['weight_bytes_per_rank']:.2f} x the rank's weights; the plan "
                  f"streamed to disk), {d['host_peak_bytes_per_rank_plan_buffer'] / gib:.2f} GiB with TensorRT "
                  "bindings that build into one plan buffer (10.9)")
    step = d["dp_decode_step"]
    if step is None:
        return
    layer, total = step["per_layer"], step["per_step"]
    console.print(f"dp decode step ({step['tokens_per_group']} tokens per attention group, a CUDA graph; "
                  f"{step['moe_layers']} MoE layers), per layer / per step: host syncs {layer['host_syncs']} / "
                  f"{total['host_syncs']}, launches <= {layer['launches_at_most']:,} / {total['launches_at_most']:,}, "
                  f"full-receive-buffer passes {layer['full_buffer_passes']}, rows computed <= {layer['rows_bound']:,} "
                  f"of the {layer['receive_rows']:,}-row buffer for {layer['rows_with_tokens']:,} rows with tokens, "
                  f"{layer['wire_bytes'] / 2**20:.2f} MiB sent, {layer['expert_weight_bytes'] / 2**20:,.0f} MiB of "
                  f"expert weights per layer; an eager step (prefill) waits {step['eager_step_host_syncs']} times")


@app.command(cls=Command)
def synth(
    preset: str = typer.Option(..., "--preset", help="tiny-k3 (real K3 names and dtypes), tiny-k3-dsa (+ the DSA "
                               "indexer), tiny-kimi-linear (loads in transformers), tiny-dsa-grouped (DSA with grouped "
                               "top-k routing, SwiGLU experts), mid-k3 (K3's real widths, 3 layers, 16 experts, about "
                               "10 GB: for GPU checks)"),
    out: str = typer.Option(..., "--out", help="output checkpoint directory"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same bytes)"),
    force: bool = typer.Option(False, "--force", help="replace a non-empty output directory"),
) -> None:
    """Write a synthetic HF checkpoint (config, sharded safetensors, tokenizer) with random weights."""
    from moe_export.export.convert.synth import write_synthetic_checkpoint

    path = write_synthetic_checkpoint(preset, out, seed=seed, force=force)
    console.print(f"wrote synthetic checkpoint {preset} (seed {seed}) to {path}", highlight=False)


@app.command(cls=Command)
def inspect(
    path: str = typer.Argument(..., help="checkpoint directory, or engine directory written by `build`"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Census of a checkpoint by weight class, its layer kinds, and every problem found (exit 2 if any).
    For an engine directory: ranks, mapping, graph ops and plugin nodes, weights by class, the chat format, manifest
    status."""
    import json

    from moe_export.common.manifest import is_engine_dir
    from moe_export.export.convert.census import inspect_checkpoint, render_checkpoint_report
    from moe_export.export.convert.checkpoint import Problem, format_problems
    from moe_export.export.build.inspect_engine import inspect_engine, render_engine_report

    if is_engine_dir(path):
        engine = inspect_engine(path)
        engine["chat_format"] = _chat_format(Path(path))
        if as_json:
            print(json.dumps(engine, indent=2))
        else:
            render_engine_report(engine, console)
        return
    report = inspect_checkpoint(path)
    if report.get("vision") is not None:
        report["vision"].update(_image_processor_summary(Path(path)))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render_checkpoint_report(report, console)
    if report["problems"]:
        raise InputError(format_problems(path, [Problem(**p) for p in report["problems"]]))


def _chat_format(engine_dir: Path) -> str:
    """Which renderer the runtime uses for an engine's chats (`moe_export.runtime.chat.renderer_name`)."""
    from moe_export.runtime.chat import renderer_name
    from moe_export.runtime.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(engine_dir)
    except InputError as exc:
        return f"none ({exc})"
    return renderer_name(tok.family, tok.chat_template)


def _image_processor_summary(folder: Path) -> dict:
    """The image processor a K3 checkpoint ships, as the runtime reads it: settings and tokens per image."""
    from moe_export.runtime.images import ImageProcessor

    proc = ImageProcessor.from_folder(folder)
    return {"processor": proc.cfg, "max_tokens_per_image": proc.max_tokens}


def _check_seed(seed: int | None) -> None:
    """--seed is an unsigned 64-bit integer, as a request's seed on the server."""
    from moe_export.runtime.entrypoints.server.protocol import MAX_SEED

    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InputError(f"--seed must be in 0..{MAX_SEED} (an unsigned 64-bit integer), got {seed}")


@app.command(cls=Command)
def generate(
    path: str = typer.Argument(..., help="checkpoint directory, or engine directory built by `moe-export build`"),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="comma-separated token ids, e.g. 1,2,3 (this or --prompt is required)"),
    prompt: str | None = typer.Option(None, "--prompt", help="prompt text, tokenized with the checkpoint's tokenizer (this or --prompt-ids is required)"),
    max_new_tokens: int = typer.Option(..., "--max-new-tokens", help="tokens to generate (stops early at eos)"),
    temperature: float | None = typer.Option(None, "--temperature", help="sampling temperature (0 = greedy)"),
    top_p: float | None = typer.Option(None, "--top-p", help="nucleus sampling mass in (0, 1]"),
    top_k: int | None = typer.Option(None, "--top-k", help="sample among the k most likely tokens"),
    seed: int | None = typer.Option(None, "--seed", help="sampling seed (none: a random one)"),
    as_json: bool = typer.Option(False, "--json", help='print {"tokens": [...]} (the new tokens only)'),
) -> None:
    """Generate with an engine directory (all ranks in process, or one rank per process under
    `mpiexec -n WORLD`, rank 0 printing) or with the fp32 PyTorch reference model on a checkpoint.
    Sampling: the model's generation_config.json defaults (else greedy) with the flags given on top."""
    import json

    from moe_export.runtime.entrypoints.generate import generate_command
    from moe_export.runtime.tokenizer import load_tokenizer

    if (prompt_ids is None) == (prompt is None):
        raise InputError("give exactly one of --prompt-ids 1,2,3 (token ids) or --prompt TEXT")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    _check_seed(seed)
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "max_tokens": max_new_tokens}
    tokens = generate_command(path, prompt_ids, prompt, flags)
    if tokens is None:  # a follower rank under mpiexec: rank 0 prints
        return
    if as_json:
        print(json.dumps({"tokens": tokens}))
    else:
        print(load_tokenizer(path).decode(tokens))


@app.command(cls=Command)
def chat(
    engine: str = typer.Argument(..., help="engine directory built by `moe-export build`"),
    effort: str = typer.Option("max", "--effort", help="thinking effort: low, high, max, none, or a number of reasoning tokens"),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="most tokens per answer"),
    temperature: float | None = typer.Option(None, "--temperature", help="sampling temperature (0 = greedy)"),
    top_p: float | None = typer.Option(None, "--top-p", help="nucleus sampling mass in (0, 1]"),
    top_k: int | None = typer.Option(None, "--top-k", help="sample among the k most likely tokens"),
    seed: int | None = typer.Option(None, "--seed", help="sampling seed (none: a random one)"),
    system: str | None = typer.Option(None, "--system", help="system prompt"),
    history: str | None = typer.Option(None, "--history", help="input history file (default: $XDG_STATE_HOME/moe-export/chat_history)"),
) -> None:
    """A terminal conversation: streams answers (reasoning dimmed), keeps history with state reuse; a line
    editor with history, Ctrl-C cancels an answer; /effort low|high|max|none, /reset, /help, /exit. Under
    `mpiexec -n WORLD`, rank 0 talks to the terminal."""
    from moe_export.runtime.entrypoints.terminal import chat_terminal

    _check_seed(seed)
    chat_terminal(engine, effort=effort, system=system, history_path=history,
                  flags={"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                         "max_tokens": max_tokens})


@app.command(cls=Command)
def build(
    recipe: str = typer.Option(..., "--recipe", "-r", help="recipe YAML (path, or name in the shipped recipes/)"),
    out: str | None = typer.Option(None, "--out", help="engine directory (default: the recipe's `output`)"),
) -> None:
    """Build the per-rank engine directory; only stages whose inputs changed run again. Under
    `mpiexec -n R`, MPI process r builds the ranks n with n % R == r."""
    from moe_export.common.recipe import load_recipe
    from moe_export.export import build as driver
    from rich.markup import escape

    rec, _ = load_recipe(recipe)
    try:
        result = driver.build(rec, out)
    except driver.BuildError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if result.reporter:
        console.print(driver.describe(result), highlight=False, soft_wrap=True, markup=False)


@app.command(cls=Command)
def verify(
    path: str = typer.Argument(..., help="engine directory written by `build`"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Re-hash every file against manifest.json; list missing, altered and extra files (exit 2 if any)."""
    import json

    from moe_export.common.manifest import verify_engine_dir

    report = verify_engine_dir(path)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for rel in report["missing"]:
            console.print(f"missing: {rel}", highlight=False, markup=False)
        for item in report["altered"]:
            console.print(f"altered: {item['file']} ({item['reason']})", highlight=False, markup=False)
        for rel in report["extra"]:
            console.print(f"extra: {rel}", highlight=False, markup=False)
        if report["ok"]:
            console.print(f"ok: {report['checked']} file(s) match the manifest", highlight=False)
    if not report["ok"]:
        raise InputError(
            f"{path}: does not match its manifest: {len(report['missing'])} missing, "
            f"{len(report['altered'])} altered, {len(report['extra'])} extra file(s)"
        )


@app.command("triton-repo", cls=Command)
def triton_repo(
    engine: str = typer.Argument(..., help="engine directory written by `build`"),
    out: str = typer.Option(..., "--out", help="Triton model repository folder (created if absent)"),
    model_name: str = typer.Option("moe-export", "--model-name", help="model folder / name in the repository"),
    default_effort: str = typer.Option("max", "--default-effort", help="thinking tier when a request names none"),
    engine_path: str | None = typer.Option(None, "--engine-path", help="the engine folder as Triton will see it (e.g. its path in a container); default: relative to the model folder"),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="the model does not share cached prompt prefixes across requests (config.pbtxt parameter prefix_caching)"),
    python_env: str | None = typer.Option(None, "--python-env", help="the model's Python environment (config.pbtxt EXECUTION_ENV_PATH: a conda-pack archive or an unpacked environment, numpy < 2 for Triton 2.51); default: the container's system python3"),
) -> None:
    """Write a Triton Inference Server model (Python backend, decoupled, vLLM-backend tensor names) hosting
    the runtime on ENGINE, plus launch_NAME.sh (in process, or --mpi: one process per rank)."""
    from moe_export.runtime.entrypoints.triton.repo import write_triton_repo

    path = write_triton_repo(engine, out, model_name, default_effort, engine_path, prefix_caching=not no_prefix_caching,
                             python_env=python_env)
    console.print(f"wrote Triton model {model_name} to {path} (launch: {path.parent / f'launch_{model_name}.sh'})",
                  highlight=False, markup=False)


@app.command(cls=Command)
def batch(
    engine: str = typer.Argument(..., help="engine directory written by `build`"),
    input_path: str = typer.Option(..., "--input", help="OpenAI batch JSONL file, or a folder of documents"),
    output: str = typer.Option(..., "--output", help="output JSONL (appended; items already in it are skipped)"),
    concurrency: int | None = typer.Option(None, "--concurrency", help="items in flight (default: 2 x engine slots)"),
    task: str | None = typer.Option(None, "--task", help="documents: summarize, extract or qa"),
    prompt_file: str | None = typer.Option(None, "--prompt-file", help="documents: Jinja template (variable `document`)"),
    question: str | None = typer.Option(None, "--question", help="the question for --task qa"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="documents: tokens generated per request"),
    overlap: int = typer.Option(64, "--overlap", help="documents: tokens shared by neighbouring chunks"),
    max_chunks: int = typer.Option(64, "--max-chunks", help="documents: more chunks than this = over-long error"),
    max_file_bytes: int = typer.Option(64 << 20, "--max-file-bytes", help="documents: larger files = over-long error"),
    reasoning_effort: str | None = typer.Option(None, "--reasoning-effort", help="documents: low, high, max or none"),
    images: bool = typer.Option(False, "--images", help="documents: image files (png, jpeg, webp, gif) and the images "
                                "inside PDFs go with the text as image parts (K3 engines with a vision tower)"),
    ray_address: str | None = typer.Option(None, "--ray", help="run on Ray Data: auto, or a cluster ADDRESS"),
    ray_actors: int = typer.Option(2, "--ray-actors", help="Ray: engine replicas (one per actor)"),
) -> None:
    """Offline batch inference through the runtime's continuous batching; resumable; exit 1 if any item failed."""
    from moe_export.runtime.entrypoints.batch.doc_tasks import DocJob
    from moe_export.runtime.entrypoints.batch.runner import render_summary, run_batch

    doc_job = None
    if task is not None or prompt_file is not None:
        doc_job = DocJob.make(task, prompt_file, question, overlap=overlap, max_chunks=max_chunks,
                              max_tokens=max_tokens, reasoning_effort=reasoning_effort, images=images)
    elif images:
        raise InputError("--images applies to a folder of documents (with --task or --prompt-file)")
    summary = run_batch(engine, input_path, output, concurrency=concurrency, doc_job=doc_job, ray_address=ray_address,
                        ray_actors=ray_actors, max_file_bytes=max_file_bytes, console=err_console)
    render_summary(summary, err_console)
    if summary.failed or summary.failed_earlier:
        err_console.print(f"{summary.failed + summary.failed_earlier} item(s) failed ({summary.failed_earlier} in earlier "
                          f"runs): see the error lines in {output}", highlight=False)
        raise typer.Exit(1)


@app.command("eval", cls=Command)
def eval_(
    engine: str = typer.Argument(..., help="engine directory written by `build`"),
    tasks: str = typer.Option(..., "--tasks", help="tasks JSONL (see moe_export.runtime.entrypoints.eval)"),
    tiers: str = typer.Option("low,high,max", "--tiers", help="comma-separated thinking tiers (low, high, max, none)"),
    out: str = typer.Option(..., "--out", help="report folder: report.json and tiers.png"),
) -> None:
    """Run checkable tasks through the chat path at each thinking tier; pass rate, rounds, tokens, latency."""
    from moe_export.runtime.entrypoints.eval import run_eval
    from rich.table import Table

    report = run_eval(engine, tasks, tiers, out)
    table = Table(title=f"eval ({out}/report.json)")
    for column in ("tier", "pass rate", "avg rounds", "reasoning tok", "output tok", "latency p50 s"):
        table.add_column(column, justify="right")
    for tier, row in report["tiers"].items():
        table.add_row(tier, f"{row['pass_rate']:.2f}", f"{row['avg_rounds']:.2f}", f"{row['avg_reasoning_tokens']:.1f}",
                      f"{row['avg_output_tokens']:.1f}", f"{row['latency_s']['p50']:.2f}")
    console.print(table)


@app.command(cls=Command)
def serve(
    engine: str = typer.Argument(..., help="engine directory built by `moe-export build`"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="TCP port"),
    api_key: list[str] = typer.Option(None, "--api-key", help="accepted API key (repeatable); default: $MOE_EXPORT_API_KEY (comma-separated), else no auth"),
    store: str | None = typer.Option(None, "--store", help="SQLite file for stored Responses history (default: in memory)"),
    default_effort: str = typer.Option("max", "--default-effort", help="thinking tier when a request names none: low, high, max or none"),
    max_queue: int = typer.Option(256, "--max-queue", help="waiting requests before new ones get 429"),
    served_model_name: list[str] = typer.Option(None, "--served-model-name", help="model name(s) requests may give (repeatable; the first is reported); others get 404. Default: the engine folder's name"),
    allow_image_urls: bool = typer.Option(False, "--allow-image-urls", help="K3 engines: fetch http(s) image URLs from public addresses (32 MiB, 10 s limits, every redirect checked); default: data URLs only"),
    allow_private_image_urls: bool = typer.Option(False, "--allow-private-image-urls", help="with --allow-image-urls: also fetch from loopback, private and link-local addresses (never cloud metadata addresses)"),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="do not share cached prompt prefixes (cache blocks + recurrent-state checkpoints) across requests"),
    offload_gib: float = typer.Option(8.0, "--offload-gib", help="with --store FILE: disk cap of the prefix state (cache blocks, recurrent-state checkpoints, kept conversations) offloaded to FILE.state/, so stored Responses chains resume after a restart without prefilling again (0: off; one process or the tp layout under mpiexec, each rank its own FILE.state/rank{N}/)"),
    no_warm_turns: bool = typer.Option(False, "--no-warm-turns", help="do not prefill a finished turn's continuation between turns (with tool_choice \"required\" / any, the next turn then prefills the model's previous output itself)"),
    no_access_log: bool = typer.Option(False, "--no-access-log", help="no line per request on stdout (uvicorn's access log: client, method, path, status)"),
) -> None:
    """OpenAI- and Anthropic-compatible HTTP server (rank 0; other ranks follow under `mpiexec -n WORLD`).
    Ready when GET /health answers 200; SIGTERM drains running requests and exits 0."""
    from moe_export.runtime.entrypoints.server.launch import resolve_api_keys
    from moe_export.runtime.entrypoints.server.launch import serve as run_server

    run_server(engine, host=host, port=port, api_keys=resolve_api_keys(api_key), store=store,
               default_effort=default_effort, max_queue=max_queue, served_model_names=tuple(served_model_name or ()),
               allow_image_urls=allow_image_urls, allow_private_image_urls=allow_private_image_urls,
               prefix_caching=not no_prefix_caching, access_log=not no_access_log, offload_gib=offload_gib,
               warm_turns=not no_warm_turns)


def main() -> None:
    """Console-script entry point: maps InputError to exit 2 with a one-paragraph message."""
    debug = "--debug" in sys.argv
    try:
        rc = app(standalone_mode=False)
    except InputError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except EngineDead as exc:  # `serve` stopped because its engine core died: exit 1 for the supervisor
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        sys.exit(code or 0)
    except OSError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except Exception as exc:  # usage errors (typer vendors its own click: match both)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # ClickException and its usage errors
            exc.show()
            sys.exit(2)
        if type(exc).__name__ == "Abort":
            sys.exit(130)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)
