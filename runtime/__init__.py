"""moe_export.runtime: engine runner, scheduler, sessions, the LLM / AsyncLLM API, chat formats, server.

`from moe_export.runtime import LLM, AsyncLLM, SamplingParams` (imported on first use, so that importing
a submodule such as runtime.engine stays light)."""

_LAZY = {"LLM": "moe_export.runtime.llm", "AsyncLLM": "moe_export.runtime.llm", "SamplingParams": "moe_export.runtime.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_export.runtime' has no attribute {name!r}")
