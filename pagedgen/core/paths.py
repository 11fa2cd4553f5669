"""Where pagedgen keeps what it builds once and reuses: dequantised GGUF entries, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAGEDGEN_CACHE_DIR"


def cache_root() -> Path:
    """``$PAGEDGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedgen``, else ``~/.cache/pagedgen``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedgen"
