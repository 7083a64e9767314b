"""ShortConv launch arithmetic, pure Python (the TensorRT plugin's AOT grid and the planner need no Triton)."""

from ..gated_delta_scan.sizes import next_power_of_2


def block_sizes(C: int, W: int) -> tuple[int, int, int]:
    """(BT, BC, BW): 16-token tiles, channel tiles of at most 128, the window padded to a power of two."""
    return 16, min(128, next_power_of_2(C)), next_power_of_2(max(W - 1, 1))


def state_bytes(channels: int, width: int, element_bytes: int) -> int:
    """Bytes of one sequence's window state [C, W-1] (one pool slot) at `element_bytes` per value."""
    return element_bytes * channels * (width - 1)
