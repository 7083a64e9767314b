"""The `moe-export` command line (typer). Every command exits 0 on success and 2 on bad input,
printing one paragraph on stderr without a traceback (`--debug` shows it)."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

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


def main() -> None:
    """Console-script entry point: maps InputError to exit 2 with a one-paragraph message."""
    debug = "--debug" in sys.argv
    try:
        app(standalone_mode=False)
    except InputError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        sys.exit(code or 0)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise
