"""Where `LLM` and `AsyncLLM` lived before `runtime.client` (kept so that earlier imports work)."""

from moe_export.runtime.client.async_llm import AsyncLLM
from moe_export.runtime.client.llm import LLM, GenerationOutput
from moe_export.runtime.client.request_core import ChatOutput, StreamDelta, Tracked

__all__ = ["LLM", "AsyncLLM", "GenerationOutput", "ChatOutput", "StreamDelta", "Tracked"]
