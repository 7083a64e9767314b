"""DSAIndexer launch and scratch arithmetic (bytes), pure Python: the planner and the graph exporter size the
plugin's workspace from here without importing Triton."""

DEFAULT_SCRATCH_BUDGET = 256 * 2**20  # bytes of score and selection scratch per call
MAX_CHUNK_POSITIONS = 65536
SELECT_BLOCK = 1024  # candidates per step of the select kernel's passes
TARGET_PROGRAMS = 264  # score programs per launch: two per SM of an H100 / H200 (132 SMs)
MAX_BLOCKS_PER_PROGRAM = 16


def padded_topk(topk: int) -> int:
    """The select kernel's sort width: topk rounded up to a power of two."""
    return 1 << max(topk - 1, 0).bit_length()


def blocks_per_program(num_tokens: int, positions: int, block_n: int) -> int:
    """BLOCK_N-position blocks each score program walks (its token's queries loaded once): as many as keep about
    TARGET_PROGRAMS programs, 1..MAX_BLOCKS_PER_PROGRAM."""
    blocks = -(-max(positions, 1) // block_n)
    return max(1, min(MAX_BLOCKS_PER_PROGRAM, blocks * num_tokens // TARGET_PROGRAMS))


def chunk_shape(num_tokens: int, length: int, topk: int, budget_bytes: int, block_n: int = 64) -> tuple[int, int]:
    """(tokens, positions) per chunk: positions a multiple of block_n, at most `length` rounded up and at most
    MAX_CHUNK_POSITIONS; tokens as many as keep the chunk's buffers (`workspace_bytes`) within the budget."""
    lc = min(-(-max(length, 1) // block_n) * block_n, MAX_CHUNK_POSITIONS)
    return max(1, min(num_tokens, budget_bytes // per_token_bytes(lc, topk))), lc


def per_token_bytes(lc: int, topk: int) -> int:
    """Chunk bytes per token: scores fp32 [lc]; running best values fp32 [topk] (their positions are the
    output); the select kernel's compacted sort keys int64 [padded_topk]."""
    return 4 * lc + 4 * topk + 8 * padded_topk(topk)


def workspace_bytes(num_tokens: int, length: int, topk: int, budget_bytes: int = DEFAULT_SCRATCH_BUDGET) -> int:
    """Bytes of the caller-provided workspace (`dsa_indexer_triton(workspace=...)`) for steps of up to
    `num_tokens` tokens over `length` candidate positions (TensorRT engines declare it as the plugin's second
    output, so it lives in the engine's device memory)."""
    tc, lc = chunk_shape(num_tokens, length, topk, budget_bytes)
    return tc * per_token_bytes(lc, topk) + 3 * 256  # 3 buffers, each 256-byte aligned


def scratch_bytes(num_tokens: int, length: int, topk: int, budget_bytes: int = DEFAULT_SCRATCH_BUDGET) -> int:
    """Device scratch of one call: the workspace (nothing else comes from torch)."""
    return workspace_bytes(num_tokens, length, topk, budget_bytes)
