"""The engine core: `EngineCore` (schedule -> execute -> update) over the continuous-batching scheduler, cache
blocks, kept sessions, reasoning budgets and grammar-constrained decoding, over any model runner of
`runtime.engine`."""
