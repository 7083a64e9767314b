"""SparseMLAAttention launch arithmetic, pure Python (no Triton import)."""

from ..gated_delta_scan.sizes import next_power_of_2


def block_sizes(kv_lora_rank: int, rope_dim: int) -> tuple[int, int]:
    """(BLOCK_DC, BLOCK_DR): the latent and rope widths rounded up to powers of two (at least 16, for tl.dot)."""
    return max(16, next_power_of_2(kv_lora_rank)), max(16, next_power_of_2(rope_dim))


SPLIT_TARGET_PROGRAMS = 264  # two programs per SM of an H200 / H100 (132 SMs)
MAX_SPLITS = 64


def num_splits(programs: int, keys: int, block_k: int) -> int:
    """Splits of each token's `keys` (flash decoding) so that `programs` (tokens x head blocks) x splits reaches
    SPLIT_TARGET_PROGRAMS, each split at least one BLOCK_K step: a power of two in [1, MAX_SPLITS] (one query
    at top-2048 in 32-key steps: 64 programs, as FlashMLA's split decode spreads one query over the SMs)."""
    splits = 1
    while (programs * splits < SPLIT_TARGET_PROGRAMS and splits < MAX_SPLITS
           and keys >= 2 * splits * block_k):  # fmt: skip
        splits *= 2
    return splits
