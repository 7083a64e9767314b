"""moe_export.runtime: model runners (`engine`), the engine core (`core`: scheduler, blocks, sessions, budgets,
structured decoding), the input processor (`processor`), the engine clients (`client`: LLM / AsyncLLM, the
`EngineClient` protocol), entry points (`entrypoints`: generate, terminal chat, eval, server, Triton, batch), sampling parameters, tokenizer and chat formats.

`from moe_export.runtime import LLM, AsyncLLM, SamplingParams` (imported on first use, so that importing
a submodule such as runtime.engine stays light)."""

_LAZY = {"LLM": "moe_export.runtime.client.llm", "AsyncLLM": "moe_export.runtime.client.async_llm",
         "SamplingParams": "moe_export.runtime.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_export.runtime' has no attribute {name!r}")
