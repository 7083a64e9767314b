"""PagedCacheWrite arithmetic, pure Python: bytes of a pool row."""

from moe_export.quantize.fp8_cache import SCALE_BYTES


def row_bytes(dim: int, element_bytes: int, fp8: bool) -> int:
    """Bytes of one cached row of `dim` values: fp8 rows (1 byte a value) carry their E8M0 scale byte after them."""
    return dim + SCALE_BYTES if fp8 else dim * element_bytes
