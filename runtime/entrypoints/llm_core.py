"""Where the request core lived before `runtime.client.request_core` (kept so that earlier imports work)."""

from moe_export.runtime.client.request_core import ChatOutput, OutputText, RequestCore, StreamDelta, Tracked

__all__ = ["ChatOutput", "OutputText", "RequestCore", "StreamDelta", "Tracked"]
