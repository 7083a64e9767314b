"""`moe-export triton-repo`: config.pbtxt validated by Triton's own ModelConfig protobuf (tritonclient),
and the generated model.py run end to end on a tiny engine inside a test double of
`triton_python_backend_utils` (tests/triton_backend_double: which documented behaviours it reproduces is
listed in its docstring). No tritonserver exists here: what runs is our model.py against that double."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from conftest import run_cli

DOUBLE_DIR = Path(__file__).parent / "triton_backend_double"


def parse_config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def engine(runtime_engine):
    return runtime_engine("tiny-k3", 1, 1, 1)


@pytest.fixture(scope="module")
def repo(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    from moe_export.runtime.entrypoints.triton.repo import write_triton_repo

    write_triton_repo(engine, out, "kimi", default_effort="low")
    return out


def test_config_pbtxt_is_a_valid_decoupled_python_model(repo, engine):
    cfg = parse_config((repo / "kimi" / "config.pbtxt").read_text())
    assert cfg.name == "kimi" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    assert not cfg.HasField("dynamic_batching")
    inputs = {i.name: i for i in cfg.input}
    outputs = {o.name: o for o in cfg.output}
    string, boolean = model_config_pb2.DataType.Value("TYPE_STRING"), model_config_pb2.DataType.Value("TYPE_BOOL")
    # the vLLM backend's names and types, which Triton's OpenAI frontend sends
    assert inputs["text_input"].data_type == string and list(inputs["text_input"].dims) == [1]
    assert inputs["stream"].data_type == boolean and inputs["exclude_input_in_output"].data_type == boolean
    assert inputs["sampling_parameters"].data_type == string and inputs["messages"].data_type == string
    assert all(i.optional for i in cfg.input)
    assert outputs["text_output"].data_type == string and list(outputs["text_output"].dims) == [-1]
    assert {"reasoning_content", "tool_calls", "usage"} <= set(outputs)
    # movable: the engine relative to the model folder, the instance placed by the model (no KIND_CPU)
    written = cfg.parameters["engine_dir"].string_value
    assert not Path(written).is_absolute() and (repo / "kimi" / written).resolve() == Path(engine).resolve()
    (group,) = cfg.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.Kind.Value("KIND_MODEL")
    assert cfg.parameters["default_effort"].string_value == "low"
    assert cfg.parameters["prefix_caching"].string_value == "true"
    assert (repo / "kimi" / "1" / "model.py").read_text().startswith('"""Triton Inference Server Python-backend')
    script = (repo / "launch_kimi.sh").read_text()
    assert "mpiexec -n 1 tritonserver" in script and "-m moe_export.runtime.entrypoints.triton.follower" in script
    assert "WORLD=1\n" in script and (repo / "launch_kimi.sh").stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(repo / "launch_kimi.sh")]).returncode == 0


def test_malformed_config_fails_to_parse(repo):
    text = (repo / "kimi" / "config.pbtxt").read_text()
    with pytest.raises(text_format.ParseError):
        parse_config(text.replace("decoupled: true", "decoupled: maybe"))
    with pytest.raises(text_format.ParseError):
        parse_config(text + "\ninput { name: \"x\" data_type: TYPE_TEXT dims: [ 1 ] }\n")
    with pytest.raises(text_format.ParseError):
        parse_config(text.replace("model_transaction_policy", "transaction_policy"))


def test_cli_writes_repo_and_rejects_bad_input(engine, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--model-name", "m1")
    assert code == 0 and (tmp_path / "r" / "m1" / "1" / "model.py").is_file()
    parse_config((tmp_path / "r" / "m1" / "config.pbtxt").read_text())
    code, _, _ = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "c"), "--model-name", "m2",
                         "--engine-path", "/models/engine")  # the engine's path inside a container
    assert code == 0
    assert parse_config((tmp_path / "c" / "m2" / "config.pbtxt").read_text()).parameters["engine_dir"].string_value == "/models/engine"
    assert "ENGINE=/models/engine" in (tmp_path / "c" / "launch_m2.sh").read_text()
    code, _, err = run_cli(capsys, "triton-repo", str(tmp_path), "--out", str(tmp_path / "r2"))
    assert code == 2 and "not an engine directory" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--model-name", "bad/name")
    assert code == 2 and "model name" in err
    code, _, err = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--default-effort", "huge")
    assert code == 2 and "default effort" in err


HOSTILE_ENGINE_PATHS = [
    "/models/$HOME/engine", "/models/`touch PWNED`/e", "/models/$(touch PWNED)", "/m/it's \"quoted\"",
    "/m/two  spaces and\ttab", "/m/été/模型/😀", "/m/new\nline; touch PWNED", "/m/back\\slash/*", "-dash/$((1+1))/!x",
]


def test_launch_script_passes_hostile_engine_paths_through_bash_unchanged(engine, tmp_path):
    """launch_NAME.sh, run by bash with tritonserver replaced by a stub that records its argv and environment:
    each hostile --engine-path reaches the server (MOE_EXPORT_ENGINE_DIR) and the --mpi followers byte for byte,
    and nothing in it is expanded or executed; config.pbtxt carries it exactly too."""
    from moe_export.runtime.entrypoints.triton.repo import write_triton_repo

    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("tritonserver", "mpiexec"):
        (stubs / name).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {name} "$MOE_EXPORT_ENGINE_DIR" "$@" > "$RECORD"\n')
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MOE_EXPORT_ENGINE_DIR"}
    env.update(PATH=f"{stubs}:{env['PATH']}", RECORD=str(tmp_path / "argv"), LC_ALL="C")
    for k, hostile in enumerate(HOSTILE_ENGINE_PATHS):
        repo = tmp_path / f"r{k}"
        write_triton_repo(engine, repo, "m", engine_path=hostile)
        assert parse_config((repo / "m" / "config.pbtxt").read_text(encoding="utf-8")).parameters["engine_dir"].string_value == hostile
        for args in ([], ["--mpi", "--log-verbose=1"]):
            r = subprocess.run(["bash", str(repo / "launch_m.sh"), *args], cwd=tmp_path, env=env, capture_output=True, timeout=60)
            assert r.returncode == 0, r.stderr.decode(errors="replace")
            argv = (tmp_path / "argv").read_bytes().split(b"\0")[:-1]
            assert argv[1] == os.fsencode(hostile if hostile.startswith("/") else f"{repo}/m/{hostile}"), (hostile, argv)
            assert argv[2:4] == [b"--model-repository", os.fsencode(repo)]
        assert not (tmp_path / "PWNED").exists() and not (repo / "PWNED").exists()


def test_python_environment_is_documented_and_can_be_named(engine, tmp_path, capsys):
    """config.pbtxt says which Python runs model.py; --python-env writes Triton's EXECUTION_ENV_PATH parameter."""
    code, _, _ = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--model-name", "sys")
    text = (tmp_path / "r" / "sys" / "config.pbtxt").read_text()
    assert "system python3" in text and "numpy < 2" in text and "EXECUTION_ENV_PATH" not in parse_config(text).parameters
    code, _, _ = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--model-name", "env",
                         "--python-env", "$$TRITON_MODEL_DIRECTORY/py-env")
    assert code == 0
    cfg = parse_config((tmp_path / "r" / "env" / "config.pbtxt").read_text())
    assert cfg.parameters["EXECUTION_ENV_PATH"].string_value == "$$TRITON_MODEL_DIRECTORY/py-env"
    code, _, err = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--python-env", " ")
    assert code == 2 and "--python-env must not be empty" in err


# ---- model.py end to end in the backend double ----


@pytest.fixture(scope="module")
def pb_utils():
    sys.path.insert(0, str(DOUBLE_DIR))
    try:
        import triton_python_backend_utils

        yield triton_python_backend_utils
    finally:
        sys.path.remove(str(DOUBLE_DIR))


def load_model(folder: Path, config_text: str | None = None):
    """The generated model.py in `folder` loaded as Triton's stub does: initialize(args) with model_config as JSON
    (config_text: instead of the folder's config.pbtxt)."""
    spec = importlib.util.spec_from_file_location("triton_generated_model", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = parse_config(config_text or (folder / "config.pbtxt").read_text())
    args = {"model_config": json_format.MessageToJson(cfg, preserving_proto_field_name=True),
            "model_repository": str(folder), "model_version": "1", "model_name": cfg.name,
            "model_instance_kind": "CPU", "model_instance_name": f"{cfg.name}_0_0", "model_instance_device_id": "0"}
    instance = module.TritonPythonModel()
    instance.initialize(args)
    instance.declared_outputs = {o.name for o in cfg.output}
    return instance


@pytest.fixture(scope="module")
def model(repo, pb_utils):
    instance = load_model(repo / "kimi")
    yield instance
    instance.finalize()


def test_prefix_caching_switch(engine, pb_utils, tmp_path, capsys):
    """`triton-repo --no-prefix-caching` writes prefix_caching "false", and the model's runtime then shares no
    cached prefix; the default is "true"; another value stops the model from loading, naming the parameter."""
    code, _, _ = run_cli(capsys, "triton-repo", str(engine), "--out", str(tmp_path / "r"), "--model-name", "off",
                         "--no-prefix-caching")
    assert code == 0
    text = (tmp_path / "r" / "off" / "config.pbtxt").read_text()
    assert parse_config(text).parameters["prefix_caching"].string_value == "false"
    off = load_model(tmp_path / "r" / "off")
    try:
        assert off.llm.llm.prefix_caching is False
    finally:
        off.finalize()
    with pytest.raises(pb_utils.TritonModelException, match="prefix_caching must be"):
        load_model(tmp_path / "r" / "off", text.replace('string_value: "false"', 'string_value: "sometimes"'))


def make_request(pb_utils, model, request_id: str, *, prompt=None, messages=None, stream=True, params=None,
                 outputs=None, raw_inputs=None):
    tensors = []
    if prompt is not None:
        tensors.append(pb_utils.Tensor("text_input", np.array([prompt.encode()], dtype=np.object_)))
    if messages is not None:
        tensors.append(pb_utils.Tensor("messages", np.array([json.dumps(messages).encode()], dtype=np.object_)))
    tensors.append(pb_utils.Tensor("stream", np.array([stream], dtype=bool)))
    if params is not None:
        tensors.append(pb_utils.Tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_)))
    tensors.extend(raw_inputs or [])
    return pb_utils.InferenceRequest(tensors, request_id, outputs, declared_outputs=model.declared_outputs)


def text_of(response, name="text_output") -> str:
    tensors = {t.name(): t for t in response.output_tensors()}
    return tensors[name].as_numpy()[0].decode() if name in tensors else None


def test_three_concurrent_streams_a_cancelled_one_and_a_bad_one(model, pb_utils, engine):
    from moe_export.runtime.entrypoints.llm import LLM

    params = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
    max_seq_len = json.loads((Path(engine) / "config.json").read_text())["limits"]["max_seq_len"]
    prompts = ["hello there", "the quick brown fox", "numbers: 1 2 3"]
    streams = [make_request(pb_utils, model, f"s{i}", prompt=p, params=params) for i, p in enumerate(prompts)]
    chat = make_request(pb_utils, model, "chat", messages=[{"role": "user", "content": "hi"}],
                        params={"max_tokens": 8, "reasoning_effort": "low"}, stream=False)
    cancelled = make_request(pb_utils, model, "cancel-me", prompt="a long story", params={"max_tokens": 100, "ignore_eos": True})
    bad = [make_request(pb_utils, model, "bad-json", prompt="x", raw_inputs=[]),
           make_request(pb_utils, model, "bad-param", prompt="x", params={"max_tokens": 4, "beam_width": 3}),
           make_request(pb_utils, model, "both", prompt="x", messages=[{"role": "user", "content": "y"}]),
           make_request(pb_utils, model, "too-long", prompt="z" * (max_seq_len + 8), params={"max_tokens": 4}),
           make_request(pb_utils, model, "n-two", prompt="x", params={"n": 2, "presence_penalty": 0.0})]
    bad[0]._inputs["sampling_parameters"] = pb_utils.Tensor("sampling_parameters", np.array([b"{not json"], dtype=np.object_))

    assert model.execute([*streams, chat, cancelled]) is None  # decoupled: execute returns at once
    assert model.execute(bad) is None
    deadline = time.time() + 30
    while not cancelled.sender.responses and time.time() < deadline:
        time.sleep(0.01)
    cancelled.cancel()
    for request in [*streams, chat, cancelled, *bad]:
        assert request.sender.done.wait(120), request.request_id()
        assert request.sender.flags[-1] == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL not in request.sender.flags[:-1]

    # streams: one response per token, their concatenation equals the offline runtime's text for the prompt (without
    # special-token names)
    reference = LLM(engine)
    try:
        from moe_export.runtime.sampling import SamplingParams

        expected = reference.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        reference.shutdown()
    for request, ref in zip(streams, expected):
        responses = request.sender.responses
        assert not any(r.has_error() for r in responses)
        assert len(responses) >= 2
        assert "".join(text_of(r) for r in responses) == model.llm.tokenizer.visible_text(ref.text)
        usage = json.loads(text_of(responses[-1], "usage"))
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == len(ref.prompt_ids)
        assert text_of(responses[-1], "finish_reason") == "length"

    (final,) = chat.sender.responses  # not streamed: one response carrying the whole message
    assert not final.has_error()
    assert json.loads(text_of(final, "usage"))["completion_tokens"] <= 8
    assert isinstance(json.loads(text_of(final, "tool_calls")), list)

    last = cancelled.sender.responses[-1]
    assert last.has_error() and last.error().code() == pb_utils.TritonError.CANCELLED
    generated = sum(1 for r in cancelled.sender.responses if not r.has_error())
    assert generated < 100  # stopped early, and its sequence left the scheduler
    assert model.llm.stats()["running"] == 0

    codes = {r.request_id(): r.sender.responses[-1].error() for r in bad}
    assert all(e is not None and e.code() == pb_utils.TritonError.INVALID_ARG for e in codes.values()), codes
    assert "not valid JSON" in codes["bad-json"].message()
    assert "beam_width" in codes["bad-param"].message()
    assert "exactly one of" in codes["both"].message()
    assert "n=2" in codes["n-two"].message()
    assert "max_seq_len" in codes["too-long"].message()

    # the model still serves after all that, and only the requested outputs come back
    again = make_request(pb_utils, model, "after", prompt="hello there", params=params, stream=False,
                         outputs=["text_output"])
    model.execute([again])
    assert again.sender.done.wait(60)
    (resp,) = again.sender.responses
    assert [t.name() for t in resp.output_tensors()] == ["text_output"]
    assert text_of(resp) == "hello there" + model.llm.tokenizer.visible_text(expected[0].text)  # exclude_input_in_output defaults to false


def test_vllm_backend_client_string_parameters(model, pb_utils):
    """The vLLM backend's sample client sends every sampling parameter as a string (its model converts them by
    key): accepted here the same way (penalties included); bad and unconvertible values are refused by name."""
    typed = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    strings = {"temperature": "0", "top_p": "0.95", "max_tokens": "6", "ignore_eos": "true", "repetition_penalty": "1.0"}
    reqs = [make_request(pb_utils, model, f"v{i}", prompt="hello there", params=p, stream=False)
            for i, p in enumerate((typed, {**typed, "top_p": 0.95}, strings))]
    bad = [make_request(pb_utils, model, "rp", prompt="x", params={"repetition_penalty": "-1"}),
           make_request(pb_utils, model, "warm", prompt="x", params={"temperature": "warm"})]
    model.execute([*reqs, *bad])
    for r in [*reqs, *bad]:
        assert r.sender.done.wait(60)
    texts = [text_of(r.sender.responses[-1]) for r in reqs]
    assert not any(r.sender.responses[-1].has_error() for r in reqs) and texts[0] == texts[1] == texts[2]
    penalised = make_request(pb_utils, model, "pen", prompt="hello there", stream=False,
                             params={**strings, "max_tokens": "12", "frequency_penalty": "2.0", "repetition_penalty": "1.5"})
    same = make_request(pb_utils, model, "same", prompt="hello there", stream=False, params={**strings, "max_tokens": "12"})
    model.execute([penalised, same])
    assert penalised.sender.done.wait(60) and same.sender.done.wait(60)
    assert text_of(penalised.sender.responses[-1]) != text_of(same.sender.responses[-1])  # the penalties reached the sampler
    errors = {r.request_id(): r.sender.responses[-1].error() for r in bad}
    assert all(e is not None and e.code() == pb_utils.TritonError.INVALID_ARG for e in errors.values())
    assert "repetition_penalty" in errors["rp"].message() and "temperature" in errors["warm"].message()


def test_model_is_thread_safe_for_execute_from_several_threads(model, pb_utils):
    requests = [make_request(pb_utils, model, f"t{i}", prompt=f"thread {i}", params={"max_tokens": 3}) for i in range(4)]
    threads = [threading.Thread(target=model.execute, args=([r],)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in requests:
        assert r.sender.done.wait(60)
        assert not any(resp.has_error() for resp in r.sender.responses)


def test_follower_rank_entry_refuses_to_run_outside_mpiexec(engine):
    """`python -m moe_export.runtime.entrypoints.triton.follower ENGINE` (ranks 1..W-1 of launch_NAME.sh --mpi) needs mpiexec."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    r = subprocess.run([sys.executable, "-m", "moe_export.runtime.entrypoints.triton.follower", str(engine)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "under mpiexec" in r.stderr


def test_model_enforces_a_forced_tool_call_and_a_json_schema(model, pb_utils):
    """Random weights: the engine core's grammar makes a forced call and a JSON schema valid through Triton."""
    import jsonschema

    params = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    msgs = [{"role": "user", "content": "Weather?"}]
    common = {"max_tokens": 120, "reasoning_effort": "none", "temperature": 0}
    tool = make_request(pb_utils, model, "tool", messages=msgs, stream=False,
                        params={**common, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    fmt = make_request(pb_utils, model, "json", messages=msgs, stream=False,
                       params={**common, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert model.execute([tool, fmt]) is None
    for request in (tool, fmt):
        assert request.sender.done.wait(120), request.request_id()
    (final,) = tool.sender.responses
    assert not final.has_error()
    (call,) = json.loads(text_of(final, "tool_calls"))
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    (final,) = fmt.sender.responses
    assert not final.has_error()
    jsonschema.validate(json.loads(text_of(final)), schema)  # a chat's text_output is its content


def test_images_input(model, pb_utils, engine):
    """`images` (encoded bytes) join the last user message of `messages`; a bad image or images without
    messages are INVALID_ARG."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    params = {"max_tokens": 3, "temperature": 0, "reasoning_effort": "none"}
    msgs = [{"role": "user", "content": "What is it?"}]

    def images(*blobs):
        return [pb_utils.Tensor("images", np.array(list(blobs), dtype=np.object_))]

    reqs = [make_request(pb_utils, model, "img", messages=msgs, params=params, stream=False, raw_inputs=images(png)),
            make_request(pb_utils, model, "txt", messages=msgs, params=params, stream=False),
            make_request(pb_utils, model, "bad", messages=msgs, params=params, stream=False, raw_inputs=images(b"junk")),
            make_request(pb_utils, model, "no-chat", prompt="x", params=params, stream=False, raw_inputs=images(png))]
    model.execute(reqs)
    for r in reqs:
        assert r.sender.done.wait(120)
    usage = {r.request_id(): json.loads(text_of(r.sender.responses[-1], "usage")) for r in reqs[:2]}
    assert usage["img"]["prompt_tokens"] >= usage["txt"]["prompt_tokens"] + 12  # 90x60: 12 image rows + markers
    errors = {r.request_id(): r.sender.responses[-1].error() for r in reqs[2:]}
    assert all(e is not None and e.code() == pb_utils.TritonError.INVALID_ARG for e in errors.values())
    assert "content[1]: not a readable image" in errors["bad"].message()
    assert "goes with the messages input" in errors["no-chat"].message()


def test_text_output_is_the_servers_text_for_the_same_ids(model, pb_utils, engine):
    """A raw prompt's text_output drops special-token names (sampled reserved / padding / media tokens) exactly as
    the server's /v1/completions text does for the same greedy ids (random weights sample many specials)."""
    import httpx

    from serve_support import InProcessServer

    server = InProcessServer(engine, served_model_names=("m",))
    try:
        prompts, compared = ["hello there", "the quick brown fox", "numbers: 1 2 3", "a long story"], 0
        for prompt in prompts:
            body = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 0}).json()
            tokens = body["choices"][0]["logprobs"]["tokens"]
            names = [t for t in tokens if t in model.llm.tokenizer.special_tokens]
            request = make_request(pb_utils, model, f"detok-{prompt}", prompt=prompt, stream=False,
                                   params={"max_tokens": 40, "temperature": 0, "ignore_eos": True},
                                   raw_inputs=[pb_utils.Tensor("exclude_input_in_output", np.array([True]))])
            streamed = make_request(pb_utils, model, f"detok-stream-{prompt}", prompt=prompt,
                                    params={"max_tokens": 40, "temperature": 0, "ignore_eos": True})
            model.execute([request, streamed])
            assert request.sender.done.wait(60) and streamed.sender.done.wait(60)
            text = text_of(request.sender.responses[-1])
            assert text == body["choices"][0]["text"] == "".join(text_of(r) for r in streamed.sender.responses)
            assert not any(n in text for n in names)
            compared += bool(names)
        assert compared >= 1, "no prompt sampled a special token: the comparison would prove nothing"
    finally:
        server.stop()
        server.llm.shutdown()


def test_streaming_with_the_input_in_the_output_is_refused(model, pb_utils):
    """As Triton's vLLM backend: a streamed raw prompt with exclude_input_in_output=false is INVALID_ARG; true, or
    the flag left out, streams; a chat ignores the flag."""
    def flag(value):
        return [pb_utils.Tensor("exclude_input_in_output", np.array([value]))]

    params = {"max_tokens": 3, "temperature": 0}
    refused = make_request(pb_utils, model, "echo-stream", prompt="hello", params=params, raw_inputs=flag(False))
    allowed = [make_request(pb_utils, model, "excl-stream", prompt="hello", params=params, raw_inputs=flag(True)),
               make_request(pb_utils, model, "plain-stream", prompt="hello", params=params),
               make_request(pb_utils, model, "echo-whole", prompt="hello", params=params, stream=False, raw_inputs=flag(False)),
               make_request(pb_utils, model, "chat-stream", messages=[{"role": "user", "content": "hi"}],
                            params={**params, "reasoning_effort": "none"}, raw_inputs=flag(False))]
    model.execute([refused, *allowed])
    for r in [refused, *allowed]:
        assert r.sender.done.wait(60)
    error = refused.sender.responses[-1].error()
    assert error is not None and error.code() == pb_utils.TritonError.INVALID_ARG
    assert "exclude_input_in_output=false is not allowed when streaming" in error.message()
    assert not any(resp.has_error() for r in allowed for resp in r.sender.responses)
    assert text_of(allowed[2].sender.responses[-1]).startswith("hello")


def test_cancellation_is_noticed_while_a_request_waits_for_a_slot(model, pb_utils, engine):
    """A request queued behind a full batch produces no output; cancelling it ends it at once with CANCELLED
    (not when it would first have produced a token), and the runtime forgets it."""
    slots = json.loads((Path(engine) / "config.json").read_text())["limits"]["max_batch"]
    long = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
    busy = [make_request(pb_utils, model, f"busy{i}", prompt=f"story {i}", params=long) for i in range(slots)]
    queued = make_request(pb_utils, model, "queued", prompt="waiting", params=long)
    model.execute([*busy, queued])
    deadline = time.time() + 60
    while not all(r.sender.responses for r in busy) and time.time() < deadline:
        time.sleep(0.01)
    assert not queued.sender.responses  # every slot is taken: it waits
    queued.cancel()
    assert queued.sender.done.wait(5)
    cancelled_at = time.time()
    (answer,) = queued.sender.responses
    assert answer.has_error() and answer.error().code() == pb_utils.TritonError.CANCELLED
    assert not any(r.sender.done.is_set() for r in busy), "the batch finished first: the check proved nothing"
    for r in busy:
        r.cancel()
    for r in busy:
        assert r.sender.done.wait(10)
    assert time.time() - cancelled_at < 10
    while model.llm.stats()["running"] and time.time() - cancelled_at < 10:  # aborts reach the scheduler's thread
        time.sleep(0.01)
    assert model.llm.stats()["running"] == 0


def test_a_request_that_fails_in_the_engine_fails_alone(model, pb_utils):
    """Fault injection: the runner raises during one request's step; that request ends with INTERNAL, the model
    stays healthy and the next request is answered."""
    runner = model.llm.llm.engine
    real, calls = runner.sample, []

    def fails_once(batch, sampling):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected runner failure")
        return real(batch, sampling)

    runner.sample = fails_once
    try:
        params = {"max_tokens": 4, "temperature": 0}
        failed = make_request(pb_utils, model, "fault-1", prompt="hello", params=params, stream=False)
        model.execute([failed])
        assert failed.sender.done.wait(60)
        error = failed.sender.responses[-1].error()
        assert error is not None and error.code() == pb_utils.TritonError.INTERNAL, error
        assert "injected runner failure" in error.message()
        answered = make_request(pb_utils, model, "fault-2", prompt="hello", params=params, stream=False)
        model.execute([answered])
        assert answered.sender.done.wait(60)
        assert not any(r.has_error() for r in answered.sender.responses)
        assert text_of(answered.sender.responses[-1]) and model.llm.healthy
    finally:
        del runner.sample


def test_each_request_is_rendered_once_off_the_runtime_loop(model, pb_utils, monkeypatch):
    """A chat request renders once (`InputProcessor.render`, counted at `render_prompt`), in the client's request
    worker, not on the runtime's event loop thread."""
    import threading

    import moe_export.runtime.processor as processor

    threads: list[str] = []
    real = processor.render_prompt

    def counting(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(processor, "render_prompt", counting)
    request = make_request(pb_utils, model, "once", messages=[{"role": "user", "content": "hi"}],
                           params={"max_tokens": 2}, stream=False)
    model.execute([request])
    assert request.sender.done.wait(120)
    assert text_of(request.sender.responses[-1]) is not None
    assert len(threads) == 1 and threads[0] != model.thread.name, threads
