"""`moe-export chat ENGINE`: a terminal conversation over the runtime.

Streams each answer as it is generated (reasoning dimmed), keeps the history across turns (reasoning and
tool calls verbatim, each answer as the tokens generated, so the next turn continues the kept state instead
of prefilling it again), and
takes commands: `/effort low|high|max|none` (or a number of reasoning tokens), `/image PATH` (attach an image to the
next message; engines with a vision tower), `/reset`, `/exit`.
`/help` lists them. On a terminal the input line is prompt_toolkit's editor (cursor keys, Emacs bindings,
history across sessions in a file, Up / Down to recall); Ctrl-C while an answer streams cancels that answer
(the request is aborted, the conversation stays as it was before the question), Ctrl-C at the prompt clears
the line, Ctrl-D or /exit ends the session. Model text is printed with control characters (ESC included)
shown as escapes, so it can never drive the terminal. Piped input is read line by line.
Under mpiexec rank 0 talks to the terminal and the other ranks follow its steps.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from moe_export.common.errors import InputError
from moe_export.runtime.core.budget import resolve_thinking
from moe_export.runtime.client.llm import LLM
from moe_export.runtime.images import image_file_part
from moe_export.runtime.sampling import SamplingParams
from rich.console import Console

HELP = "commands: /effort low|high|max|none|TOKENS, /image PATH (attach to the next message), /reset (forget the conversation), /help, /exit"
HELP_LONG = """/effort low|high|max|none|TOKENS  thinking effort of the next answers (a number: a reasoning-token cap)
/image PATH                       attach an image to your next message (engines with a vision tower)
/reset                            forget the conversation
/help                             this list
/exit                             end the session (also Ctrl-D)
Ctrl-C cancels the answer being written; Up / Down recall earlier lines."""


def visible(text: str) -> str:
    """`text` with every control character but newline and tab shown as an escape (ESC -> \\x1b), so model
    output cannot move the cursor, clear the screen or retitle the terminal."""
    return "".join(c if c in "\n\t" or not (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) else f"\\x{ord(c):02x}" for c in text)


def default_history_path() -> Path:
    """$XDG_STATE_HOME/moe-export/chat_history (~/.local/state when unset)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "moe-export" / "chat_history"


def _line_reader(stdin: TextIO | None, console: Console, history: Path | None) -> Callable[[], str | None]:
    """A function returning the next input line (None at the end): prompt_toolkit's editor on a terminal,
    plain lines otherwise."""
    if stdin is None and sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        store = InMemoryHistory()
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                store = FileHistory(str(history))
            except OSError as exc:
                console.print(f"(history not kept: {exc})", style="dim", markup=False)
        session = PromptSession(history=store)

        def read() -> str | None:
            while True:
                try:
                    return session.prompt("> ")
                except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
                    continue
                except EOFError:
                    return None

        return read
    stream = stdin or sys.stdin

    def read_plain() -> str | None:
        console.print("> ", end="", style="bold", markup=False)
        line = stream.readline()
        return line if line else None

    return read_plain


class _Interrupt:
    """While active, Ctrl-C (SIGINT) sets a flag instead of raising: the answer loop stops between steps, so
    the engine is never interrupted mid-step. Only installed in the main thread."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _Interrupt:
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class _Conversation:
    """The terminal's conversation state: messages so far, image parts waiting for the next message, the effort."""

    def __init__(self, system: str | None, effort: str) -> None:
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self.images: list[dict] = []  # image parts attached to the next message
        self.effort = effort

    def command(self, line: str, llm: LLM, console: Console) -> bool:
        """Run a /command; False for /exit."""
        cmd, _, arg = line.partition(" ")
        if cmd in ("/exit", "/quit"):
            return False
        try:
            if cmd == "/help":
                console.print(HELP_LONG, markup=False)
            elif cmd == "/reset":
                self.history, self.images = list(self.start), []
                console.print("(conversation cleared)", style="dim", markup=False)
            elif cmd == "/effort":
                resolve_thinking(arg.strip(), llm.thinking_caps, "max")
                self.effort = arg.strip()
                console.print(f"(thinking effort: {self.effort})", style="dim", markup=False)
            elif cmd == "/image":
                self.images.append(image_file_part(arg.strip()))
                console.print(f"(image {arg.strip()} attached to your next message)", style="dim", markup=False)
            else:
                console.print(f"(unknown command {visible(cmd)}; /help lists the commands)", style="red", markup=False)
        except InputError as exc:
            console.print(f"(error: {exc})", style="red", markup=False)
        return True

    def answer(self, line: str, llm: LLM, sampling: SamplingParams, console: Console, interrupt: _Interrupt) -> None:
        """Stream the answer to a user line; the turn is kept only when the answer completed."""
        content = [{"type": "text", "text": line}, *self.images] if self.images else line
        self.history.append({"role": "user", "content": content})
        self.images = []
        out = None
        try:
            with interrupt:
                stream = llm.chat_stream(self.history, sampling, reasoning_effort=self.effort)
                try:
                    for delta in stream:
                        if delta.reasoning:
                            console.print(visible(delta.reasoning), style="dim", end="", markup=False)
                        if delta.content:
                            console.print(visible(delta.content), end="", markup=False)
                        out = delta.output or out
                        if interrupt.requested:
                            break
                finally:
                    stream.close()  # a cancelled answer: the runtime aborts the request now
        except InputError as exc:  # e.g. the conversation no longer fits max_seq_len
            self.history.pop()
            console.print(f"\n(error: {exc})", style="red", markup=False)
            return
        if out is None:  # Ctrl-C: the question and its partial answer are dropped
            self.history.pop()
            console.print("\n(answer cancelled)", style="yellow", markup=False)
            return
        for call in out.tool_calls:
            console.print(f"\n[tool call] {visible(call['function']['name'])}({visible(call['function']['arguments'])})",
                          markup=False)
        u = out.usage
        console.print(f"\n(prompt {u['prompt_tokens']} tokens, {u['cached_tokens']} reused; reasoning "
                      f"{u['reasoning_tokens']}; completion {u['completion_tokens']}; {out.finish_reason})",
                      style="dim", markup=False)
        self.history.append(out.message())


def chat_terminal(engine_dir: str | Path, *, effort: str = "max", flags: dict | None = None,
                  system: str | None = None, stdin: TextIO | None = None, console: Console | None = None,
                  history_path: str | Path | None = None) -> None:
    """Run the conversation loop until /exit or end of input. flags: SamplingParams.from_flags' keywords over the
    engine's defaults (`LLM.default_sampling`); history_path: the line editor's history file (terminal input only;
    default `default_history_path()`)."""
    console = console or Console(highlight=False, soft_wrap=True)
    llm = LLM(engine_dir, default_effort=effort if effort in ("low", "high", "max", "none") else "max")
    if not llm.engine.is_root:
        llm.run_follower()
        return
    try:
        resolve_thinking(effort, llm.thinking_caps, "max")
        sampling = SamplingParams.from_flags(llm.default_sampling, **(flags or {}))
        talk = _Conversation(system, effort)
        console.print(f"moe-export chat ({llm.family or 'no chat format'}, effort {effort}). {HELP}", style="dim", markup=False)
        read_line = _line_reader(stdin, console, Path(history_path) if history_path else default_history_path())
        interrupt = _Interrupt()
        while (line := read_line()) is not None:
            line = line.strip()
            if line.startswith("/"):
                if not talk.command(line, llm, console):
                    break
            elif line:
                talk.answer(line, llm, sampling, console, interrupt)
    finally:
        llm.shutdown()
