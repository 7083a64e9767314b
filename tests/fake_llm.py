"""A fake AsyncLLM for the serving layer's tests (server routes, batch): no engine, scripted failures."""

from __future__ import annotations

from moe_export.common.errors import InputError
from moe_export.runtime.chat import ToolCallDelta
from moe_export.runtime.client.request_core import ChatOutput, StreamDelta, Tracked
from moe_export.runtime.core.budget import ThinkingPlan
from moe_export.runtime.processor import RenderedChat
from moe_export.runtime.sampling import SamplingParams

VOCAB = 100


class FakeTokenizer:
    vocab_size = VOCAB
    special_tokens = {"<|im_end|>": VOCAB - 1}

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % 50 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def visible_text(self, text: str) -> str:
        return text.replace("<|im_end|>", "")


class FakeProcessor:
    """The input processor's interface: a conversation renders to 10 tokens a message (`render_error`: an
    InputError it raises); `seen` gets (messages or prompt ids, SamplingParams, effort) of each request."""

    vision = None

    def __init__(self, llm: FakeLLM) -> None:
        self.llm = llm

    def render(self, messages, *, reasoning_effort=None, **kwargs) -> RenderedChat:
        if self.llm.render_error is not None:
            raise self.llm.render_error
        tier = "none" if reasoning_effort == "none" else "low"
        rendered = RenderedChat([1] * (10 * len(messages)), [], ThinkingPlan(tier != "none", None, tier))
        self.llm.rendered.append((rendered, messages, reasoning_effort))
        return rendered

    def chat_request(self, rendered: RenderedChat, sampling, *, parallel_tool_calls=True, request_id=None) -> Tracked:
        messages, effort = next((m, e) for r, m, e in self.llm.rendered if r is rendered)
        self.llm.seen.append((messages, sampling, effort))
        return Tracked(request_id, list(rendered.prompt_ids), sampling, None, None, thinking_tier=rendered.plan.tier)

    def generate(self, prompt, sampling, request_id=None) -> Tracked:
        self.llm.seen.append((prompt, sampling, None))
        return Tracked(request_id, list(prompt), sampling, None, None)


class FakeLLM:
    """What the server uses of an AsyncLLM. `fail_next`: an exception the next request raises (at its first delta,
    or after it with `fail_late`); `render_error`: an InputError that rendering raises; `cached`: prompt tokens
    reported as read from the prefix cache."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.default_sampling = SamplingParams()
        self.healthy, self.fatal_error = True, None
        self.fail_next: BaseException | None = None
        self.fail_late = False
        self.render_error: InputError | None = None
        self.cached = 0
        self.family = "k3"
        self.tool_calls: list[dict] = []  # the calls each answer makes (K3 ids numbered as the output parser does)
        self.seen: list[tuple] = []  # (messages or prompt ids, SamplingParams, effort)
        self.rendered: list[tuple] = []  # (RenderedChat, messages, effort) of each rendering
        self.sessions: list[str | None] = []  # `Tracked.session` of each request run
        self.processor = FakeProcessor(self)

    def stats(self) -> dict:
        keys = ("waiting", "running", "blocks_used", "blocks_total", "reuse_hits", "reuse_tokens",
                "prefix_queried_tokens", "prefix_hit_tokens")
        return dict.fromkeys(keys, 0)

    def stream(self, request: Tracked, logits_processors=None):
        self.sessions.append(request.session)
        chat = request.thinking_tier is not None  # (plain prompts' alternatives only: `_stream`)
        first_call = request.parser.first_call_index if request.parser is not None else 0
        return self._stream(request.request_id, len(request.prompt_ids), request.thinking_tier or "none",
                            not chat and request.sampling.logprobs, first_call)

    def chat_stream(self, messages, sampling, **kwargs):
        rendered = self.processor.render(messages, reasoning_effort=kwargs.pop("reasoning_effort", None))
        return self.stream(self.processor.chat_request(rendered, sampling, request_id=kwargs.get("request_id")))

    def generate_stream(self, prompt, sampling, *, request_id=None, logits_processors=None):
        return self.stream(self.processor.generate(prompt, sampling, request_id))

    def abort(self, request_id: str) -> None:
        pass

    async def _stream(self, rid: str, prompt_tokens: int, tier: str, logprobs: bool = False, first_call: int = 0):
        """Two tokens, 5 and 6 ("fg"); with logprobs, each with two alternatives that decode alike (i, i + 26)."""
        lps, tops = ([-0.1, -0.2], [[(5, -0.1), (31, -2.5)], [(6, -0.2), (32, -3.0)]]) if logprobs else (None, None)
        failure, self.fail_next = self.fail_next, None
        if failure is not None and not self.fail_late:
            raise failure
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "reasoning_tokens": 0,
                 "cached_tokens": self.cached}
        calls = [{"id": f"functions.{c['function']['name']}:{i}", **c}
                 for i, c in enumerate(self.tool_calls, start=first_call)]  # the parser's `first_call_index`
        out = ChatOutput(rid, [1] * prompt_tokens, [5, 6], "fg", None, "fg", calls, "tool_calls" if calls else "stop",
                         usage, lps, top_logprobs=tops)
        yield StreamDelta(rid, [5], text="f", content="f", parts=[("content", "f")], thinking_tier=tier)
        if failure is not None:
            raise failure
        pieces = [("tool_call", ToolCallDelta(k, c["id"], c["function"]["name"], c["function"]["arguments"], "done"))
                  for k, c in enumerate(calls)]
        yield StreamDelta(rid, [6], text="g", content="g", parts=[("content", "g"), *pieces], finished=True, output=out,
                          thinking_tier=tier)

    def warm_up(self) -> int:
        return 0  # no runner, so no first-step cost and no engine step

    def shutdown(self) -> None:
        pass
