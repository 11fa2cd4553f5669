"""Sequence mixers over packed paged steps: paged attention (CPU and Triton), conv, Mamba-2 scan."""
