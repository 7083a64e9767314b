"""The engine core: continuous-batching scheduler, cache blocks, kept sessions, reasoning budgets and
grammar-constrained decoding, over any model runner of `runtime.engine`."""
