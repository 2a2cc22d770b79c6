"""The shapes the paged engine's captured steps take: rows rounded up to a bucket, block tables to a power-of-two
width, so a server meets a bounded set of CUDA graphs and verify() shapes (each new one compiles or captures)."""
from __future__ import annotations

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def table_width(blocks: int) -> int:
    """Block-table columns of a captured decode step: a power of two >= 16 (few shapes as contexts grow)."""
    m = 16
    while m < blocks:
        m *= 2
    return m


def bucket(rows: int) -> int:
    """The captured decode shape for ``rows`` decoding requests: the next size in BUCKETS (or ``rows`` above it)."""
    return next((b for b in BUCKETS if b >= rows), rows)
