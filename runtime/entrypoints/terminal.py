"""`moe-export chat ENGINE`: a terminal conversation over the runtime.

Streams each answer as it is generated (reasoning dimmed), keeps the history across turns (reasoning and
tool calls verbatim, each answer as the tokens generated, so the next turn continues the kept state instead
of prefilling it again), and
takes commands: `/effort low|high|max|none` (or a number of reasoning tokens), `/image PATH` (attach an image to the
next message; engines with a vision tower), `/reset`, `/exit`.
Under mpiexec rank 0 talks to the terminal and the other ranks follow its steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from rich.console import Console

from moe_export.export.errors import InputError
from moe_export.runtime.core.budget import resolve_thinking
from moe_export.runtime.entrypoints.llm import LLM
from moe_export.runtime.images import image_file_part
from moe_export.runtime.sampling import SamplingParams

HELP = "commands: /effort low|high|max|none|TOKENS, /image PATH (attach to the next message), /reset (forget the conversation), /exit"


def chat_terminal(engine_dir: str | Path, *, effort: str = "max", sampling: SamplingParams | None = None,
                  system: str | None = None, stdin: TextIO | None = None, console: Console | None = None) -> None:
    """Run the conversation loop until /exit or end of input."""
    stdin = stdin or sys.stdin
    console = console or Console(highlight=False, soft_wrap=True)
    llm = LLM(engine_dir, default_effort=effort if effort in ("low", "high", "max", "none") else "max")
    if not llm.engine.is_root:
        llm.run_follower()
        return
    try:
        resolve_thinking(effort, llm.thinking_caps, "max")
        start = [{"role": "system", "content": system}] if system else []
        history = list(start)
        images: list[dict] = []  # image parts attached to the next message
        console.print(f"moe-export chat ({llm.family or 'no chat format'}, effort {effort}). {HELP}", style="dim", markup=False)
        while True:
            console.print("> ", end="", style="bold", markup=False)
            line = stdin.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                cmd, _, arg = line.partition(" ")
                if cmd in ("/exit", "/quit"):
                    break
                if cmd == "/reset":
                    history, images = list(start), []
                    console.print("(conversation cleared)", style="dim", markup=False)
                elif cmd == "/effort":
                    try:
                        resolve_thinking(arg.strip(), llm.thinking_caps, "max")
                    except InputError as exc:
                        console.print(f"(error: {exc})", style="red", markup=False)
                        continue
                    effort = arg.strip()
                    console.print(f"(thinking effort: {effort})", style="dim", markup=False)
                elif cmd == "/image":
                    try:
                        images.append(image_file_part(arg.strip()))
                    except InputError as exc:
                        console.print(f"(error: {exc})", style="red", markup=False)
                        continue
                    console.print(f"(image {arg.strip()} attached to your next message)", style="dim", markup=False)
                else:
                    console.print(f"(unknown command {cmd}; {HELP})", style="red", markup=False)
                continue
            content = [{"type": "text", "text": line}, *images] if images else line
            history.append({"role": "user", "content": content})
            images = []
            out = None
            try:
                for delta in llm.chat_stream(history, sampling, reasoning_effort=effort):
                    if delta.reasoning:
                        console.print(delta.reasoning, style="dim", end="", markup=False)
                    if delta.content:
                        console.print(delta.content, end="", markup=False)
                    out = delta.output or out
            except InputError as exc:  # e.g. the conversation no longer fits max_seq_len
                history.pop()
                console.print(f"\n(error: {exc})", style="red", markup=False)
                continue
            for call in out.tool_calls:
                console.print(f"\n[tool call] {call['function']['name']}({call['function']['arguments']})", markup=False)
            u = out.usage
            console.print(f"\n(prompt {u['prompt_tokens']} tokens, {u['cached_tokens']} reused; reasoning "
                          f"{u['reasoning_tokens']}; completion {u['completion_tokens']}; {out.finish_reason})",
                          style="dim", markup=False)
            history.append(out.message())
    finally:
        llm.shutdown()
