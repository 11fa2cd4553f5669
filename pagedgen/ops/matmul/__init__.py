"""Linear layers: per-shape GEMM backends, weights kept in their stored format, and the path tables."""
