"""The repository `moe-export triton-repo` writes, served by a real Triton Inference Server: tritonserver 2.51
and its Python-backend stub as the nvidia-pytriton wheel bundles them (they run on CPU), driven with the
official tritonclient gRPC client and Triton's HTTP generate endpoints.

The model's Python environment is an EXECUTION_ENV_PATH environment (`triton-repo --python-env`): a venv holding
numpy < 2, which the 2.51 stub needs, whose `.pth` file then adds this interpreter's site-packages (moe-export
and its dependencies). The two wheels (nvidia-pytriton without its dependencies, numpy 1.26.4) are fetched
with pip into the pytest cache on first use: installing nvidia-pytriton into the project's environment would
pull numpy < 2 (and pandas < 3) into the whole suite. Slow: starting the server and loading the model in its
stub take most of a minute."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from serve_support import free_port

PYTRITON = "nvidia-pytriton==0.7.0"  # bundles tritonserver 2.51.0
STUB_NUMPY = "numpy==1.26.4"
MODEL = "kimi"

pytestmark = pytest.mark.slow


def _wheels(cache: Path) -> tuple[Path, Path]:
    found = [sorted(cache.glob(pattern)) for pattern in ("nvidia_pytriton-0.7.0-*.whl", "numpy-1.26.4-*.whl")]
    if not all(found):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                            str(cache), PYTRITON, STUB_NUMPY], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"pip download {PYTRITON} {STUB_NUMPY} failed:\n{r.stderr[-2000:]}"
        found = [sorted(cache.glob(pattern)) for pattern in ("nvidia_pytriton-0.7.0-*.whl", "numpy-1.26.4-*.whl")]
    return found[0][-1], found[1][-1]


def _server_files(wheel: Path, out: Path) -> tuple[Path, Path, Path]:
    """(tritonserver binary, backend directory, bundled libraries) unpacked from the wheel, with the stub of this
    interpreter's Python version in the python backend (as pytriton itself arranges it)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    keep = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/", "nvidia_pytriton.libs/",
            f"pytriton/tritonserver/python_backend_stubs/{version}/")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out, [n for n in z.namelist() if n.startswith(keep)])
    root = out / "pytriton" / "tritonserver"
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    shutil.copy(root / "python_backend_stubs" / version / "triton_python_backend_stub", stub)
    for path in (root / "bin" / "tritonserver", stub):
        path.chmod(0o755)
    return root / "bin" / "tritonserver", root / "backends", out / "nvidia_pytriton.libs"


def _python_env(numpy_wheel: Path, out: Path) -> Path:
    """A venv with numpy < 2 first on its path, then this interpreter's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(out)], check=True, timeout=120)
    site = Path(subprocess.run([str(out / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    with zipfile.ZipFile(numpy_wheel) as z:
        z.extractall(site)
    (site / "zz_moe_export.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return out


@pytest.fixture(scope="module")
def triton(runtime_engine, tmp_path_factory, pytestconfig):
    """A running tritonserver on the generated repository: (HTTP url, gRPC address, engine directory)."""
    from moe_export.runtime.entrypoints.triton.repo import write_triton_repo

    engine = runtime_engine("tiny-k3", 1, 1, 1)
    root = tmp_path_factory.mktemp("tritonserver")
    pytriton_wheel, numpy_wheel = _wheels(Path(pytestconfig.cache.mkdir("triton-server-wheels")))
    server, backends, libs = _server_files(pytriton_wheel, root / "dist")
    env_dir = _python_env(numpy_wheel, root / "py-env")
    write_triton_repo(engine, root / "repo", MODEL, default_effort="low", python_env=str(env_dir))
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "MOE_EXPORT_ENGINE_DIR"}
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH")) if p)
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([str(server), "--model-repository", str(root / "repo"), "--backend-directory", str(backends),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 180
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-4000:]
            time.sleep(0.5)
        yield url, f"127.0.0.1:{grpc}", engine
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _inputs(prompt=None, params=None, *, stream=True, messages=None, exclude_input=None):
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return t

    out = [tensor("stream", stream, "BOOL")]
    if prompt is not None:
        out.append(tensor("text_input", prompt.encode(), "BYTES"))
    if messages is not None:
        out.append(tensor("messages", json.dumps(messages).encode(), "BYTES"))
    if params is not None:
        out.append(tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"))
    if exclude_input is not None:
        out.append(tensor("exclude_input_in_output", exclude_input, "BOOL"))
    return out


class Stream:
    """One tritonclient gRPC bidirectional stream; `collect(id)` gathers a request's responses to its final one."""

    def __init__(self, address: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(address)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.results: dict[str, list] = {}

    def send(self, request_id: str, inputs) -> None:
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def collect(self, request_id: str, timeout: float = 120) -> list:
        """The request's results (an InferenceServerException for an error), through its final response."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.results.get(request_id, [])
            if got and (isinstance(got[-1], Exception) or _is_final(got[-1])):
                return got
            result, error = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            rid = error is None and result.get_response().id
            self.results.setdefault(rid if error is None else request_id, []).append(error or result)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _is_final(result) -> bool:
    final = result.get_response().parameters.get("triton_final_response")
    return bool(final and final.bool_param)


def _text(results, name="text_output") -> str:
    return "".join(r.as_numpy(name)[0].decode() for r in results if r.as_numpy(name) is not None)


def test_grpc_stream_and_http_generate_agree(triton):
    """A raw prompt streamed over gRPC, the same over HTTP generate_stream, and whole over HTTP generate: the same
    text and usage; a chat streams its reasoning and content apart."""
    url, address, _ = triton
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    stream = Stream(address)
    try:
        stream.send("raw", _inputs("hello there", params))
        stream.send("chat", _inputs(params={"max_tokens": 16, "temperature": 0, "reasoning_effort": "low"},
                                    messages=[{"role": "user", "content": "hi"}]))
        raw, chat = stream.collect("raw"), stream.collect("chat")
    finally:
        stream.close()
    assert len(raw) >= 2 and not any(isinstance(r, Exception) for r in raw)
    whole = httpx.post(f"{url}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "hello there", "exclude_input_in_output": True, "sampling_parameters": json.dumps(params)}).json()
    assert whole["text_output"] == _text(raw) and whole["finish_reason"] == "length"
    assert json.loads(whole["usage"])["completion_tokens"] == 12 == json.loads(raw[-1].as_numpy("usage")[0])["completion_tokens"]
    sse = httpx.post(f"{url}/v2/models/{MODEL}/generate_stream", timeout=120, json={
        "text_input": "hello there", "stream": True, "sampling_parameters": json.dumps(params)})
    events = [json.loads(line[len("data: "):]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == whole["text_output"] and events[-1]["finish_reason"] == "length"
    assert not any(isinstance(r, Exception) for r in chat)
    usage = json.loads(chat[-1].as_numpy("usage")[0])
    assert usage["reasoning_tokens"] == 6  # the low tier's cap (tiny engine), closed by the budget
    assert _text(chat, "reasoning_content") and usage["completion_tokens"] <= 16


def test_cancelled_streams_free_the_batch(triton):
    """Cancelling (stop_stream with cancel_requests) every request of a full batch frees its slots at once: a
    request sent right after finishes in well under the time the batch would still have run (about 6 s here)."""
    url, address, engine = triton
    slots = json.loads((Path(engine) / "config.json").read_text())["limits"]["max_batch"]
    stream = Stream(address)
    for i in range(slots):
        stream.send(f"long{i}", _inputs(f"story {i}", {"max_tokens": 900, "ignore_eos": True, "temperature": 0}))
    started: set[str] = set()
    while len(started) < slots:
        result, error = stream.events.get(timeout=60)
        assert error is None, error
        started.add(result.get_response().id)
    stream.close(cancel=True)
    t0 = time.monotonic()
    after = httpx.post(f"{url}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "after", "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})})
    assert after.status_code == 200 and after.json()["finish_reason"] == "length"
    assert time.monotonic() - t0 < 2.0


def test_bad_requests_are_errors_and_the_server_stays_ready(triton):
    url, address, _ = triton
    bad = httpx.post(f"{url}/v2/models/{MODEL}/generate", timeout=60,
                     json={"text_input": "x", "sampling_parameters": json.dumps({"beam_width": 3})})
    assert bad.status_code == 400 and "beam_width" in bad.json()["error"]
    stream = Stream(address)
    try:
        errors = {}
        for rid, inputs in (("echo", _inputs("x", {"max_tokens": 2}, exclude_input=False)),
                            ("seed", _inputs("x", {"max_tokens": 2, "seed": "many"}))):
            stream.send(rid, inputs)  # one at a time: an error response carries no request id
            errors[rid] = stream.collect(rid)[-1]
    finally:
        stream.close()
    assert all(isinstance(e, Exception) for e in errors.values()), errors
    assert "exclude_input_in_output=false is not allowed when streaming" in str(errors["echo"])
    assert "seed" in str(errors["seed"])
    assert _ready(url)
    ok = httpx.post(f"{url}/v2/models/{MODEL}/generate", timeout=60,
                    json={"text_input": "fine", "sampling_parameters": json.dumps({"max_tokens": 3})})
    assert ok.status_code == 200 and ok.json()["finish_reason"] == "length"
