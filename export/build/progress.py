"""Progress of a build on stderr: a rich progress bar for the running stage, one line per finished stage."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class Progress:
    """A rich progress bar on stderr for the running stage (bytes written, speed, ETA) when stderr is a
    terminal, and one line per finished stage."""

    def __init__(self, enabled: bool | None, prefix: str = "") -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.prefix = prefix
        self._bars = None
        if self.console.is_terminal if enabled is None else enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bars = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
            )

    def __enter__(self) -> Progress:
        if self._bars:
            self._bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bars:
            self._bars.stop()

    def note(self, msg: str) -> None:
        """One line on stderr."""
        self.console.print(self.prefix + msg, highlight=False, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def task(self, desc: str, watch: Path, total: int | None = None) -> Iterator[None]:
        """Track a stage by the size of the file (or folder) it is writing."""
        desc = self.prefix + desc
        t0 = time.monotonic()
        stop = threading.Event()
        thread = None
        if self._bars:
            from rich.markup import escape

            bars = self._bars
            tid = bars.add_task(escape(desc), total=total)

            def poll() -> None:
                while not stop.wait(0.25):
                    bars.update(tid, completed=size_of(watch))

            thread = threading.Thread(target=poll, daemon=True)
            thread.start()
        try:
            yield
        finally:
            if thread is not None:
                stop.set()
                thread.join()
                bars.remove_task(tid)
        self.console.print(f"{desc}: done in {time.monotonic() - t0:.1f} s", highlight=False, markup=False)


def size_of(path: Path) -> int:
    try:
        if path.is_dir():  # a scratch folder: what the stage wrote, not the inputs linked in for it
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and not p.is_symlink())
        return path.stat().st_size
    except OSError:
        return 0
