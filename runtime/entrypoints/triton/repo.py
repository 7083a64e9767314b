"""`moe-export triton-repo`: a Triton Inference Server model repository serving a built engine.

Layout written (the whole NAME folder is built under a temporary name and renamed into place):
    REPO/NAME/config.pbtxt   Python backend, decoupled (streaming), dynamic batcher off (the runtime batches),
                             the tensor names of Triton's vLLM backend plus messages / reasoning_content /
                             tool_calls / usage / finish_reason, parameters engine_dir, default_effort and
                             prefix_caching ("true" / "false"), and EXECUTION_ENV_PATH when given (comments
                             say which Python runs the model)
    REPO/NAME/1/model.py     runtime/entrypoints/triton/model.py verbatim: hosts an AsyncLLM on the engine
    REPO/launch_NAME.sh      starts tritonserver; for a multi-rank engine under mpiexec (see below)

Python environment. Triton's Python-backend stub runs 1/model.py with the container's system `python3`, which
then needs moe-export and its dependencies installed; or, with `--python-env PATH`, in an environment of its
own (config.pbtxt parameter EXECUTION_ENV_PATH: a conda-pack archive or an unpacked environment folder, of the
stub's Python version; `$$TRITON_MODEL_DIRECTORY` stands for the model folder). The stub of Triton 2.51 needs
numpy < 2 there.

Multi-rank engines. A single-host world runs in process (the default: the model's Engine loads every rank
and runs them in lockstep). To give each rank its own process, the launch script starts the world under
MPICH's mpiexec as one MPMD job: rank 0 runs `tritonserver`, whose Python-backend stub (a child process
that inherits the PMI environment) creates the runtime as the world's leader; ranks 1..W-1 run
`python -m moe_export.runtime.entrypoints.triton.follower ENGINE`, following the leader's step plans until it shuts
down. The model's instance count must stay 1 in that mode (one leader per world).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

from moe_export.common.atomic import fsync_path
from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# (name, Triton data type, dims, optional)
INPUTS = (
    ("text_input", "TYPE_STRING", "[ 1 ]", True),
    ("messages", "TYPE_STRING", "[ 1 ]", True),
    ("images", "TYPE_STRING", "[ -1 ]", True),  # encoded images (PNG / JPEG / WebP / GIF bytes), K3 engines
    ("stream", "TYPE_BOOL", "[ 1 ]", True),
    ("sampling_parameters", "TYPE_STRING", "[ 1 ]", True),
    ("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]", True),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", "[ -1 ]"),
    ("reasoning_content", "TYPE_STRING", "[ -1 ]"),
    ("tool_calls", "TYPE_STRING", "[ -1 ]"),
    ("usage", "TYPE_STRING", "[ -1 ]"),
    ("finish_reason", "TYPE_STRING", "[ -1 ]"),
)


def _quote(text: str) -> str:
    """A protobuf text-format string literal (UTF-8 kept, control characters escaped)."""
    return json.dumps(text, ensure_ascii=False)


PYTHON_ENV_COMMENT = (
    "# Python environment of 1/model.py: without an EXECUTION_ENV_PATH parameter, Triton's Python-backend stub runs it",
    "# with the container's system python3, which needs moe-export and its dependencies installed. EXECUTION_ENV_PATH",
    "# (moe-export triton-repo --python-env PATH) names an environment of its own instead: a conda-pack archive or an",
    "# unpacked environment folder, of the stub's Python version, with numpy < 2 for Triton 2.51's stub",
    "# (\"$$TRITON_MODEL_DIRECTORY\" stands for this model's folder).",
)


def render_config_pbtxt(model_name: str, engine_dir: str, default_effort: str = "max", instances: int = 1,
                        prefix_caching: bool = True, python_env: str | None = None) -> str:
    """The model's config.pbtxt (protobuf text format of Triton's ModelConfig). engine_dir: as written (a path
    relative to the model folder, or absolute as seen where Triton runs). The instance kind is KIND_MODEL: the
    runtime places itself (CPU engines on the host, GPU engines on their devices), so the same repository
    serves in a container or on GPUs. python_env: the EXECUTION_ENV_PATH parameter (None: the system Python)."""
    lines = [
        f"name: {_quote(model_name)}",
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "# no dynamic_batching block: the moe-export runtime batches requests continuously inside the model",
    ]
    for name, dtype, dims, optional in INPUTS:
        lines.append(f"input {{ name: {_quote(name)} data_type: {dtype} dims: {dims} optional: {str(optional).lower()} }}")
    for name, dtype, dims in OUTPUTS:
        lines.append(f"output {{ name: {_quote(name)} data_type: {dtype} dims: {dims} }}")
    lines.append(f"instance_group [ {{ count: {instances} kind: KIND_MODEL }} ]")
    lines.extend(PYTHON_ENV_COMMENT)
    parameters = [("engine_dir", engine_dir), ("default_effort", default_effort), ("prefix_caching", str(prefix_caching).lower())]
    if python_env is not None:
        parameters.append(("EXECUTION_ENV_PATH", python_env))
    for key, value in parameters:
        lines.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}")
    return "\n".join(lines) + "\n"


def render_launch_script(model_name: str, engine_dir: str, world_size: int) -> str:
    """Bash script starting Triton on this repository, in process or (--mpi) as an MPMD mpiexec world. The
    engine path is written once, shell-quoted (`shlex.quote`: no expansion, no command substitution, bytes
    kept), and only ever used inside double quotes."""
    return f"""#!/usr/bin/env bash
# Start Triton Inference Server on this repository (model {model_name}, engine ENGINE below, {world_size} rank(s)).
#   ./launch_{model_name}.sh [tritonserver args...]        every rank in the model's process (single host)
#   ./launch_{model_name}.sh --mpi [tritonserver args...]  one process per rank: rank 0 = tritonserver (leader),
#                                                          ranks 1..{world_size - 1} follow its step plans
set -euo pipefail
REPO="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
ENGINE={shlex.quote(engine_dir)}
if [[ "$ENGINE" != /* ]]; then ENGINE="$REPO/{model_name}/$ENGINE"; fi  # relative to the model folder
ENGINE="${{MOE_EXPORT_ENGINE_DIR:-$ENGINE}}"
export MOE_EXPORT_ENGINE_DIR="$ENGINE"
WORLD={world_size}
PYTHON="${{PYTHON:-python3}}"
if [[ "${{1:-}}" == "--mpi" ]]; then
  shift
  if (( WORLD == 1 )); then exec tritonserver --model-repository "$REPO" "$@"; fi
  exec mpiexec -n 1 tritonserver --model-repository "$REPO" "$@" \\
    : -n $((WORLD - 1)) "$PYTHON" -m moe_export.runtime.entrypoints.triton.follower "$ENGINE"
fi
exec tritonserver --model-repository "$REPO" "$@"
"""


def write_triton_repo(engine_dir: str | Path, out: str | Path, model_name: str = "moe-export",
                      default_effort: str = "max", engine_path: str | None = None, prefix_caching: bool = True,
                      python_env: str | None = None) -> Path:
    """Write REPO/NAME (config.pbtxt, 1/model.py) and REPO/launch_NAME.sh; returns REPO/NAME.
    An existing REPO/NAME is replaced whole; other models in REPO are left alone."""
    from moe_export.runtime.core.budget import EFFORT_TIERS

    engine = Path(engine_dir).resolve()
    world_size = EngineConfig.read(engine).mapping.world_size
    if not MODEL_NAME_RE.match(model_name):
        raise InputError(f"model name {model_name!r}: use letters, digits, '_', '.', '-' (a Triton model folder name)")
    if default_effort not in (*EFFORT_TIERS, "none"):
        raise InputError(f"default effort {default_effort!r}: expected one of {', '.join((*EFFORT_TIERS, 'none'))}")
    repo = Path(out)
    if repo.exists() and not repo.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    repo.mkdir(parents=True, exist_ok=True)
    final = repo / model_name
    # the engine as config.pbtxt names it: given (e.g. its path inside a container), else relative to the model
    # folder, so the repository and the engine move together (MOE_EXPORT_ENGINE_DIR overrides both at run time)
    written = engine_path if engine_path is not None else os.path.relpath(engine, final.resolve())
    if not written:
        raise InputError("--engine-path must not be empty")
    if python_env is not None and not python_env.strip():
        raise InputError("--python-env must not be empty")
    staging = repo / f".{model_name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        (staging / "1").mkdir(parents=True)
        (staging / "config.pbtxt").write_text(render_config_pbtxt(model_name, written, default_effort,
                                                                  prefix_caching=prefix_caching, python_env=python_env),
                                                encoding="utf-8")
        shutil.copyfile(Path(__file__).with_name("model.py"), staging / "1" / "model.py")
        for path in (staging / "config.pbtxt", staging / "1" / "model.py"):
            fsync_path(path)
        if final.exists():
            old = repo / f".{model_name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old)
        else:
            os.replace(staging, final)
        launch = repo / f"launch_{model_name}.sh"
        tmp = repo / f".{launch.name}.tmp-{os.getpid()}"
        tmp.write_text(render_launch_script(model_name, written, world_size), encoding="utf-8")
        tmp.chmod(0o755)
        os.replace(tmp, launch)
        fsync_path(repo)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
