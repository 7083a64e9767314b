"""Entry points over the engine core: the Python API (`llm`: LLM, AsyncLLM), `moe-export generate`, the terminal
chat, eval, the HTTP server, the Triton model and offline batch."""
