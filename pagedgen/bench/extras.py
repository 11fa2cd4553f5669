"""The ``bench`` extra: what it installs beyond pagedgen's core, and the error that names it when missing.

``pip install -e '.[bench]'`` brings ONNX Runtime GenAI and its model builder's needs (the peers), httpx
(``bench serve``) and matplotlib (charts). Core use (generate, chat, serve, ``bench throughput`` against
transformers) needs none of them, so each is imported only where it is used, through :func:`require`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install -e '.[bench]'"


class MissingBenchExtra(ImportError):
    """A module of the ``bench`` extra is not installed; the message says what needs it and how to install."""


def importable(module: str) -> bool:
    """True when ``module`` can be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingBenchExtra` naming ``purpose`` and the extra."""
    if not importable(module):
        raise MissingBenchExtra(f"{purpose} needs {module}, which the bench extra installs: {INSTALL_HINT}")
    return importlib.import_module(module)
