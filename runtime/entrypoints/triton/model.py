"""Triton Inference Server Python-backend model hosting the moe-export runtime (copied verbatim to
`REPO/NAME/1/model.py` by `moe-export triton-repo`; it imports `triton_python_backend_utils`, which only
exists inside Triton's Python-backend stub, or a test double of it).

Decoupled (streaming) model. `execute` hands every request to one asyncio loop thread that owns an
`AsyncLLM`, and returns at once; the runtime's scheduler batches all in-flight requests continuously
(Triton's dynamic batcher stays off). Each request streams responses through its response sender and
ends with TRITONSERVER_RESPONSE_COMPLETE_FINAL. A cancelled request (`sender.is_cancelled()`) is aborted in
the runtime and answered with a CANCELLED error as soon as it is noticed (the sender is polled every
CANCEL_POLL_S while the request lives: a request waiting for a slot or in a long prefill stops too); a bad
request gets an INVALID_ARG error and an internal failure an INTERNAL error: per request, never a crash of
the model.

text_output of a raw prompt is the runtime's text without special-token names (`Tokenizer.visible_text`, the
detokenization every entry point uses), a chat's is its parsed content. As in Triton's vLLM backend, a
non-streamed raw prompt's text_output starts with the prompt unless exclude_input_in_output is true, and a
streamed one with exclude_input_in_output=false is refused (INVALID_ARG).

Python environment: the stub runs this file with the Python of Triton's container (`python3` with the
moe-export package and its dependencies installed), or with a packed environment named by the
EXECUTION_ENV_PATH parameter of config.pbtxt (its numpy must be < 2 for the stub of Triton 2.51).

Tensors (the names of Triton's vLLM backend, so its OpenAI-compatible frontend and load tools work):
  inputs  text_input (BYTES [1], raw prompt), messages (BYTES [1], JSON list of chat messages; instead of
          text_input), stream (BOOL [1]), sampling_parameters (BYTES [1], JSON object: temperature, top_p,
          top_k, seed, max_tokens, stop, stop_token_ids, ignore_eos, reasoning_effort, tools, tool_choice,
          response_format), exclude_input_in_output (BOOL [1]), images (BYTES [-1], encoded images appended to the
          last user message of `messages`; K3 engines with a vision tower)
  outputs text_output (BYTES [-1]), reasoning_content, tool_calls (JSON), usage (JSON), finish_reason
Only requested outputs are sent (all of them when the client names none).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import secrets
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

ENGINE_ENV = "MOE_EXPORT_ENGINE_DIR"  # the engine folder where Triton runs; overrides config.pbtxt's engine_dir
OUTPUT_NAMES = ("text_output", "reasoning_content", "tool_calls", "usage", "finish_reason")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.05  # how often a live request's sender is asked whether the client cancelled it
# vLLM sampling parameters accepted only at their neutral value (clients and load tools send them)
NEUTRAL_OPTIONS = {"n": (1,), "best_of": (1,), "logprobs": (False, 0), "skip_special_tokens": (True,)}
# The vLLM backend's sample client (and its OpenAI frontend) send every sampling_parameters value as a string
# ("temperature": "0.1"); the backend converts them by key, and so does this model.
# The sampling options by the type of their SamplingParams field (`runtime.request_options.options_of_type`), and
# vLLM's own: these integers and booleans.
VLLM_INT_KEYS = ("n", "best_of", "logprobs")
VLLM_BOOL_KEYS = ("skip_special_tokens",)
UNSERVED = ("top_logprobs", "logit_bias")  # sampling options this model does not take (no logprobs output)


def _typed_options(options: dict) -> dict:
    """`options` with the vLLM backend's string values converted to the type of their key (BadRequest naming
    the key when one does not convert)."""
    from moe_export.runtime.request_options import options_of_type

    floats, ints = options_of_type("float"), (*options_of_type("int"), *VLLM_INT_KEYS)
    bools = (*options_of_type("bool"), *VLLM_BOOL_KEYS)
    out = dict(options)
    for key, value in options.items():
        if not isinstance(value, str):
            continue
        try:
            if key in floats:
                out[key] = float(value)
            elif key in ints:
                out[key] = int(value)
            elif key in bools:
                if value.strip().lower() not in ("true", "false"):
                    raise ValueError(value)
                out[key] = value.strip().lower() == "true"
        except ValueError:
            raise BadRequest(f"sampling_parameters: {key}={value!r} is not a valid value for {key}") from None
    return out


def _with_images(messages: list[dict], images: list[bytes]) -> list[dict]:
    """`messages` with each encoded image appended, in order, to the last user message as an image_url part (a
    base64 data URL; the runtime decodes it and refuses what it cannot read, naming the part)."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise BadRequest("input images needs a user message in messages to attach them to")
    last = dict(messages[users[-1]])
    content = last.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    parts += [{"type": "image_url", "image_url": {"url": "data:image/*;base64," + base64.b64encode(b).decode()}}
              for b in images]
    last["content"] = parts
    return [last if i == users[-1] else m for i, m in enumerate(messages)]


class BadRequest(Exception):
    """A request this model refuses: answered with INVALID_ARG."""


def _scalar(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = np.asarray(tensor.as_numpy()).reshape(-1)
    if values.size != 1:
        raise BadRequest(f"input {name} must hold exactly one element, got shape {tensor.as_numpy().shape}")
    return values[0]


def _text(request, name: str) -> str | None:
    value = _scalar(request, name)
    if value is None:
        return None
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise BadRequest(f"input {name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _json(request, name: str):
    text = _text(request, name)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"input {name} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def _string_tensor(name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class TritonPythonModel:
    """One model instance: one AsyncLLM on one engine, all requests of the instance batched together."""

    def initialize(self, args: dict) -> None:
        from moe_export.runtime.client.async_llm import AsyncLLM

        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                f"{self.model_config['name']}: set model_transaction_policy {{ decoupled: true }} (responses stream)"
            )
        params = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        engine_dir = os.environ.get(ENGINE_ENV) or os.path.join(args["model_repository"], params["engine_dir"])
        default_effort = params.get("default_effort", "max")
        prefix_caching = params.get("prefix_caching", "true").strip().lower()
        if prefix_caching not in ("true", "false"):
            raise pb_utils.TritonModelException(
                f"{self.model_config['name']}: config.pbtxt parameter prefix_caching must be \"true\" or \"false\", "
                f"got {prefix_caching!r}")
        self.ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="moe-export-runtime", daemon=True)
        self.thread.start()
        self.inflight: set = set()
        self.lock = threading.Lock()

        async def start():
            return AsyncLLM(engine_dir, default_effort=default_effort, prefix_caching=prefix_caching == "true")

        self.llm = asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def execute(self, requests):
        """Decoupled: schedule each request on the runtime loop and return None at once."""
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
            with self.lock:
                self.inflight.add(future)
            future.add_done_callback(self._forget)
        return None

    def _forget(self, future) -> None:
        with self.lock:
            self.inflight.discard(future)

    def _parse(self, request) -> dict:
        from moe_export.runtime.request_options import parse_request_options

        prompt = _text(request, "text_input")
        messages = _json(request, "messages")
        if (prompt is None) == (messages is None):
            raise BadRequest("give exactly one of the inputs text_input (a prompt) and messages (JSON chat messages)")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise BadRequest("input messages must be a JSON list of message objects")
        images = pb_utils.get_input_tensor_by_name(request, "images")
        if images is not None:
            if messages is None:
                raise BadRequest("input images goes with the messages input (a chat), not text_input")
            messages = _with_images(messages, [bytes(b) for b in np.asarray(images.as_numpy()).reshape(-1)])
        options = _json(request, "sampling_parameters") or {}
        if isinstance(options, dict):
            options = _typed_options(options)
            if options.get("seed") is None:  # unseeded requests differ (vLLM draws a random seed too)
                options["seed"] = secrets.randbits(63)
            for key, neutral in NEUTRAL_OPTIONS.items():
                if options.get(key) is not None and options[key] not in neutral:
                    raise BadRequest(f"sampling_parameters: {key}={options[key]!r} is not supported (only {neutral[0]!r})")
        opts = parse_request_options(options, self.llm.default_sampling, where="sampling_parameters",
                                     ignored=tuple(NEUTRAL_OPTIONS), excluded=UNSERVED)
        if prompt is not None and opts.chat_kwargs:
            raise BadRequest(f"{', '.join(sorted(opts.chat_kwargs))} apply to chat requests (the messages input), not text_input")
        stream = _scalar(request, "stream")
        exclude = _scalar(request, "exclude_input_in_output")
        if prompt is not None and stream is not None and bool(stream) and exclude is not None and not bool(exclude):
            raise BadRequest("exclude_input_in_output=false is not allowed when streaming (as in Triton's vLLM backend): "
                             "set it to true or leave it out")
        wanted = set(request.requested_output_names()) or set(OUTPUT_NAMES)
        return {
            "prompt": prompt, "messages": messages, "opts": opts, "stream": bool(stream) if stream is not None else False,
            "exclude_input": bool(exclude) if exclude is not None else False, "wanted": wanted,
        }

    def _response(self, wanted: set, text: str, reasoning: str, output=None):
        tensors = []
        if "text_output" in wanted:
            tensors.append(_string_tensor("text_output", text))
        if "reasoning_content" in wanted:
            tensors.append(_string_tensor("reasoning_content", reasoning))
        if output is not None:
            extra = {"tool_calls": json.dumps(output.tool_calls), "usage": json.dumps(output.usage),
                     "finish_reason": output.finish_reason or ""}
            tensors.extend(_string_tensor(name, value) for name, value in extra.items() if name in wanted)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def _error(message: str, code):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    async def _serve(self, request) -> None:
        from moe_export.common.errors import EngineDead, InputError

        sender = request.get_response_sender()
        request_id = f"triton-{next(self.ids)}-{request.request_id() or 'anon'}"
        try:
            job = self._parse(request)
        except (BadRequest, InputError) as exc:
            sender.send(self._error(str(exc), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
            return
        opts = job["opts"]
        chat = job["messages"] is not None
        deltas = None
        watcher = asyncio.ensure_future(self._watch_cancellation(sender, request_id))
        try:
            if chat:  # rendered once, in the client's request worker (off the runtime loop)
                prepared = await self.llm.off_loop(self.llm.processor.chat, job["messages"], opts.sampling,
                                                   request_id=request_id, **opts.chat_kwargs)
            else:
                prepared = await self.llm.off_loop(self.llm.processor.generate, job["prompt"], opts.sampling, request_id)
            prepared.session = opts.session  # sampling_parameters' `prompt_cache_key` / `user`
            deltas = self.llm.stream(prepared)
            async for delta in deltas:
                if sender.is_cancelled():
                    self.llm.abort(request_id)
                    sender.send(self._error("request cancelled by the client", pb_utils.TritonError.CANCELLED), flags=FINAL)
                    return
                if job["stream"]:
                    text = delta.content if chat else self.llm.tokenizer.visible_text(delta.text)
                    sender.send(self._response(job["wanted"], text, delta.reasoning, delta.output),
                                flags=FINAL if delta.finished else 0)
                elif delta.finished:
                    out = delta.output
                    full = (out.content or "") if chat else self.llm.tokenizer.visible_text(out.text)
                    if not chat and not job["exclude_input"]:
                        full = job["prompt"] + full
                    sender.send(self._response(job["wanted"], full, out.reasoning_content or "", out), flags=FINAL)
                if delta.finished:
                    return
            sender.send(self._error("the runtime ended the request without a final output", pb_utils.TritonError.INTERNAL),
                        flags=FINAL)
        except InputError as exc:
            sender.send(self._error(str(exc), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
        except EngineDead as exc:  # the engine core stopped: no request can run until the model is reloaded
            sender.send(self._error(f"the engine core stopped ({exc})", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        except Exception as exc:  # any failure is this request's error (RequestFailed among them), never the model's
            self.llm.abort(request_id)
            sender.send(self._error(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL), flags=FINAL)
        finally:
            watcher.cancel()
            if deltas is not None:
                await deltas.aclose()

    async def _watch_cancellation(self, sender, request_id: str) -> None:
        """Abort the request once its client cancels it: its stream then ends at once, and `_serve` answers
        CANCELLED, even while no output comes (waiting for a slot, a long prefill)."""
        while not sender.is_cancelled():
            await asyncio.sleep(CANCEL_POLL_S)
        self.llm.abort(request_id)

    def finalize(self) -> None:
        """Finish in-flight requests (their senders stay valid until they end), then stop the runtime."""
        with self.lock:
            pending = list(self.inflight)
        for future in pending:
            future.result()
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
