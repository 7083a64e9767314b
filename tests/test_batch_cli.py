"""`moe-export batch` end to end on a tiny engine: OpenAI batch JSONL (bodies validated by the official
openai client's types), a document collection killed partway and resumed (every good document exactly
once, bad ones reported), templates and tasks, and the same job on a local Ray with two actors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_cli
from test_batch_inputs import write_pdf

GOOD_DOCS = 200
MOE_EXPORT = str(Path(sys.executable).parent / "moe-export")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """tiny-k3 on one rank, 16 sequence slots, 512-token steps (prefill of many documents packs together)."""
    import yaml
    from moe_export.common.recipe import load_recipe
    from moe_export.export.build import build

    root = tmp_path_factory.mktemp("batch-engine")
    data = yaml.safe_load(load_recipe("tiny-cpu.yaml")[1].read_text())
    data.update(name="batch-tiny", parallel={"tp": 1, "ep": 1})
    data["target"]["gpus_per_node"] = 1
    data["limits"].update({"max_batch": 16, "max_seq_len": 512, "max_num_tokens": 512})
    (root / "batch.yaml").write_text(yaml.safe_dump(data))
    build(load_recipe(root / "batch.yaml")[0], root / "engine")
    return root / "engine"


def read_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "a line was left half-written"
    return [json.loads(line) for line in data.splitlines()]


def write_batch_input(path: Path) -> None:
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
                  "reasoning_effort": "low"}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}},
        {"custom_id": "resp-1", "method": "POST", "url": "/v1/responses",
         "body": {"model": "m", "input": "What is 2+2?", "instructions": "Be brief.", "max_output_tokens": 6,
                  "reasoning": {"effort": "none"}}},
        {"custom_id": "stream-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}], "stream": True}},
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "dup"}]}},
        {"custom_id": "long-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y" * 2000}},
    ]
    text = "\n".join(json.dumps(line) for line in lines) + "\n{broken json\n"
    path.write_text(text)


def test_openai_batch_file_outputs_and_resume(engine, tmp_path, capsys):
    import openai.types
    import openai.types.chat

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_batch_input(src)
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(out), "--concurrency", "4")
    assert code == 1 and "failed" in err and "Traceback" not in err  # some items failed: exit 1
    records = read_lines(out)
    ok = {r["custom_id"]: r["response"] for r in records if r["error"] is None}
    failed = {(r["custom_id"], r["error"]["code"]): r["error"]["message"] for r in records if r["error"] is not None}
    assert len(records) == len(ok) + len(failed) == 7
    chat = ok["chat-1"]
    assert chat["status_code"] == 200
    openai.types.chat.ChatCompletion.model_validate(chat["body"])
    assert chat["body"]["usage"]["completion_tokens"] <= 6
    cmpl = ok["cmpl-1"]["body"]
    openai.types.Completion.model_validate(cmpl)
    assert cmpl["usage"]["completion_tokens"] == 5 and cmpl["choices"][0]["finish_reason"] == "length"
    resp = ok["resp-1"]["body"]  # the server's Responses object (strict validation: see test_serve)
    assert resp["object"] == "response" and resp["usage"]["output_tokens"] <= 6
    assert all(item["type"] in ("reasoning", "message", "function_call") for item in resp["output"])
    assert "stream" in failed[("stream-1", "bad_record")]
    assert ("chat-1", "duplicate_custom_id") in failed
    assert "line 7" in failed[("line-7", "bad_record")]
    (long_line,) = [r for r in records if r["custom_id"] == "long-1"]  # refused by the endpoint: its status kept
    assert long_line["response"]["status_code"] == 400 and long_line["response"]["body"] is None
    assert long_line["error"]["code"] == "invalid_request_error" and "2000" in long_line["error"]["message"]
    assert all(r["id"].startswith("batch_req_") for r in records)

    size = out.stat().st_size  # rerun: everything is already done, nothing is appended, but the job has failed items
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(out))
    assert code == 1 and out.stat().st_size == size and f"{len(failed)} item(s) failed ({len(failed)} in earlier runs)" in " ".join(err.split())


def test_a_refused_seed_fails_its_line_alone(engine, tmp_path, capsys):
    """A seed beyond 64 bits is that line's 400 (naming the field); the engine goes on: the later lines succeed.
    A cut line keeps its readable custom_id; an output folder is refused with a clear message."""
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "reasoning_effort": "none"}
    lines = [{"custom_id": "seed-huge", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "seed": 1 << 64}},
             {"custom_id": "seed-ok", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "seed": 7}},
             {"custom_id": "cmpl-huge", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi", "max_tokens": 2, "seed": 1 << 63 << 1}},
             {"custom_id": "cmpl-ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"custom_id": "cut-1", "body": {\n')
    code, _, _ = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(out), "--concurrency", "1")
    assert code == 1
    records = {r["custom_id"]: r for r in read_lines(out)}
    assert records["seed-ok"]["error"] is None and records["cmpl-ok"]["error"] is None
    for key in ("seed-huge", "cmpl-huge"):
        assert records[key]["response"]["status_code"] == 400 and "seed" in records[key]["error"]["message"]
    assert records["cut-1"]["error"]["code"] == "bad_record"
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(tmp_path))
    assert code == 2 and "is a folder" in err and "Errno" not in err


def test_an_engine_failure_fails_its_line_alone(engine, tmp_path, capsys, monkeypatch):
    """Fault injection: the runner raises during the first line's step; that line is an error line (status 500),
    the engine goes on and the later lines are answered, and the run exits 1 (an item failed)."""
    from moe_export.runtime.engine.ort import Engine

    real, calls = Engine.sample, []

    def fails_once(self, batch, sampling):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected runner failure")
        return real(self, batch, sampling)

    monkeypatch.setattr(Engine, "sample", fails_once)
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "reasoning_effort": "none"}
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat} for i in range(3)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, _, _ = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(out), "--concurrency", "1")
    assert code == 1
    records = {r["custom_id"]: r for r in read_lines(out)}
    assert records["chat-0"]["response"]["status_code"] == 500
    assert "injected runner failure" in records["chat-0"]["error"]["message"]
    assert records["chat-1"]["error"] is None and records["chat-2"]["error"] is None


def make_collection(root: Path) -> tuple[set[str], dict[str, str]]:
    """~200 small documents of every kind, one that needs several chunks, and bad files (name -> error code)."""
    root.mkdir()
    good = set()
    for i in range(GOOD_DOCS):
        kind = ("txt", "md", "html", "jsonl")[i % 4]
        name = f"doc{i:03d}.{kind}"
        body = f"Document {i}: the value is {i * 7} and the colour is {('red', 'green', 'blue')[i % 3]}."
        if kind == "html":
            (root / name).write_text(f"<html><body><h1>Doc {i}</h1><p>{body}</p></body></html>")
            good.add(name)
        elif kind == "jsonl":
            (root / name).write_text(json.dumps({"id": f"r{i}", "text": body}) + "\n")
            good.add(f"{name}#r{i}")
        else:
            (root / name).write_text(body)
            good.add(name)
    (root / "chunked.txt").write_text(" ".join(f"word{i}" for i in range(70)))  # 2-4 chunks of ~300 tokens
    good.add("chunked.txt")
    write_pdf(root / "damaged.pdf", "A damaged but readable report")
    pdf = (root / "damaged.pdf").read_bytes()
    (root / "damaged.pdf").write_bytes(re.sub(rb"startxref\s+\d+", b"startxref\n999", pdf))  # pypdf warns, repairs
    good.add("damaged.pdf")
    bad = {"empty.txt": "empty_document", "binary.txt": "binary_file", "latin1.md": "undecodable",
           "huge.txt": "over_long", "overlong.txt": "over_long"}
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "latin1.md").write_bytes("naïve façade".encode("latin-1"))
    (root / "huge.txt").write_text("h" * 30_000)  # over --max-file-bytes
    (root / "overlong.txt").write_text(" ".join(f"token{i}" for i in range(800)))  # over --max-chunks
    return good, bad


def batch_command(engine: Path, docs: Path, out: Path, *extra: str) -> list[str]:
    return [MOE_EXPORT, "batch", str(engine), "--input", str(docs), "--output",
            str(out), "--task", "summarize", "--max-tokens", "2", "--overlap", "8", "--max-chunks", "4",
            "--max-file-bytes", "20000", *extra]


def test_document_collection_killed_and_resumed_processes_each_document_once(engine, tmp_path, capsys):
    docs, out = tmp_path / "docs", tmp_path / "out.jsonl"
    good, bad = make_collection(docs)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(batch_command(engine, docs, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 40:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make the collection larger"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = read_lines(out)
    assert 40 <= len(first) < len(good) + len(bad)

    done = subprocess.run(batch_command(engine, docs, out), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]  # the bad files failed
    assert "batch summary" in done.stderr and "Traceback" not in done.stderr
    assert "startxref" not in done.stderr  # pypdf's warnings stay with the document's line
    records = read_lines(out)
    counts = Counter(r["custom_id"] for r in records)
    assert set(counts) == good | set(bad)
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
    by_id = {r["custom_id"]: r for r in records}
    for name in good:
        assert by_id[name]["error"] is None and by_id[name]["response"]["status_code"] == 200, by_id[name]
        assert by_id[name]["content_hash"].startswith("sha256:")
    assert any("startxref" in w for w in by_id["damaged.pdf"]["warnings"])
    for name, code in bad.items():
        assert by_id[name]["response"] is None and by_id[name]["error"]["code"] == code, by_id[name]
    assert "--max-chunks" in by_id["overlong.txt"]["error"]["message"]
    chunked = by_id["chunked.txt"]["response"]["body"]
    assert 2 <= chunked["chunks"] <= 4 and len(chunked["chunk_outputs"]) == chunked["chunks"]
    assert chunked["usage"]["requests"] > chunked["chunks"]  # the partial summaries were summarized again

    code, _, err = run_cli(capsys, *batch_command(engine, docs, out)[1:])
    assert len(read_lines(out)) == len(records)  # nothing left to do, but the output holds failed items: exit 1
    assert code == 1 and f"{len(bad)} item(s) failed ({len(bad)} in earlier runs)" in " ".join(err.split())
    (docs / "doc000.txt").write_text("Document 0 was edited.")  # changed content: done again, its old line replaced
    code, _, err = run_cli(capsys, *batch_command(engine, docs, out)[1:])
    after = read_lines(out)
    assert code == 1 and len(after) == len(records) and after[-1]["custom_id"] == "doc000.txt"
    assert after[-1]["content_hash"] != by_id["doc000.txt"]["content_hash"]
    assert re.search(r"changed since their line: redone\s*│\s*1\b", err), err


def test_prompt_template_tasks_and_bad_options(engine, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alice met Bob in Paris on 3 May.")
    (docs / "b.txt").write_text("Carol paid 12 euros.")
    (docs / "table.csv").write_text("1,2")  # not a document type: counted as ignored
    template = tmp_path / "t.j2"
    template.write_text("File {{ path }} part {{ chunk_index + 1 }}/{{ num_chunks }}: {{ document }}\nTL;DR:")
    out = tmp_path / "t.jsonl"
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(docs), "--output", str(out),
                           "--prompt-file", str(template), "--max-tokens", "3")
    assert code == 0, err
    assert {r["custom_id"] for r in read_lines(out)} == {"a.txt", "b.txt"}
    assert re.search(r"files of other types ignored\s*│\s*1\b", err), err
    out = tmp_path / "e.jsonl"
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(docs), "--output", str(out),
                           "--task", "extract", "--max-tokens", "3")
    assert code == 0, err
    assert all(isinstance(r["response"]["body"]["output"], dict) for r in read_lines(out))
    for args, message in [
        (["--task", "qa"], "--question"),
        (["--task", "poem"], "expected one of"),
        ([], "give --task or --prompt-file"),
        (["--task", "summarize", "--prompt-file", str(template)], "exactly one of"),
        (["--prompt-file", str(tmp_path / "missing.j2")], "cannot read"),
        (["--task", "summarize", "--concurrency", "0"], "--concurrency"),
    ]:
        code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(docs), "--output", str(tmp_path / "x.jsonl"), *args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    bad_template = tmp_path / "bad.j2"
    bad_template.write_text("{{ document ")
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(docs), "--output", str(tmp_path / "x.jsonl"),
                           "--prompt-file", str(bad_template))
    assert code == 2 and "prompt template" in err


def test_a_text_document_job_loads_no_grammar_or_pdf_library(engine, tmp_path):
    """Start-up and exit are inside every batch job's time: a job of text documents without tools or a response
    format never imports xgrammar (nor the transformers it pulls in, ~1 s) or pypdf, and freezes what it loaded."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alice met Bob in Paris on 3 May.")
    out = tmp_path / "out.jsonl"
    code = ("import sys\nfrom moe_export.runtime.entrypoints.cli import main\n"
            f"sys.argv = ['moe-export', 'batch', {str(engine)!r}, '--input', {str(docs)!r}, '--output', {str(out)!r}, "
            "'--task', 'summarize', '--max-tokens', '2']\n"
            "try:\n    main()\nfinally:\n    import gc\n    print('FROZEN', gc.get_freeze_count())\n"
            "    print('LOADED', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(read_lines(out)) == 1 and read_lines(out)[0]["error"] is None
    loaded = set(r.stdout.rpartition("LOADED ")[2].split())
    assert "moe_export" in loaded and "torch" in loaded  # the probe saw the job's imports
    assert not loaded & {"xgrammar", "transformers", "pypdf"}, loaded & {"xgrammar", "transformers", "pypdf"}
    # the long-lived start-up objects are frozen out of the collector (its walk over them made the exit ~0.7 s slower)
    assert int(r.stdout.partition("FROZEN ")[2].split()[0]) > 100_000


@pytest.mark.slow
def test_ray_data_two_actors_same_results_as_local(engine, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i:02d}.txt").write_text(f"Ray document {i} says {i * i}.")
    (docs / "empty.txt").write_text("")
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    common = ["--task", "summarize", "--max-tokens", "3"]
    r = subprocess.run([MOE_EXPORT, "batch", str(engine), "--input", str(docs),
                        "--output", str(local), *common], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    r = subprocess.run([MOE_EXPORT, "batch", str(engine), "--input", str(docs),
                        "--output", str(on_ray), *common, "--ray", "auto", "--ray-actors", "2"],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stderr[-3000:]
    want = {x["custom_id"]: x for x in read_lines(local)}
    got = {x["custom_id"]: x for x in read_lines(on_ray)}
    assert set(got) == set(want) and len(read_lines(on_ray)) == len(want)
    for key, record in want.items():  # greedy decoding: the replicas produce what the local run produced
        if record["error"] is None:
            assert got[key]["response"]["body"]["output"] == record["response"]["body"]["output"]
        else:
            assert got[key]["error"]["code"] == record["error"]["code"]


def test_batch_enforces_a_forced_tool_call_and_a_json_schema(runtime_engine, tmp_path, capsys):
    """Random weights: the engine core's grammar makes a forced call and a JSON schema valid in batch output (on
    the shared runtime engine: 1,024-token sequences hold the tool declaration and the call)."""
    engine = runtime_engine("tiny-k3", 2, 2, 4)
    import jsonschema

    params = {"type": "object", "properties": {"c": {"type": "string", "enum": ["P", "O"]}}, "required": ["c"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "w", "parameters": params}}]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    msgs = [{"role": "user", "content": "Weather?"}]
    lines = [{"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": msgs, "tools": tools, "max_tokens": 120, "reasoning_effort": "none", "temperature": 0,
                       "tool_choice": {"type": "function", "function": {"name": "w"}}}},
             {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": msgs, "max_tokens": 120, "reasoning_effort": "none", "temperature": 0,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(src), "--output", str(out))
    assert code == 0, err
    got = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in read_lines(out)}
    (call,) = got["tool"]["message"]["tool_calls"]
    assert call["function"]["name"] == "w" and got["tool"]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    jsonschema.validate(json.loads(got["json"]["message"]["content"]), schema)


def test_documents_with_images_answer_as_llm_chat_with_the_same_parts(engine, tmp_path, capsys):
    """--images: image files and PDF page images go with the prompt as image_url parts; each document's output
    and prompt length equal LLM.chat's on the same parts (greedy), its prompt holds one media run per image of
    the public size; the limits are per-document error lines counted in the summary; without --images image
    files are ignored (and counted) and PDFs give text only; an engine without a tower is refused (exit 2)."""
    import base64
    import io

    import jinja2
    import numpy as np
    from moe_export.runtime import LLM, SamplingParams
    from moe_export.runtime.images import MEDIA_BEGIN, MEDIA_PAD
    from PIL import Image
    from pypdf import PdfReader
    from test_batch_inputs import image_bytes, write_image_folder

    docs = tmp_path / "docs"
    docs.mkdir()
    write_image_folder(docs)
    (docs / "notes.txt").write_text("Plain notes about nothing.")
    rng = np.random.default_rng(3)
    (docs / "big.png").write_bytes(image_bytes(Image.fromarray(rng.integers(0, 256, (1000, 1000, 3), dtype=np.uint8)), "PNG"))
    pages = [Image.fromarray(rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)) for _ in range(5)]
    pages[0].save(docs / "many.pdf", save_all=True, append_images=pages[1:])  # 5 images, no text: one request
    template = tmp_path / "t.j2"
    template.write_text("Look at {{ path }}.{{ document }}")
    out = tmp_path / "out.jsonl"
    args = ["batch", str(engine), "--input", str(docs), "--output", str(out), "--prompt-file", str(template),
            "--max-tokens", "4", "--reasoning-effort", "none", "--concurrency", "1"]
    code, _, err = run_cli(capsys, *args, "--images")
    assert code == 1 and "Traceback" not in err, err[-3000:]
    records = {r["custom_id"]: r for r in read_lines(out)}
    errors = {k: r["error"]["code"] for k, r in records.items() if r["error"] is not None}
    assert errors == {"corrupt.png": "undecodable", "big.png": "images_too_large", "many.pdf": "too_many_images"}
    assert "limits.max_images_per_request" in records["many.pdf"]["error"]["message"]
    assert "limits.max_image_patches" in records["big.png"]["error"]["message"]
    flat = " ".join(err.split())
    assert "error: too_many_images │ 1" in flat and "error: images_too_large │ 1" in flat

    def parts_of(name: str) -> tuple[str, list[bytes]]:  # the document's text and images, read independently
        path = docs / name
        if path.suffix != ".pdf":
            return "", [path.read_bytes()]
        reader = PdfReader(str(path))
        return ("\n\n".join(p.extract_text() or "" for p in reader.pages),
                [im.data for p in reader.pages for im in p.images])

    llm = LLM(engine)
    try:
        proc, sent = llm.engine.vision.processor, 0
        pad, begin = llm.tokenizer.encode_special(MEDIA_PAD), llm.tokenizer.encode_special(MEDIA_BEGIN)
        for name in ("photo.jpg", "grey.jpeg", "alpha.png", "la.png", "pal.gif", "lossless.webp", "scans.pdf", "report.pdf"):
            text, blobs = parts_of(name)
            prompt = jinja2.Template(template.read_text()).render(path=name, document=text)
            fmts = [Image.open(io.BytesIO(b)).format.lower() for b in blobs]
            content = [{"type": "text", "text": prompt}] + [
                {"type": "image_url", "image_url": {"url": f"data:image/{f};base64,{base64.b64encode(b).decode()}"}}
                for f, b in zip(fmts, blobs)]
            (want,) = llm.chat([[{"role": "user", "content": content}]], SamplingParams(temperature=0, max_tokens=4),
                               reasoning_effort="none")
            body = records[name]["response"]["body"]
            assert body["output"] == (want.content or "") and body["images"] == len(blobs), name
            assert body["usage"]["prompt_tokens"] == len(want.prompt_ids), name
            assert body["usage"]["completion_tokens"] == len(want.output_ids), name
            sizes = [Image.open(io.BytesIO(b)).size for b in blobs]
            assert want.prompt_ids.count(begin) == len(blobs)
            assert want.prompt_ids.count(pad) == sum(proc.plan(w, h).num_tokens for w, h in sizes) > 0, name
            sent += len(blobs)
        assert f"images sent │ {sent}" in flat
    finally:
        llm.shutdown()

    plain = tmp_path / "plain.jsonl"
    code, _, err = run_cli(capsys, *[a if a != str(out) else str(plain) for a in args])
    records = {r["custom_id"]: r for r in read_lines(plain)}
    assert set(records) == {"notes.txt", "scans.pdf", "report.pdf", "many.pdf"}  # image files are not documents
    assert records["scans.pdf"]["error"]["code"] == "empty_document" and "images" not in records["report.pdf"]["response"]["body"]
    assert "image files ignored (no --images) │ 8" in " ".join(err.split())

    towerless = tmp_path / "towerless"  # an engine folder without vision.onnx
    towerless.mkdir()
    (towerless / "config.json").write_bytes((engine / "config.json").read_bytes())
    code, _, err = run_cli(capsys, "batch", str(towerless), *args[2:], "--images")
    assert code == 2 and "no vision tower" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(tmp_path / "x.jsonl"), "--output",
                           str(tmp_path / "y.jsonl"), "--images")
    assert code == 2 and "--images applies to a folder of documents" in err
