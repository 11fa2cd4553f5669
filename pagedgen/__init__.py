"""pagedgen: continuous batching over a paged KV cache, one transactional engine step at a time.

The public names (docs/architecture.md) are resolved lazily so that ``import pagedgen`` stays cheap and a
command such as ``pagedgen --help`` does not pay for torch model code it does not use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Model": "pagedgen.models.model",
    "Tokenizer": "pagedgen.models.tokenizer",
    "IncrementalDetokenizer": "pagedgen.models.tokenizer",
    "SyntheticModel": "pagedgen.models.synthetic",
    "Engine": "pagedgen.engine.engine",
    "EngineConfig": "pagedgen.engine.config",
    "EngineStats": "pagedgen.engine.engine",
    "GeneratorParams": "pagedgen.engine.request",
    "RequestOptions": "pagedgen.engine.request",
    "TurnOptions": "pagedgen.engine.request",
    "Request": "pagedgen.engine.request",
    "RequestStatus": "pagedgen.engine.request",
    "EngineEvent": "pagedgen.engine.events",
    "EngineEventBuffer": "pagedgen.engine.events",
    "EngineEventFlags": "pagedgen.engine.events",
    "FinishReason": "pagedgen.engine.events",
    "EngineErrorCode": "pagedgen.errors",
    "Usage": "pagedgen.engine.events",
    "TokenLogprobs": "pagedgen.engine.events",
    "LLM": "pagedgen.llm",
    "SamplingParams": "pagedgen.sampling.params",
    "StructuredOutputsParams": "pagedgen.sampling.params",
    "CompletionOutput": "pagedgen.llm",
    "NgramProposer": "pagedgen.spec",
    "DraftDriver": "pagedgen.spec",
    "PagedGenError": "pagedgen.errors",
    "ModelLoadError": "pagedgen.errors",
    "UnsupportedArchitectureError": "pagedgen.errors",
    "TokenizerError": "pagedgen.errors",
    "EngineError": "pagedgen.errors",
    "CacheError": "pagedgen.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
