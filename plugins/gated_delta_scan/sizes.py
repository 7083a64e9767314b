"""GatedDeltaScan launch arithmetic, pure Python (the TensorRT plugin's AOT grid and the planner need no Triton)."""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """(BK, BV): the whole key dimension per program, value tiles of at most 32 columns."""
    return next_power_of_2(K), min(32, next_power_of_2(V))


def state_bytes(num_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """Bytes of one sequence's recurrent state [H, V, K] fp32 (one pool slot)."""
    return 4 * num_heads * head_k_dim * head_v_dim
