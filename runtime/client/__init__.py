"""The engine clients: `LLM` (blocking), `AsyncLLM` (asyncio; an `EngineClient`), the request core between them
and the engine core, and the `EngineClient` protocol the front ends hold."""
