"""Offline batch throughput: `moe-export batch` vs one request at a time to `moe-export serve`.

Same engine (the embedded default, tiny-cpu: tiny-k3 on 4 in-process ranks, unless --engine), same
documents (N generated paragraphs, each fitting one chunk), same prompt (the built-in summarize template,
rendered with jinja2 for the baseline), same max_tokens and reasoning effort, greedy. Per round, run
interleaved:
  - batch:  the whole `moe-export batch ENGINE --input DOCS --task summarize` command, timed from start to
            exit (engine load included: conservative for batch);
  - serial: a client loop POSTing one /v1/chat/completions at a time to a `moe-export serve` started once
            before the rounds (start-up excluded), each request waiting for the previous answer.
Prints documents/s of each (median over rounds) and `batch_speedup` = batch / serial (goal >= 3).

    python benchmarks/batch.py [--docs 48] [--max-tokens 64] [--rounds 2] [--engine DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

MOE_EXPORT = str(Path(sys.executable).parent / "moe-export")


def build_default_engine(root: Path) -> Path:
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    recipe = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    recipe["name"] = "batch-bench"
    path = root / "batch-bench.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = root / "engine"
    build(load_recipe(path)[0], out)
    return out


def write_documents(folder: Path, n: int) -> list[str]:
    """n short, distinct paragraphs (one chunk each on the tiny engine); returns their texts in file order."""
    folder.mkdir(parents=True)
    colours = ("red", "green", "blue", "amber", "violet")
    texts = []
    for i in range(n):
        text = (f"Report {i}: the northern plant shipped {i * 13 % 97} crates of {colours[i % 5]} tiles on day "
                f"{i % 28 + 1}; returns were {i % 7} crates and the backlog fell to {(i * 31) % 50}.")
        (folder / f"doc{i:04d}.txt").write_text(text)
        texts.append(text)
    return texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_batch(engine: Path, docs: Path, out: Path, max_tokens: int, effort: str) -> float:
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    r = subprocess.run([MOE_EXPORT, "batch", str(engine), "--input", str(docs), "--output", str(out), "--task",
                        "summarize", "--max-tokens", str(max_tokens), "--reasoning-effort", effort],
                       capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"moe-export batch failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return seconds


def run_serial(client, base: str, prompts: list[str], max_tokens: int, effort: str) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        r = client.post(f"{base}/v1/chat/completions", json={
            "model": "moe-export", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "reasoning_effort": effort})
        r.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--effort", default="none", help="reasoning effort of every request (both sides)")
    parser.add_argument("--engine", type=Path, default=None, help="engine directory (default: build tiny-cpu)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds): checks the script runs, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.max_tokens, args.rounds = 4, 4, 1

    import httpx
    import jinja2
    from moe_export.runtime.entrypoints.batch.doc_tasks import TASK_TEMPLATES

    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        root = Path(tmp)
        engine = args.engine or build_default_engine(root)
        texts = write_documents(root / "docs", args.docs)
        template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(TASK_TEMPLATES["summarize"])
        prompts = [template.render(document=t, path="", chunk_index=0, num_chunks=1, question="") for t in texts]
        port = free_port()
        server = subprocess.Popen([MOE_EXPORT, "serve", str(engine), "--port", str(port), "--default-effort", args.effort,
                                   "--served-model-name", "moe-export"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
        base = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=600) as client:
                deadline = time.time() + 300
                while True:
                    if server.poll() is not None:
                        raise SystemExit(f"moe-export serve exited: {server.stderr.read().decode()[-3000:]}")
                    try:
                        if client.get(f"{base}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.time() > deadline:
                        raise SystemExit("moe-export serve did not become healthy in 300 s")
                    time.sleep(0.2)
                batch_s, serial_s = [], []
                for _ in range(args.rounds):  # interleaved rounds
                    batch_s.append(run_batch(engine, root / "docs", root / "out.jsonl", args.max_tokens, args.effort))
                    serial_s.append(run_serial(client, base, prompts, args.max_tokens, args.effort))
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    batch_dps = args.docs / statistics.median(batch_s)
    serial_dps = args.docs / statistics.median(serial_s)
    figures = {
        "batch_speedup": batch_dps / serial_dps,
        "batch_docs_per_s": batch_dps,
        "serial_serve_docs_per_s": serial_dps,
        "batch_seconds": batch_s,
        "serial_seconds": serial_s,
        "docs": args.docs,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "effort": args.effort,
        "loadavg_1min": os.getloadavg()[0],
    }
    for key, value in figures.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
