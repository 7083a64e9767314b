"""SparseMLAAttention launch arithmetic, pure Python (no Triton import)."""

from ..gated_delta_scan.sizes import next_power_of_2


def block_sizes(kv_lora_rank: int, rope_dim: int) -> tuple[int, int]:
    """(BLOCK_DC, BLOCK_DR): the latent and rope widths rounded up to powers of two (at least 16, for tl.dot)."""
    return max(16, next_power_of_2(kv_lora_rank)), max(16, next_power_of_2(rope_dim))
