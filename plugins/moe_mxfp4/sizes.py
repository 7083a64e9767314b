"""MoEMXFP4 scratch arithmetic (bytes), pure Python: the planner and the graph exporter size the plugin's
workspace from here without importing Triton."""

H200_SMS = 132  # programs wanted per launch: two per SM of an H200 / H100 (132 SMs)
DEFAULT_SCRATCH_BUDGET = 256 * 2**20  # bytes of chunk scratch (partial sums + activations) per call
COMBINE_BLOCK_D = 512  # columns per program of the combine kernel
ACT_BLOCK_I = 512  # columns per program of the activation kernel (after a split up projection)


def pair_capacity(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the padded pair layout for `num_pairs` (token, choice) pairs: each of at most min(num_local,
    num_pairs) present experts pads its run by at most block_m - 1, rounded up to whole blocks."""
    return -(-(num_pairs + min(num_local, num_pairs) * (block_m - 1)) // block_m) * block_m


def chunk_tokens(top_k: int, dim: int, inter: int, budget_bytes: int) -> int:
    """Tokens per chunk so that one chunk's scratch fits `budget_bytes` (at least one token)."""
    per_token = 4 * top_k * (dim + inter)  # fp32 partial sums [k, D] and activations [k, I] per token
    return max(1, budget_bytes // per_token)


def aligned(n: int) -> int:
    """`n` bytes rounded up to 256."""
    return -(-n // 256) * 256


def block_m_for(num_pairs: int, num_local: int) -> int:
    """Rows per M-block of the pair layout: 128 (prefill: each decoded weight tile serves 128 tokens) when the
    experts get 256 pairs or more on average (a run's padding at most a third of it), 64 (tensor-core tiles) from
    32, else 16 (decode)."""
    experts = max(num_local, 1)
    return 128 if num_pairs >= 256 * experts else 64 if num_pairs >= 32 * experts else 16


def workspace_bytes(num_tokens: int, top_k: int, dim: int, inter: int, num_local: int, *,
                    block_m: int | None = None, budget_bytes: int = DEFAULT_SCRATCH_BUDGET) -> int:
    """Bytes of the caller-provided workspace (`moe_mxfp4_triton(workspace=...)`) for steps of up to
    `num_tokens`, each part 256-byte aligned: the largest chunk's partial sums [split_down * Tc*k, D] fp32,
    activations [C, I] (4 bytes counted: fp32 or bf16), the up projection's split-K partial sums [split_up * C,
    2I] fp32 (none without a split), pair rows [C] int64, block experts [C / block_m] int32 and the used-block
    count [1] int32, with C = pair_capacity(Tc*k) at `block_m` (None: `block_m_for` each chunk) and the splits of
    `tile_config` (largest over the smaller steps too: a split grows as the pairs shrink).
    TensorRT engines declare it as the plugin's second output, so it lives in the engine's device memory."""
    pairs = min(num_tokens, chunk_tokens(top_k, dim, inter, budget_bytes)) * top_k
    bm = block_m or block_m_for(pairs, num_local)
    cap = pair_capacity(pairs, num_local, bm)
    most_blocks = max(cap // bm, pair_capacity(pairs, num_local, block_m or 16) // (block_m or 16))
    layout = aligned(8 * cap) + aligned(4 * most_blocks) + aligned(4)  # pair rows, block experts, used blocks
    split_rows, pre_rows = pairs, 0
    for p in sorted({pairs, *range(1, min(pairs, num_local) + 1)}):
        cfg = tile_config(p, num_local, dim, inter)
        split_rows = max(split_rows, cfg["split_down"] * p)
        if cfg["split_up"] > 1:
            pre_rows = max(pre_rows, cfg["split_up"] * pair_capacity(p, num_local, block_m or cfg["block_m"]))
    return aligned(4 * split_rows * dim) + aligned(4 * cap * inter) + aligned(8 * pre_rows * inter) + layout


def block_programs(num_pairs: int, num_local: int, block_m: int, counted: bool) -> int:
    """Rows of the up and down grids for a chunk of `num_pairs` pairs, each program looping over the used
    M-blocks i, i + rows, ... (their count read on the device): every block of the pair capacity, or (counted
    rows) one per expert that can be present, so the grid does not grow with the buffer's rows and a decode step
    (one block per expert) keeps `tile_config`'s programs per SM."""
    blocks = pair_capacity(num_pairs, num_local, block_m) // block_m
    return min(blocks, num_local, num_pairs) if counted else blocks


def combine_programs(num_rows: int, dim: int, counted: bool) -> int:
    """Rows of the combine grid (columns: dim / COMBINE_BLOCK_D) for a chunk of `num_rows` rows, each program
    looping over the valid rows i, i + rows, ...: one per row, or (counted rows) about two programs per SM."""
    if not counted:
        return num_rows
    return min(num_rows, -(-2 * H200_SMS // -(-dim // COMBINE_BLOCK_D)))


def split_k(programs: int, k: int, block_k: int) -> int:
    """K splits for a grid of `programs` programs over K = k in steps of block_k: the fewest that give every SM
    of an H200 (`H200_SMS`) a program, at most one per step, none empty (each split takes cdiv(steps, splits)
    steps)."""
    steps = -(-k // block_k)
    per_split = -(-steps // max(1, min(steps, -(-H200_SMS // max(programs, 1)))))
    return -(-steps // per_split)


def tile_config(num_pairs: int, num_local: int, dim: int, inter: int) -> dict:
    """Launch tiles for a chunk of `num_pairs` pairs: BLOCK_M from `sizes.block_m_for`. Prefill: BLOCK_N 128 at
    BLOCK_M 64, 64 at BLOCK_M 128 (the gate and up accumulators of 128 x 128 would spill), halved (to 16 at
    least) while the up or down grid over the experts that can be present has fewer than two programs per SM,
    BLOCK_K 128, 8 warps (wgmma). Decode: BLOCK_N 64, BLOCK_K 256 (at most the shorter of D and I), two warps of 32 weight
    rows each (mma.sync; the token tile is the B operand, shared by a warp's two row tiles), and K split
    (`split_k`: `split_up` over D, `split_down` over I) until every SM has a program. 3 stages."""
    block_m = block_m_for(num_pairs, num_local)
    blocks = min(num_local, num_pairs)
    widest = 1 << (min(dim, inter).bit_length() - 1)  # K steps no longer than the shorter weight row
    if block_m >= 64:
        block_n = 128 if block_m == 64 else 64
        while block_n > 16 and blocks * -(-min(dim, inter) // block_n) < 2 * H200_SMS:
            block_n //= 2
        return dict(block_m=block_m, block_n=block_n, block_k=min(128, widest), num_warps=8, num_stages=3,
                    split_up=1, split_down=1)  # fmt: skip
    block_n, block_k = 64, min(256, widest)
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=2, num_stages=3,
                split_up=split_k(blocks * -(-inter // block_n), dim, block_k),
                split_down=split_k(blocks * -(-dim // block_n), inter, block_k))  # fmt: skip
