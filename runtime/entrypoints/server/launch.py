"""`moe-export serve`: load the engine, then rank 0 serves HTTP with uvicorn while, under `mpiexec -n
WORLD`, the other ranks follow rank 0's step plans. SIGTERM / SIGINT: uvicorn stops accepting, drains
the running requests, the runtime shuts down (releasing the followers), and the process exits 0. When the engine
core dies, the server stops the same way and `serve` raises EngineDead (the command exits 1)."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import EngineDead, InputError

API_KEY_ENV = "MOE_EXPORT_API_KEY"
EFFORTS = ("low", "high", "max", "none")


def resolve_api_keys(cli_keys: list[str] | None) -> tuple[str, ...]:
    """Keys from `--api-key` (repeatable), else from MOE_EXPORT_API_KEY (comma-separated); () = no auth."""
    keys = list(cli_keys or []) or [k for k in os.environ.get(API_KEY_ENV, "").split(",")]
    keys = [k.strip() for k in keys if k.strip()]
    return tuple(keys)


def check_serve_args(engine_dir: str, host: str, port: int, store: str | None, default_effort: str, max_queue: int) -> None:
    EngineConfig.read(engine_dir)  # an engine directory whose config.json is valid
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise InputError(f"--host must be an IP address or localhost, got {host!r}") from None
    if default_effort not in EFFORTS:
        raise InputError(f"--default-effort must be one of {', '.join(EFFORTS)}, got {default_effort!r}")
    if max_queue < 1:
        raise InputError(f"--max-queue must be >= 1, got {max_queue}")
    if store is not None and Path(store).is_dir():
        raise InputError(f"--store {store}: is a directory; give a file path such as history.sqlite")


def serve(engine_dir: str, *, host: str = "127.0.0.1", port: int = 8000, api_keys: tuple[str, ...] = (),
          store: str | None = None, default_effort: str = "max", max_queue: int = 256,
          served_model_names: tuple[str, ...] = (), allow_image_urls: bool = False, allow_private_image_urls: bool = False,
          prefix_caching: bool = True, access_log: bool = True, offload_gib: float = 8.0,
          warm_turns: bool = True) -> None:
    """Run the server until SIGTERM / SIGINT (blocks). Under mpiexec, ranks > 0 run the follower loop. access_log:
    uvicorn's line per request on stdout (client, method, path, status); its other messages from warnings up."""
    check_serve_args(engine_dir, host, port, store, default_effort, max_queue)
    if allow_private_image_urls and not allow_image_urls:
        raise InputError("--allow-private-image-urls needs --allow-image-urls")
    if any(not name.strip() for name in served_model_names):
        raise InputError("--served-model-name must not be empty")
    from moe_export.common.mpi import mpi_world
    from moe_export.runtime.client.async_llm import AsyncLLM
    from moe_export.runtime.client.llm import LLM

    world = mpi_world()
    # a durable store keeps the prefix state next to it (`runtime.core.state_offload`; under mpiexec each rank its own
    # shards', in FILE.state/rank{N}/): chains resume after a restart
    offload = {"offload_dir": f"{store}.state", "offload_disk_bytes": int(offload_gib * (1 << 30))} \
        if store is not None and offload_gib > 0 else {}
    if world is not None and world[0] != 0:
        # mpiexec forwards SIGTERM to every rank; followers leave when rank 0 has drained and shuts down.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        LLM(engine_dir, default_effort=default_effort, prefix_caching=prefix_caching, **offload).run_follower()
        return
    import anyio
    import uvicorn
    from moe_export.runtime.entrypoints.server.app import ServerSettings, create_app
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()  # SIGTERM drains: running streams finish, they are not cut

    settings = ServerSettings(
        engine_dir=Path(engine_dir), api_keys=api_keys, store_path=store or ":memory:",
        max_queue=max_queue, served_model_names=served_model_names, allow_image_urls=allow_image_urls,
        allow_private_image_urls=allow_private_image_urls,
    )
    sock = listening_socket(host, port)  # before loading: a busy port fails fast, with no engine loaded
    # image URLs are downloaded by the server (`image_fetch`, off the event loop), never by the runtime
    llm = AsyncLLM(engine_dir, default_effort=default_effort, prefix_caching=prefix_caching, warm_turns=warm_turns,
                   **offload)
    dead: list[bool] = []

    def on_engine_dead() -> None:
        dead.append(True)
        server.should_exit = True

    try:  # the app shuts the runtime down (and releases follower ranks) at exit
        # the warm-up's steps run on every rank (under mpiexec the followers are in `run_follower` by now)
        started = time.perf_counter()
        steps = llm.warm_up()
        print(f"warm-up: {steps} engine steps on {world[1] if world else 1} rank(s) in "
              f"{time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)
        app = create_app(llm, settings, on_engine_dead=on_engine_dead)
    except BaseException:
        llm.shutdown()
        raise
    anyio.run(anyio.sleep, 0)  # anyio's asyncio backend, which sse-starlette imports on the first streamed answer
    # What start-up made (modules, the engine, tokenizer, offload index, the app and its routes: millions of objects)
    # lives as long as the server: moved out of the collector's generations, so that no full collection walks it while
    # a request waits (the first such collection came during the first request after a start: 146 ms of CPU before
    # its first token).
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=600, access_log=access_log)
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = uvicorn.Server(config)
    print(f"serving {settings.model_name} on http://{host}:{port} (store: {settings.store_path})", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM / SIGINT while it runs (stop accepting, drain, lifespan shutdown) and re-raises
    # the signal afterwards to the handler that was there before: make that one a no-op, so a drained
    # server exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if dead:
        raise EngineDead(f"the engine core stopped ({llm.fatal_error}); "
                         "the server exited for its supervisor to restart it")


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn; InputError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock
