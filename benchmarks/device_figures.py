"""A device check's figures as one flat JSON object, written after every stage (a command stopped by its time limit
keeps what it measured), and each stage's failure recorded instead of raised (the later stages still run).

    fig = Figures(args.json)
    with fig.stage("device"):
        fig["device"] = torch.cuda.get_device_name()

A failed stage `name` leaves `<name>_error` ("ExceptionType: message", 500 characters at most); every stage leaves
`<name>_seconds`. The object is printed as one line after every stage too.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Figures(dict):
    """The figures of one device check (see the module docstring); `path` None: printed only."""

    def __init__(self, path: str | Path | None, **first) -> None:
        super().__init__(first)
        self.path = None if path is None else Path(path)
        self.write()

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield self
        except Exception as exc:  # the finding: record it, run the other stages
            self[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
            self.write()

    def errors(self) -> dict[str, str]:
        return {k: v for k, v in self.items() if k.endswith("_error")}

    def write(self) -> None:
        print(json.dumps(self, sort_keys=True, default=str), flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(self, indent=2, sort_keys=True, default=str) + "\n")
            tmp.replace(self.path)
