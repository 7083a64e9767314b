"""`EngineClient`: what the front ends (server, batch, Triton, eval) hold of the engine, typed: the input
processor, request streams, abort, health and stats. `AsyncLLM` (in process, one scheduler thread) implements it;
vLLM's `EngineClient` has the same place."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from moe_export.runtime.sampling import LogitsProcessor, SamplingParams

if TYPE_CHECKING:
    from moe_export.runtime.client.request_core import StreamDelta, Tracked
    from moe_export.runtime.processor import InputProcessor
    from moe_export.runtime.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    """An engine the front ends drive. processor: turns requests into engine requests (render once, off the event
    loop); tokenizer / family: the engine's (None without one); default_sampling: the engine's one set of sampling
    defaults; healthy / fatal_error: whether the engine core serves, and what killed it (an `EngineDead`)."""

    processor: InputProcessor
    tokenizer: Tokenizer | None
    family: str | None
    default_sampling: SamplingParams

    @property
    def healthy(self) -> bool: ...

    @property
    def fatal_error(self) -> BaseException | None: ...

    def stream(self, request: Tracked, logits_processors: list[LogitsProcessor] | None = None
               ) -> AsyncIterator[StreamDelta]:
        """Run an engine request (`InputProcessor`'s): its deltas, the last one finished with its output."""

    def chat_stream(self, messages: list[dict], sampling: SamplingParams | None = None, **kwargs
                    ) -> AsyncIterator[StreamDelta]:
        """Process and run one conversation (`InputProcessor.chat`'s arguments)."""

    def generate_stream(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                        request_id: str | None = None, logits_processors: list[LogitsProcessor] | None = None
                        ) -> AsyncIterator[StreamDelta]:
        """Process and run one prompt (text or token ids)."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...
