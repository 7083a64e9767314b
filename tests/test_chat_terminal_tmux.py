"""`moe-export chat` on a real terminal: the session runs in a tmux pane and is driven by keystrokes (tmux
send-keys), the screen read back with capture-pane. The engine is a tiny random-weight one; a logits processor
steers what the model writes (an answer made of terminal escape sequences, or one that never ends), so the
terminal's handling is what is tested: line editing, history, Ctrl-C cancelling an answer, escapes shown
as text, /help."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")

DRIVER = '''
import sys
import time
import torch
from moe_export.runtime.entrypoints import terminal
from moe_export.runtime.entrypoints.llm import LLM
from moe_export.runtime.sampling import SamplingParams

ESCAPES = "\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07"  # clear the screen, home the cursor, retitle the window


class Steered(LLM):
    """'esc' questions: the answer is ESCAPES then the end; other questions: a slow answer that never ends early."""

    def chat_stream(self, messages, sampling=None, **kwargs):
        forced = self.tokenizer.encode(ESCAPES) + sorted(self.tokenizer.eos_token_ids)[:1]
        eos = sorted(self.tokenizer.eos_token_ids)
        steer = "esc" in str(messages[-1]["content"])

        def processor(output_ids, logits):
            i = len(output_ids)
            if steer and i < len(forced):
                keep = logits[forced[i]].clone()
                logits[:] = float("-inf")
                logits[forced[i]] = keep if torch.isfinite(keep) else 0.0
            elif not steer:
                logits[eos] = float("-inf")
                time.sleep(0.05)  # 600 tokens take >= 30 s: still streaming when Ctrl-C arrives, however fast the machine
            return logits

        return super().chat_stream(messages, sampling, logits_processors=[processor], **kwargs)


terminal.LLM = Steered
terminal.chat_terminal(sys.argv[1], effort="none", flags={"temperature": 0, "max_tokens": 600},
                       history_path=sys.argv[2])
print("SESSION-ENDED")
'''


class Pane:
    def __init__(self, command: list[str]) -> None:
        self.name = f"moe-chat-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "60",
                        " ".join(command) + "; sleep 60"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def text(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-t", self.name, "-S", "-200"], check=True,
                              capture_output=True, text=True).stdout

    def wait_for(self, needle: str, timeout: float = 120, count: int = 1) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.text()
            if screen.count(needle) >= count:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{needle!r} (x{count}) not on the screen after {timeout} s:\n{self.text()}")

    def wait_prompt(self, timeout: float = 120) -> str:
        """Until the editor shows an empty prompt (keys typed before it is up would be echoed by the tty)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.text()
            last = [line for line in screen.splitlines() if line.strip()][-1:]
            if last and last[0].rstrip() == ">":
                return screen
            time.sleep(0.2)
        raise AssertionError(f"no prompt after {timeout} s:\n{self.text()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_chat_on_a_terminal(runtime_engine, tmp_path):
    engine = runtime_engine("tiny-k3", 1, 1, 1)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    history = tmp_path / "history"
    pane = Pane([sys.executable, str(driver), str(engine), str(history)])
    try:
        pane.wait_prompt()
        pane.keys("sc", "C-a", "e", "End", "Left", "Right", "Enter")  # line editing: Home, End, arrows
        screen = pane.wait_for("(prompt ")
        assert "> esc" in screen and "[D" not in screen and "[C" not in screen  # no raw escape codes echoed
        # the model's escapes are shown as text: the screen was not cleared (the banner is still there)
        assert "\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07" in screen and "moe-export chat" in screen

        pane.wait_prompt()
        pane.keys("Up")  # history recalls the last line
        assert pane.wait_for("> esc", count=2)
        pane.keys("C-u", "tell me a long story", "Enter")
        time.sleep(3)  # the never-ending answer is streaming
        pane.keys("C-c")
        screen = pane.wait_for("(answer cancelled)")
        assert "SESSION-ENDED" not in screen  # Ctrl-C cancelled the answer, not the session

        pane.wait_prompt()
        pane.keys("esc again", "Enter")  # the session goes on, the cancelled question left no trace
        screen = pane.wait_for("(prompt ", count=2)
        first, second = [int(line.split()[1]) for line in screen.splitlines() if line.startswith("(prompt ")]
        assert second > first  # the first exchange is history: the session and its conversation went on
        pane.wait_prompt()
        pane.keys("/help", "Enter")
        pane.wait_for("Ctrl-C cancels the answer being written")
        pane.wait_prompt()
        pane.keys("C-d")
        pane.wait_for("SESSION-ENDED")
    finally:
        pane.close()
    lines = history.read_text()
    assert "esc" in lines and "tell me a long story" in lines and "/help" in lines  # kept across sessions
