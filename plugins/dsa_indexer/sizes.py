"""DSAIndexer scratch arithmetic (bytes), pure Python: the planner and the graph exporter size the plugin's
workspace from here without importing Triton."""

DEFAULT_SCRATCH_BUDGET = 256 * 2**20  # bytes of score and merge scratch per call
MAX_CHUNK_POSITIONS = 65536


def chunk_shape(num_tokens: int, length: int, topk: int, budget_bytes: int, block_n: int = 64) -> tuple[int, int]:
    """(tokens, positions) per chunk: positions a multiple of block_n, at most `length` rounded up and at most
    MAX_CHUNK_POSITIONS; tokens as many as keep the chunk's buffers (`workspace_bytes`) within the budget."""
    lc = min(-(-max(length, 1) // block_n) * block_n, MAX_CHUNK_POSITIONS)
    return max(1, min(num_tokens, budget_bytes // per_token_bytes(lc, topk))), lc


def per_token_bytes(lc: int, topk: int) -> int:
    """Chunk bytes per token: scores fp32 [lc]; running best fp32 + int64 [topk]; merge input and sorted output,
    fp32 + int64 [topk + lc]."""
    return 4 * lc + 12 * topk + 24 * (topk + lc)


def workspace_bytes(num_tokens: int, length: int, topk: int, budget_bytes: int = DEFAULT_SCRATCH_BUDGET) -> int:
    """Bytes of the caller-provided workspace (`dsa_indexer_triton(workspace=...)`) for steps of up to
    `num_tokens` tokens over `length` candidate positions (TensorRT engines declare it as the plugin's second
    output, so it lives in the engine's device memory), plus the column ids of one chunk."""
    tc, lc = chunk_shape(num_tokens, length, topk, budget_bytes)
    return tc * per_token_bytes(lc, topk) + 8 * lc + 7 * 256  # 7 buffers, each 256-byte aligned


def scratch_bytes(num_tokens: int, length: int, topk: int, budget_bytes: int = DEFAULT_SCRATCH_BUDGET) -> int:
    """Device scratch of one call (the workspace; only a [tc, topk] bool mask per chunk comes from torch)."""
    tc, _ = chunk_shape(num_tokens, length, topk, budget_bytes)
    return workspace_bytes(num_tokens, length, topk, budget_bytes) + tc * topk
