"""Helpers for the live-server tests: a tiny engine for serving, an in-process uvicorn server on a
loopback socket, and a `moe-export serve` subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

SERVE_LIMITS = {"max_batch": 16, "max_seq_len": 2048, "max_num_tokens": 256, "block_size": 16}
SERVE_THINKING = {"low": 4, "high": 8, "max": 12}


def build_serve_engine(root: Path, preset: str = "tiny-k3", tp: int = 1, ep: int = 1, world: int = 1,
                       limits: dict | None = None) -> Path:
    """Engine directory from tiny-cpu.yaml with serving limits (16 sequences, 2048 context; `limits` overrides
    some) and small caps."""
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    data = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    data["name"] = f"serve-{preset}-w{world}" + "".join(f"-{k}{v}" for k, v in sorted((limits or {}).items()))
    data["model"] = {"source": f"synthetic:{preset}"}
    data["target"]["gpus_per_node"] = world
    data["parallel"] = {"tp": tp, "ep": ep}
    data["limits"].update({**SERVE_LIMITS, **(limits or {})})
    data["thinking"] = dict(SERVE_THINKING)
    path = root / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    rec, _ = load_recipe(path)
    out = root / rec.name
    build(rec, out)
    return out


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port() -> int:
    with loopback_socket() as s:
        return s.getsockname()[1]


class InProcessServer:
    """create_app over an AsyncLLM, served by uvicorn in a thread on a random loopback port."""

    def __init__(self, engine_dir: Path, default_effort: str = "max", **settings) -> None:
        import uvicorn
        from moe_export.runtime.entrypoints.llm import AsyncLLM
        from moe_export.runtime.entrypoints.server.app import ServerSettings, create_app

        self.settings = ServerSettings(engine_dir=engine_dir, **settings)
        self.llm = AsyncLLM(engine_dir, default_effort=default_effort)
        self.app = create_app(self.llm, self.settings)
        self.sock = loopback_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_ready(self.url, 60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health not ready after {timeout} s")


def cli_command() -> list[str]:
    return [sys.executable, "-c", "from moe_export.runtime.entrypoints.cli import main; main()"]


def start_cli_server(args: list[str], *, mpiexec_ranks: int = 0, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`moe-export serve ARGS --port P` as a subprocess (under `mpiexec -n N` when asked); waits for /health."""
    port = free_port()
    cmd = [*cli_command(), "serve", *args, "--port", str(port)]
    if mpiexec_ranks:
        mpiexec = Path(os.path.realpath(sys.executable)).parent / "mpiexec"
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(mpiexec_ranks), *cmd]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 120, proc)
    return proc, url


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
