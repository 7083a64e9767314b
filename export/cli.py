"""The `moe-export` command line (typer). Every command exits 0 on success and 2 on bad input,
printing one paragraph on stderr without a traceback (`--debug` shows it)."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from moe_export.export.errors import InputError

app = typer.Typer(
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


@app.command()
def plan(
    recipe: str = typer.Option(..., "--recipe", "-r", help="recipe YAML (path, or name in the shipped recipes/)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Parameter counts, per-rank memory by weight class, sequences that fit, and a verdict (no weights needed)."""
    import json

    from moe_export.export.planner import GIB, make_plan
    from moe_export.recipes.schema import load_recipe

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
        console.print(("[green]" if p.fits else "[red]") + p.verdict())
    if not p.fits:
        if not as_json:
            err_console.print(f"error: recipe {rec.name}: {p.verdict()}", highlight=False)
        raise typer.Exit(2)


@app.command()
def synth(
    preset: str = typer.Option(..., "--preset", help="tiny-k3, tiny-k3-dsa or tiny-kimi-linear"),
    out: str = typer.Option(..., "--out", help="output checkpoint directory"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same bytes)"),
    force: bool = typer.Option(False, "--force", help="replace a non-empty output directory"),
) -> None:
    """Write a synthetic HF checkpoint (config, sharded safetensors, tokenizer) with random weights."""
    from moe_export.export.synth import write_synthetic_checkpoint

    path = write_synthetic_checkpoint(preset, out, seed=seed, force=force)
    console.print(f"wrote synthetic checkpoint {preset} (seed {seed}) to {path}", highlight=False)


@app.command()
def inspect(
    path: str = typer.Argument(..., help="checkpoint directory, or engine directory written by `build`"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Census of a checkpoint by weight class, its layer kinds, and every problem found (exit 2 if any).
    For an engine directory: ranks, mapping, graph ops and plugin nodes, weights by class, manifest status."""
    import json

    from moe_export.export.census import inspect_checkpoint, render_checkpoint_report
    from moe_export.export.checkpoint import Problem, format_problems
    from moe_export.export.manifest import inspect_engine, is_engine_dir, render_engine_report

    if is_engine_dir(path):
        engine = inspect_engine(path)
        if as_json:
            print(json.dumps(engine, indent=2))
        else:
            render_engine_report(engine, console)
        return
    report = inspect_checkpoint(path)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render_checkpoint_report(report, console)
    if report["problems"]:
        raise InputError(format_problems(path, [Problem(**p) for p in report["problems"]]))


@app.command()
def generate(
    path: str = typer.Argument(..., help="checkpoint directory, or engine directory built by `moe-export build`"),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="comma-separated token ids, e.g. 1,2,3"),
    prompt: str | None = typer.Option(None, "--prompt", help="prompt text, tokenized with the checkpoint's tokenizer"),
    max_new_tokens: int = typer.Option(..., "--max-new-tokens", help="tokens to generate (stops early at eos)"),
    temperature: float | None = typer.Option(None, "--temperature", help="sampling temperature (0 = greedy)"),
    top_p: float | None = typer.Option(None, "--top-p", help="nucleus sampling mass in (0, 1]"),
    top_k: int | None = typer.Option(None, "--top-k", help="sample among the k most likely tokens"),
    seed: int = typer.Option(0, "--seed", help="sampling seed"),
    as_json: bool = typer.Option(False, "--json", help='print {"tokens": [...]} (the new tokens only)'),
) -> None:
    """Generate with an engine directory (all ranks in process, or one rank per process under
    `mpiexec -n WORLD`, rank 0 printing) or with the fp32 PyTorch reference model on a checkpoint.
    Greedy unless a sampling flag is given."""
    import json

    from moe_export.runtime.tokenizer import load_tokenizer
    from moe_export.runtime.generate import generate_command
    from moe_export.runtime.sampling import SamplingParams

    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    tokens = generate_command(path, prompt_ids, prompt, SamplingParams.from_flags(temperature, top_k, top_p, seed, max_new_tokens))
    if tokens is None:  # a follower rank under mpiexec: rank 0 prints
        return
    if as_json:
        print(json.dumps({"tokens": tokens}))
    else:
        print(load_tokenizer(path).decode(tokens))


@app.command()
def build(
    recipe: str = typer.Option(..., "--recipe", "-r", help="recipe YAML (path, or name in the shipped recipes/)"),
    out: str | None = typer.Option(None, "--out", help="engine directory (default: the recipe's `output`)"),
) -> None:
    """Build the per-rank engine directory; only stages whose inputs changed run again. Under
    `mpiexec -n R`, MPI process r builds the ranks n with n % R == r."""
    from rich.markup import escape

    from moe_export.export import build as driver
    from moe_export.recipes.schema import load_recipe

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


@app.command()
def verify(
    path: str = typer.Argument(..., help="engine directory written by `build`"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Re-hash every file against manifest.json; list missing, altered and extra files (exit 2 if any)."""
    import json

    from moe_export.export.manifest import verify_engine_dir

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
