"""Request bodies of the served APIs (pydantic): OpenAI Chat Completions, Completions and Responses,
Anthropic Messages, and vLLM's /tokenize and /detokenize. Unknown fields are ignored (clients send many);
known fields are validated, and a violation becomes a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # most choices (n) per request
MAX_SEED = (1 << 64) - 1  # a seed is an unsigned 64-bit integer
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Bias = Annotated[float, Field(ge=-100, le=100)]  # OpenAI's logit_bias range


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Penalties(Lenient):
    """vLLM's / OpenAI's extra sampling controls, passed to the runtime's sampler."""

    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, Bias] | None = None

    def sampler_fields(self) -> dict:
        """The controls the request sets, as SamplingParams keyword arguments."""
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class ChatCompletionRequest(Penalties):
    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | int | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    # the session the request belongs to (`request_options.SESSION_KEYS`): its prefix-cache state is kept longest
    prompt_cache_key: str | None = None
    user: str | None = None


class CompletionRequest(Penalties):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    logprobs: int | None = Field(None, ge=0, le=5)
    n: int = Field(1, ge=1, le=MAX_N)
    echo: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    user: str | None = None  # the session the request belongs to (this API has no prompt_cache_key)


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None
    ignore_eos: bool = False
    prompt_cache_key: str | None = None  # as ChatCompletionRequest's
    user: str | None = None


class AnthropicMetadata(Lenient):
    user_id: str | None = None  # the session the request belongs to (passed on as `user`)


class AnthropicMessagesRequest(Lenient):
    model: str | None = None
    max_tokens: int = Field(..., ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: AnthropicMetadata | None = None


class AnthropicCountTokensRequest(Lenient):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class TokenizeRequest(Lenient):
    """vLLM's body: either `prompt` or `messages` (rendered with the chat format first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    reasoning_effort: str | int | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]

