"""One build at a time per output folder: an exclusive `flock` on `OUT/.cache/build.lock`.

The lock file records its holder (pid, host, start time) so that a second build can name it. The kernel
drops the lock when the holder exits, killed or not, so a stale file never blocks a later build.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from moe_export.common.errors import InputError

LOCK_FILE = "build.lock"


class OutputLock:
    """Held while a build writes into OUT; `release()` (or process exit) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd, self.path = fd, path

    @classmethod
    def acquire(cls, out: Path) -> OutputLock:
        """Lock OUT for this process; InputError naming the holder if another build has it."""
        folder = out / ".cache"  # bookkeeping: not an artifact, not a stage record
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"output {out}: cannot write there ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise InputError(f"output {out}: another build is writing there ({holder}); wait for it to finish "
                             "or choose another --out") from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return cls(fd, folder / LOCK_FILE)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1


def _describe_holder(fd: int) -> str:
    try:
        rec = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {rec['pid']} on {rec['host']}, started {rec['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown: it has not recorded itself yet"
