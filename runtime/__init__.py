"""moe_export.runtime: model runners (`engine`), the engine core (`core`: scheduler, blocks, sessions, budgets,
structured decoding), the input processor (`processor`), the engine clients (`client`: LLM / AsyncLLM, the
`EngineClient` protocol), entry points (`entrypoints`: generate, terminal chat, eval, server, Triton, batch), sampling parameters, tokenizer and chat formats.

`from moe_export.runtime import LLM, AsyncLLM, SamplingParams` (imported on first use, so that importing
a submodule such as runtime.engine stays light).

OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless set): the OpenMP runtime reads it once, when torch
loads it, so it is set here, before any runner imports torch. Spinning threads of the torch runner's CPU ops
otherwise take the cores other ranks and processes need (16 tokens took 41 s on a loaded machine)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_LAZY = {"LLM": "moe_export.runtime.client.llm", "AsyncLLM": "moe_export.runtime.client.async_llm",
         "SamplingParams": "moe_export.runtime.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_export.runtime' has no attribute {name!r}")
